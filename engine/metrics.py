"""Prometheus metrics of a worker process (prefill, decode or colocated), one registry per instance.

Both worker roles import this module; each observes what it knows:
- prefill: ``pdserve_request_queue_time_seconds`` (queued -> batched), ``pdserve_prefill_batch_size``
  (prompts per pass), ``pdserve_prompt_tokens_total`` (prompt tokens computed), KV sent
  (``pdserve_kv_transfer_{bytes,seconds,failures}`` with ``backend`` and ``direction="send"``).
- decode: ``pdserve_decode_batch_size`` (sequences per step), ``pdserve_generation_tokens_total``,
  ``pdserve_tokenize_seconds`` and ``pdserve_detokenize_seconds`` (per request, on the worker that
  tokenizes and streams text),
  KV received (``direction="receive"``), and the gauges ``pdserve_num_requests_running``,
  ``pdserve_num_requests_waiting``, ``pdserve_kv_blocks_used``, ``pdserve_kv_blocks_total`` (read at
  scrape time through ``bind_gauges``).
Latency as the client sees it (TTFT, ITL, E2E) is measured by the router.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.telemetry.prometheus import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS

TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics:
    """The metric objects of one worker; cheap to create (tests make one per worker instance)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_time = Histogram(
            "pdserve_request_queue_time_seconds",
            "Time a request waited in the queue",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_batch_size = Histogram(
            "pdserve_prefill_batch_size", "Prompts per prefill pass", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.decode_batch_size = Histogram(
            "pdserve_decode_batch_size", "Sequences per decode step", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated", registry=r)
        labels = ("backend", "direction")
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved between workers", labels, registry=r)
        self.kv_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Duration of one request's KV transfer",
            labels,
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.kv_failures = Counter("pdserve_kv_transfer_failures", "Failed KV transfers", labels, registry=r)
        self.requests_running = Gauge("pdserve_num_requests_running", "Requests holding KV and decoding", registry=r)
        self.requests_waiting = Gauge(
            "pdserve_num_requests_waiting", "Requests queued for KV room or prefill", registry=r
        )
        self.kv_blocks_used = Gauge("pdserve_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.tokenize_time = Histogram(
            "pdserve_tokenize_seconds",
            "Turning one request's prompt into token ids",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.detokenize_time = Histogram(
            "pdserve_detokenize_seconds",
            "Turning one request's output ids into streamed text (summed over tokens)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_blocks_total = Gauge("pdserve_kv_blocks_total", "KV cache blocks in the pool", registry=r)

    def bind_gauges(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        blocks_used: Callable[[], float],
        blocks_total: Callable[[], float],
    ) -> None:
        """Make the gauges read the worker's state at scrape time (each callable must be cheap)."""
        self.requests_running.set_function(running)
        self.requests_waiting.set_function(waiting)
        self.kv_blocks_used.set_function(blocks_used)
        self.kv_blocks_total.set_function(blocks_total)

    def kv_transferred(self, backend: str, direction: str, nbytes: int, seconds: float | None) -> None:
        self.kv_bytes.labels(backend, direction).inc(nbytes)
        if seconds is not None:
            self.kv_seconds.labels(backend, direction).observe(seconds)

    def kv_failed(self, backend: str, direction: str) -> None:
        self.kv_failures.labels(backend, direction).inc()
