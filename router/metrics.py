"""Request metrics of the router: in-memory counters and latency samples, mirrored to Prometheus.

Definitions follow ``vllm bench serve``: TTFT = request received -> first response carrying tokens;
ITL = gap between consecutive responses carrying tokens; E2E = request received -> last response.
Thread-safe; samples are kept in bounded windows so memory stays constant.

ITL is measured at every token-carrying response but recorded in batches (`ITL_BATCH` gaps, and
whatever is left when the request ends), so the relay does not take the metrics lock and update
the histogram once per token.
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from prometheus_client import Histogram

from pdserve.router.prom_metrics import RouterPrometheus

SAMPLE_WINDOW = 10_000
#: A request's inter-token gaps are recorded this many at a time (and the rest when it ends).
ITL_BATCH = 32
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

    def add_many(self, values: list[float]) -> None:
        self._samples.extend(values)
        self._count += len(values)
        self._max = max(self._max, *values)

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

    def record_many(self, series: LatencySeries, values: list[float]) -> None:
        """`record` for several samples at once (one lock, one histogram update per bucket)."""
        if not values:
            return
        with self._lock:
            series.add_many(values)
        histogram = self._prom_series.get(id(series))
        if histogram is not None:
            observe_many(histogram, values)

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
        self._itl: list[float] = []  # gaps not recorded yet (see ITL_BATCH)

    def on_tokens(self) -> None:
        """Call when a response carrying tokens (text or ids) is about to be sent."""
        now = time.monotonic()
        last = self._last_token_at
        self._last_token_at = now
        if last is None:
            self.ttft_s = now - self.start
            self._metrics.record(self._metrics.ttft, self.ttft_s)
            return
        itl = self._itl
        itl.append(now - last)
        if len(itl) >= ITL_BATCH:
            self.flush()

    def flush(self) -> None:
        """Record the inter-token gaps measured so far (on_tokens does every ITL_BATCH; finish and
        sample do the rest)."""
        if self._itl:
            self._metrics.record_many(self._metrics.itl, self._itl)
            self._itl = []

    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def count_tokens(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Count the usage reported with the request's last response."""
        self.prompt_tokens, self.output_tokens = prompt_tokens, completion_tokens
        self._metrics.count_tokens(prompt_tokens, completion_tokens)

    def finish(self) -> float:
        """Record and return the end-to-end latency."""
        self.flush()
        e2e = time.monotonic() - self.start
        self.e2e_s = e2e
        self._metrics.record(self._metrics.e2e, e2e)
        return e2e

    def sample(self, ok: bool) -> FinishedSample:
        """This request as a FinishedSample (call once it ended); records the gaps not recorded yet."""
        self.flush()
        tpot = (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 and self.e2e_s else 0.0
        return FinishedSample(
            time.monotonic(), self.ttft_s, tpot, self.queue_s, self.prompt_tokens, self.output_tokens, ok
        )


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for every v in `values`, with one update of its sum and of each bucket
    hit (prometheus_client's Histogram takes a lock per update). Falls back to observing one by one
    when the histogram does not have the fields this relies on (`_upper_bounds`, `_buckets`, `_sum`)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    counts: dict[int, int] = {}
    for value in values:
        if value != value:  # NaN: observe() counts it in no bucket
            continue
        index = bisect.bisect_left(bounds, value)  # the first bound >= value, as observe() picks
        if index < len(bounds):
            counts[index] = counts.get(index, 0) + 1
    total.inc(sum(values))
    for index, count in counts.items():
        buckets[index].inc(count)
