"""Test-only fault injection, read from the environment in this one place (never a command-line flag
of a production parser). Tests set the variables for a worker they start (in process, or through
the local launcher, which passes its environment on); unset, nothing is injected.

- ``PDSERVE_INJECT_KV_FAULT=corrupt|stall`` and ``PDSERVE_INJECT_KV_FAULT_COUNT=N`` (default 1): a
  prefill worker breaks the KV stream of its next N transfers (prefill_worker/faults.py).
- ``PDSERVE_INJECT_LOOP_DEATH_AFTER_STEPS=N``: a decode worker's engine loop thread dies after N
  steps (liveness tests).
- ``PDSERVE_INJECT_STEP_DELAY_MS=MS``: a decode worker sleeps this long before each engine step (slows
  a tiny model's streams so that tests can act mid-stream, e.g. migrate).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_KV_FAULT = "PDSERVE_INJECT_KV_FAULT"
ENV_KV_FAULT_COUNT = "PDSERVE_INJECT_KV_FAULT_COUNT"
ENV_LOOP_DEATH_AFTER_STEPS = "PDSERVE_INJECT_LOOP_DEATH_AFTER_STEPS"
ENV_STEP_DELAY_MS = "PDSERVE_INJECT_STEP_DELAY_MS"
KV_FAULT_MODES = ("corrupt", "stall")


@dataclass(frozen=True)
class InjectedFaults:
    """The faults a worker injects (all off by default)."""

    kv_fault: str | None = None
    kv_fault_count: int = 1
    loop_death_after_steps: int | None = None
    step_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_fault is not None and self.kv_fault not in KV_FAULT_MODES:
            raise ValueError(f"{ENV_KV_FAULT}: one of {', '.join(KV_FAULT_MODES)}, got {self.kv_fault!r}")
        if self.kv_fault_count < 0 or self.step_delay_ms < 0 or (self.loop_death_after_steps or 0) < 0:
            raise ValueError(f"fault injection: counts and delays must be >= 0, got {self}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> InjectedFaults:
        """The faults the environment asks for; ValueError naming a malformed variable."""

        def number(name: str, kind: type) -> int | float | None:
            text = env.get(name, "").strip()
            if not text:
                return None
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{name}: expected a number, got {text!r}") from None

        count, death, delay = (
            number(ENV_KV_FAULT_COUNT, int),
            number(ENV_LOOP_DEATH_AFTER_STEPS, int),
            number(ENV_STEP_DELAY_MS, float),
        )
        return cls(
            kv_fault=env.get(ENV_KV_FAULT, "").strip() or None,
            kv_fault_count=1 if count is None else int(count),
            loop_death_after_steps=None if death is None else int(death),
            step_delay_ms=0.0 if delay is None else delay,
        )

    def env(self) -> dict[str, str]:
        """The environment variables that inject these faults (for tests that start workers)."""
        out = {ENV_KV_FAULT_COUNT: str(self.kv_fault_count)}
        if self.kv_fault is not None:
            out[ENV_KV_FAULT] = self.kv_fault
        if self.loop_death_after_steps is not None:
            out[ENV_LOOP_DEATH_AFTER_STEPS] = str(self.loop_death_after_steps)
        if self.step_delay_ms:
            out[ENV_STEP_DELAY_MS] = repr(self.step_delay_ms)
        return out
