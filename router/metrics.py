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

from router.prom_metrics import RouterPrometheus

SAMPLE_WINDOW = 10_000


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
        self._metrics.count_tokens(prompt_tokens, completion_tokens)

    def finish(self) -> float:
        """Record and return the end-to-end latency."""
        e2e = time.monotonic() - self.start
        self._metrics.record(self._metrics.e2e, e2e)
        return e2e
