"""The test modules' Ray start-up helper (e2e_helpers.start_ray): one more try after a start-up
time-out, nothing else retried."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from e2e_helpers import start_ray  # noqa: E402

TIMED_OUT = "The current node timed out during startup. This could happen because ..."


def test_a_start_up_time_out_is_tried_once_more() -> None:
    calls: list[int] = []

    def start() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise Exception(TIMED_OUT)  # noqa: TRY002 - what Ray raises
        return "started"

    assert start_ray(start, pause_s=0) == "started" and len(calls) == 2


def test_a_second_time_out_and_any_other_failure_are_raised() -> None:
    calls: list[int] = []

    def always_times_out() -> None:
        calls.append(1)
        raise Exception(TIMED_OUT)  # noqa: TRY002

    with pytest.raises(Exception, match="timed out during startup"):
        start_ray(always_times_out, pause_s=0)
    assert len(calls) == 2

    def broken() -> None:
        calls.append(1)
        raise ValueError("bad address")

    with pytest.raises(ValueError, match="bad address"):
        start_ray(broken, pause_s=0)
    assert len(calls) == 3  # not retried
