"""Prometheus metrics of the router process (one registry per RouterMetrics instance).

Same definitions as the in-memory series of ``router.metrics`` (``vllm bench serve``): TTFT = request
received -> first token-carrying response, ITL = gap between token-carrying responses, E2E = request
received -> last response. Token counters come from the decode worker's final ``usage``.
``pdserve_num_requests_waiting`` and ``pdserve_request_queue_time_seconds`` describe the admission
queue. ``pdserve_failovers_total`` counts requests moved to another worker after a failure,
``pdserve_migrations_total`` running requests moved live to another decode worker (Router.Migrate).
``pdserve_worker_waits_total{stage}`` counts requests that found no healthy worker of a stage while a
restarting one was still registered, and waited for it (``pdserve_worker_wait_seconds``: how long;
``outcome`` served, gave_up or cancelled: the client left first).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.telemetry.prometheus import LATENCY_BUCKETS

ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class RouterPrometheus:
    """The router's metric objects; ``registry`` is what ``/metrics`` serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Request received -> first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Gap between token-carrying responses",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request received -> last response",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated for finished requests", registry=r
        )
        self.requests_running = Gauge("pdserve_num_requests_running", "Generate streams open", registry=r)
        self.requests = Counter(
            "pdserve_requests", "Ended Generate streams by outcome (finish reason or status)", ["outcome"], registry=r
        )
        self.requests_waiting = Gauge(
            "pdserve_num_requests_waiting",
            "Requests in the router's admission queue, waiting for a decode slot",
            registry=r,
        )
        self.queue_time = Histogram(
            "pdserve_request_queue_time_seconds",
            "Request received -> admitted to a worker (router queue)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.failovers = Counter("pdserve_failovers", "Requests moved to another worker after a failure", registry=r)
        self.migrations = Counter(
            "pdserve_migrations", "Running requests moved live to another decode worker", registry=r
        )
        self.worker_waits = Counter(
            "pdserve_worker_waits",
            "Requests that waited for a restarting worker of a stage with no healthy one",
            ["stage"],
            registry=r,
        )
        self.worker_wait_time = Histogram(
            "pdserve_worker_wait_seconds",
            "How long a request waited for a restarting worker",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.role_switches = Counter(
            "pdserve_role_switches", "Workers switched from one role to another", ["from_role", "to_role"], registry=r
        )
        self.route_decisions = Counter(
            "pdserve_route_decisions",
            "Requests by how they were placed: colocated, "
            "disaggregated, local_cached / local_prefill_busy (conditional "
            "disaggregation), pinned (n > 1), migration",
            ["route"],
            registry=r,
        )
        self.route_prompt_tokens = Counter(
            "pdserve_route_prompt_tokens",
            "Prompt tokens of requests routed with a KV hint (KV-aware policies)",
            registry=r,
        )
        self.route_cached_tokens = Counter(
            "pdserve_route_cached_tokens",
            "Of those, tokens the KV index said the worker that prefills them already caches",
            registry=r,
        )
        self.route_shipped_tokens = Counter(
            "pdserve_route_shipped_tokens",
            "Of those, tokens the chosen decode worker lacked and a prefill worker sent it (disaggregated requests)",
            registry=r,
        )
        self.kv_index_entries = Gauge(
            "pdserve_kv_index_entries",
            "(block, worker) entries in the router's KV index (KV-aware policies)",
            registry=r,
        )
        self.slo_shed = Counter(
            "pdserve_slo_shed", "Requests refused because their predicted TTFT exceeded their SLO", registry=r
        )
        self.slo_calibration = Gauge(
            "pdserve_slo_calibration",
            "SLO admission: the factor its predictions before "
            "queueing are scaled by (90th percentile of actual / predicted TTFT)",
            registry=r,
        )
        self.slo_shed_answer = Histogram(
            "pdserve_slo_shed_answer_seconds",
            "Request received -> refused by SLO admission",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
