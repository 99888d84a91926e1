"""Test-only fault injection comes from PDSERVE_INJECT_* variables, never from a production parser."""

from __future__ import annotations

import pytest

from pdserve.engine.fault_injection import InjectedFaults


def test_faults_round_trip_through_the_environment() -> None:
    assert InjectedFaults.from_env({}) == InjectedFaults()
    for faults in (
        InjectedFaults(kv_fault="stall", kv_fault_count=2),
        InjectedFaults(loop_death_after_steps=6),
        InjectedFaults(step_delay_ms=40.0),
    ):
        assert InjectedFaults.from_env(faults.env()) == faults


@pytest.mark.parametrize(
    "env",
    [
        {"PDSERVE_INJECT_KV_FAULT": "melt"},
        {"PDSERVE_INJECT_STEP_DELAY_MS": "soon"},
        {"PDSERVE_INJECT_LOOP_DEATH_AFTER_STEPS": "-1"},
    ],
)
def test_a_malformed_variable_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="PDSERVE_INJECT|fault injection"):
        InjectedFaults.from_env(env)


def test_no_worker_parser_has_an_inject_flag() -> None:
    from pdserve.decode_worker.process import build_parser as decode_parser
    from pdserve.prefill_worker.process import build_parser as prefill_parser

    for parser in (prefill_parser(), decode_parser()):
        flags = [flag for action in parser._actions for flag in action.option_strings]
        assert flags and not [flag for flag in flags if "inject" in flag]
