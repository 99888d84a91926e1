"""SLO admission: predict a request's time to first token from the work ahead of it, and refuse at
once the requests that would miss their TTFT objective instead of serving them late.

The model: TTFT after dispatch is the larger of
- seconds per token of prefill work x (prompt tokens pending on the worker that prefills it, this
  prompt's included), the rate learned online from every request's first token (an exponential
  moving average of observed TTFT / work; work counted as at least `MIN_WORK_TOKENS` so that tiny
  prompts' fixed costs do not inflate the rate), and
- the recent TTFT on that same worker (a moving average of its last first tokens, forgotten after
  `RECENT_S` without one): under load, what the last requests there waited is what the next one
  waits, whatever the token count says (a decode worker prefilling locally between decode steps).
A request that would wait in the admission queue is checked before it queues: the queue's predicted
wait plus the best prediction over every worker that could take it (its backlog and recent TTFT),
so that a refusal is answered at once rather than after the wait; a request that passed that check
is served, never refused after its wait. How far that prediction ran short is measured on the
requests it admitted (`Calibration`: actual TTFT / predicted, at the 90th percentile of the recent
ones) and the check scales its prediction by it, so that the admitted meet their SLO whatever the
queue's model gets wrong under load. Until `MIN_SAMPLES` first tokens were observed nothing is
refused: the router does not guess before it has measured.

Invariants:
- A refusal happens before any worker does work for the request (at admission), answers
  RESOURCE_EXHAUSTED with a retry-after hint (the predicted excess, at least 1 s), and is counted.
- A best-effort request is never refused by the SLO; it is admitted and served as capacity allows.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

#: First tokens observed before the model predicts (and so before anything is refused).
MIN_SAMPLES = 5
#: Weight of the newest observation in the moving average.
ALPHA = 0.1
#: Work below this many tokens counts as this many (fixed per-request costs).
MIN_WORK_TOKENS = 64
#: A worker's recent TTFT counts this long after its last first token (a worker nobody is sent to,
#: because it was predicted late, is not predicted late forever).
RECENT_S = 1.0
#: Weight of the newest first token in a worker's recent TTFT.
RECENT_ALPHA = 0.3


#: Calibration: the admitted requests' (predicted, actual) pairs it keeps, the fewest it acts on, and
#: the share of them whose actual TTFT the calibrated prediction covers.
CALIBRATION_SAMPLES = 256
MIN_CALIBRATION_SAMPLES = 20
CALIBRATION_QUANTILE = 0.9
#: The calibration factor's floor (a prediction is never trusted to overstate by more than this).
MIN_CALIBRATION = 0.25


class SloMiss(RuntimeError):
    """A request whose predicted TTFT exceeds its objective; `retry_after_s` is the client's hint."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class TtftModel:
    """Seconds per token of prefill work, learned from first tokens (see the module doc)."""

    seconds_per_token: float = 0.0
    samples: int = 0
    recent: dict[str, tuple[float, float]] = field(default_factory=dict)  # worker -> (TTFT average, when)

    @property
    def ready(self) -> bool:
        return self.samples >= MIN_SAMPLES

    def observe(self, ttft_s: float, work_tokens: int, worker: str = "", now: float | None = None) -> None:
        rate = ttft_s / max(MIN_WORK_TOKENS, work_tokens)
        self.seconds_per_token = (
            rate if self.samples == 0 else self.seconds_per_token + ALPHA * (rate - self.seconds_per_token)
        )
        self.samples += 1
        if worker:
            now = time.monotonic() if now is None else now
            average, when = self.recent.get(worker, (ttft_s, now))
            if now - when > RECENT_S:
                average = ttft_s
            self.recent[worker] = (average + RECENT_ALPHA * (ttft_s - average), now)

    def best(self, backlogs: Mapping[str, int], prompt_tokens: int, now: float | None = None) -> float:
        """The lowest predicted TTFT of a `prompt_tokens` prompt over the workers that may prefill it
        (`backlogs`: each one's pending prompt tokens; 0 when there is none): a request that must
        queue waits at least that long after it leaves the queue."""
        return min(
            (self.predict(backlog + prompt_tokens, worker, now) for worker, backlog in backlogs.items()), default=0.0
        )

    def predict(self, work_tokens: int, worker: str = "", now: float | None = None) -> float:
        by_work = self.seconds_per_token * max(MIN_WORK_TOKENS, work_tokens)
        average, when = self.recent.get(worker, (0.0, 0.0))
        now = time.monotonic() if now is None else now
        return max(by_work, average) if now - when <= RECENT_S else by_work


class Calibration:
    """How far the TTFTs of admitted requests ran over what was predicted for them: `factor` is
    the CALIBRATION_QUANTILE of actual / predicted over the last CALIBRATION_SAMPLES (1 until
    MIN_CALIBRATION_SAMPLES are known), so a prediction times it covers that share of requests."""

    def __init__(self) -> None:
        self._ratios: deque[float] = deque(maxlen=CALIBRATION_SAMPLES)
        self.factor = 1.0

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s <= 0:
            return
        self._ratios.append(actual_s / predicted_s)
        if len(self._ratios) >= MIN_CALIBRATION_SAMPLES:
            ranked = sorted(self._ratios)
            self.factor = max(MIN_CALIBRATION, ranked[min(len(ranked) - 1, int(CALIBRATION_QUANTILE * len(ranked)))])


def check(predicted_s: float, slo_s: float) -> None:
    """Raise SloMiss when `predicted_s` exceeds `slo_s` (> 0)."""
    if predicted_s > slo_s:
        raise SloMiss(
            f"predicted TTFT {predicted_s:.2f}s exceeds the SLO {slo_s:.2f}s; retry later or send it best_effort",
            float(max(1, math.ceil(predicted_s - slo_s))),
        )
