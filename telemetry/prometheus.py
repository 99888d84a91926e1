"""The ``/metrics`` endpoint: prometheus_client's own HTTP server over one process registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

# Latency buckets in seconds, from sub-millisecond steps to multi-minute generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class MetricsEndpoint:
    """A running ``/metrics`` server; ``port`` is the bound port (useful when asked for port 0)."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_endpoint(registry: CollectorRegistry, port: int | None,
                           host: str = "127.0.0.1") -> MetricsEndpoint | None:
    """Serve ``registry`` on ``host:port``; None (nothing started) when ``port`` is 0 or None."""
    if not port:
        return None
    return MetricsEndpoint(registry, port, host)
