"""The planner as the autoscaler's split chooser: for a traffic mix and n workers, the goodput
`capacity.planner.max_rate` predicts for every split pPqD. The CLI builds it (`planner_factory`) and
hands it to the autoscaler in `cluster`, which never imports this package.
"""

from __future__ import annotations

import functools
import logging
import math
import time

from pdserve.capacity.planner import Slos, Workload, max_rate, timing_for
from pdserve.capacity.simulator import Deployment
from pdserve.capacity.workload import LengthDist
from pdserve.cluster.autoscaler import AutoscalerConfig, Mix, PlannerFactory
from pdserve.engine.sim_profile import load_profile

log = logging.getLogger("pdserve.cluster.autoscaler")  # its lines go where the autoscaler's go


class PlannerSplits:
    """For a mix and n workers, the goodput `capacity.planner.max_rate` predicts for every split pPqD
    with p + q = n; cached per bucketed mix (prompt and output lengths to 25%)."""

    def __init__(
        self,
        profile_path: str,
        ttft_s: float | None,
        tpot_s: float | None,
        target: float = 0.9,
        speedup: float = 1.0,
        num_requests: int = 120,
    ) -> None:
        self._timing = timing_for(load_profile(profile_path))
        slos = {k: v for k, v in (("ttft", ttft_s), ("tpot", tpot_s)) if v is not None}
        # the profile is in profile time; a sim cluster with --speedup K runs K times faster
        self._slos = Slos({k: v * speedup for k, v in slos.items()}, target=target)
        self._speedup = speedup
        self._num_requests = num_requests
        self._cache: dict[tuple[int, int, int], dict[int, float]] = {}

    def __call__(self, mix: Mix, n: int) -> dict[int, float]:
        key = (_bucket(mix.prompt_tokens), _bucket(mix.output_tokens), n)
        if key not in self._cache:
            self._cache[key] = self._rates(key[0], key[1], n)
        return self._cache[key]

    def _rates(self, prompt: int, output: int, n: int) -> dict[int, float]:
        workload = Workload(LengthDist(values=(prompt,), weights=(1.0,)), LengthDist(values=(output,), weights=(1.0,)))
        started = time.monotonic()
        rates = {
            p: max_rate(self._timing, Deployment(p, n - p), workload, self._slos, self._num_requests, seed=0, rounds=4)
            * self._speedup
            for p in range(1, n)
        }
        log.info(
            "planner: %d prompt / %d output tokens on %d workers: %s (%.1fs)",
            prompt,
            output,
            n,
            ", ".join(f"{p}P{n - p}D {r:.2f}/s" for p, r in rates.items()),
            time.monotonic() - started,
        )
        return rates


def _bucket(tokens: float) -> int:
    """Round to a power of 1.25 (so nearby mixes share one planner run)."""
    return max(1, round(1.25 ** round(math.log(max(tokens, 1.0), 1.25))))


def planner_factory(profile: str | None, speedup: float = 1.0) -> PlannerFactory | None:
    """What builds the planner of a profile at the autoscaler's SLOs (None without a profile).
    `speedup`: the sim cluster runs that many times faster than profile time. A partial of a
    module-level function, so that Ray can ship it to the controller's node."""
    return functools.partial(_planner, profile, speedup) if profile else None


def _planner(profile: str, speedup: float, config: AutoscalerConfig) -> PlannerSplits:
    return PlannerSplits(profile, config.ttft_s, config.tpot_s, config.target, speedup)
