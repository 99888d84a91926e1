"""Request metrics of the router: in-memory counters and latency samples, mirrored to Prometheus.

Definitions follow ``vllm bench serve``: TTFT = request received -> first response carrying tokens;
ITL = gap between consecutive responses carrying tokens; E2E = request received -> last response.
Thread-safe; samples are kept in bounded windows so memory stays constant.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from pdserve.router.prom_metrics import RouterPrometheus

SAMPLE_WINDOW = 10_000
RECENT_WINDOW_S = 60.0  # finished requests kept for StatusResponse.recent (the autoscaler's input)


@dataclass(frozen=True)
class FinishedSample:
    """One finished request as the router measured it (StatusResponse.recent)."""

    finished_at: float  # time.monotonic()
    ttft_s: float
    tpot_s: float
    queue_s: float
    prompt_tokens: int
    output_tokens: int
    ok: bool


@dataclass(frozen=True)
class LatencySummary:
    """Summary of one latency series in seconds (over the retained window, count over all time)."""

    count: int
    mean_s: float
    p50_s: float
    p99_s: float
    max_s: float


class LatencySeries:
    """A bounded window of latency samples plus all-time count and max."""

    def __init__(self, window: int = SAMPLE_WINDOW) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._count = 0
        self._max = 0.0

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self._count += 1
        self._max = max(self._max, seconds)

    def summary(self) -> LatencySummary:
        if not self._samples:
            return LatencySummary(self._count, 0.0, 0.0, 0.0, self._max)
        ordered = sorted(self._samples)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return LatencySummary(self._count, statistics.fmean(ordered), statistics.median(ordered), p99, self._max)


class RouterMetrics:
    """Request counters and TTFT / ITL / E2E series, shared by all Generate streams."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total_requests = 0
        self.in_flight = 0
        self.outcomes: Counter[str] = Counter()
        self.ttft = LatencySeries()
        self.itl = LatencySeries()
        self.e2e = LatencySeries()
        self.prom = RouterPrometheus()
        self._recent: deque[FinishedSample] = deque()
        self._prom_series = {id(self.ttft): self.prom.ttft, id(self.itl): self.prom.itl, id(self.e2e): self.prom.e2e}

    def started(self) -> None:
        with self._lock:
            self.total_requests += 1
            self.in_flight += 1
        self.prom.requests_running.inc()

    def finished(self, outcome: str) -> None:
        """Count one ended stream; ``outcome`` is a finish reason or status code name."""
        with self._lock:
            self.in_flight -= 1
            self.outcomes[outcome] += 1
        self.prom.requests_running.dec()
        self.prom.requests.labels(outcome).inc()

    def remember(self, sample: FinishedSample) -> None:
        """Keep one finished request for RECENT_WINDOW_S seconds (`recent`)."""
        with self._lock:
            self._recent.append(sample)
            self._forget_before(sample.finished_at - RECENT_WINDOW_S)

    def recent(self, window_s: float) -> list[FinishedSample]:
        """Requests that finished within the last `window_s` seconds (at most RECENT_WINDOW_S), oldest first."""
        now = time.monotonic()
        with self._lock:
            self._forget_before(now - RECENT_WINDOW_S)
            since = now - min(window_s, RECENT_WINDOW_S)
            return [s for s in self._recent if s.finished_at >= since]

    def _forget_before(self, cutoff: float) -> None:
        while self._recent and self._recent[0].finished_at < cutoff:
            self._recent.popleft()

    def count_tokens(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Count the usage reported with a request's last response."""
        self.prom.prompt_tokens.inc(prompt_tokens)
        self.prom.generation_tokens.inc(completion_tokens)

    def failed_over(self) -> None:
        """Count one request moved to another worker after a failure."""
        self.prom.failovers.inc()

    def migrated(self) -> None:
        """Count one running request moved live to another decode worker."""
        self.prom.migrations.inc()

    def record(self, series: LatencySeries, seconds: float) -> None:
        with self._lock:
            series.add(seconds)
        histogram = self._prom_series.get(id(series))
        if histogram is not None:
            histogram.observe(seconds)

    def summaries(self) -> dict[str, LatencySummary]:
        with self._lock:
            return {"ttft": self.ttft.summary(), "itl": self.itl.summary(), "e2e": self.e2e.summary()}


class RequestClock:
    """Measures one request: TTFT at the first token-carrying response, ITL between such responses."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self.start = time.monotonic()
        self.ttft_s = 0.0
        self.e2e_s = 0.0
        self.queue_s = 0.0  # set when the request leaves the admission queue
        self.prompt_tokens = 0
        self.output_tokens = 0
        self._last_token_at: float | None = None

    def on_tokens(self) -> None:
        """Call when a response carrying tokens (text or ids) is about to be sent."""
        now = time.monotonic()
        if self._last_token_at is None:
            self.ttft_s = now - self.start
            self._metrics.record(self._metrics.ttft, self.ttft_s)
        else:
            self._metrics.record(self._metrics.itl, now - self._last_token_at)
        self._last_token_at = now

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def count_tokens(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Count the usage reported with the request's last response."""
        self.prompt_tokens, self.output_tokens = prompt_tokens, completion_tokens
        self._metrics.count_tokens(prompt_tokens, completion_tokens)

    def finish(self) -> float:
        """Record and return the end-to-end latency."""
        e2e = time.monotonic() - self.start
        self.e2e_s = e2e
        self._metrics.record(self._metrics.e2e, e2e)
        return e2e

    def sample(self, ok: bool) -> FinishedSample:
        """This request as a FinishedSample (call once it ended)."""
        tpot = (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 and self.e2e_s else 0.0
        return FinishedSample(time.monotonic(), self.ttft_s, tpot, self.queue_s, self.prompt_tokens,
                              self.output_tokens, ok)
