"""The ``/metrics`` endpoint: prometheus_client's own HTTP server over one process registry.

Who can reach it: by default it binds 127.0.0.1 and needs no credentials (anyone with a shell on the
host can read it). The router can bind it elsewhere (`--metrics-host`) only together with a bearer
token (`--auth-token-file`): the endpoint then answers 401 without ``Authorization: Bearer <token>``,
and it speaks HTTPS when the router has a certificate. Workers' endpoints are loopback only.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app, start_http_server
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from pdserve.constants import METRICS_ANY_PORT

# Latency buckets in seconds, from sub-millisecond steps to multi-minute generations.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _require_token(app: WsgiApp, token: str) -> WsgiApp:
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"missing or wrong bearer token (header 'Authorization')\n"]

    return guarded


def _guarded_server(
    registry: CollectorRegistry, port: int, host: str, auth_token: str, tls: tuple[str, str] | None
) -> tuple[WSGIServer, threading.Thread]:
    server = make_server(
        host,
        port,
        _require_token(make_wsgi_app(registry), auth_token),
        ThreadingWSGIServer,
        handler_class=_SilentHandler,
    )
    if tls is not None:
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread


class MetricsEndpoint:
    """A running ``/metrics`` server; ``port`` is the bound port (useful when asked for port 0)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str = "127.0.0.1",
        auth_token: str | None = None,
        tls: tuple[str, str] | None = None,
    ) -> None:
        if auth_token:
            self._server, self._thread = _guarded_server(registry, port, host, auth_token, tls)
        else:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._server.server_port)
        self.scheme = "https" if auth_token and tls else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_endpoint(
    registry: CollectorRegistry,
    port: int | None,
    host: str = "127.0.0.1",
    auth_token: str | None = None,
    tls: tuple[str, str] | None = None,
) -> MetricsEndpoint | None:
    """Serve ``registry`` on ``host:port`` (`METRICS_ANY_PORT`: a free port of the system's choosing, read back
    from ``.port``); None (nothing started) when ``port`` is 0 or None. With
    ``auth_token`` every scrape needs ``Authorization: Bearer <token>`` (and ``tls``, a (cert, key)
    pair, serves HTTPS)."""
    if not port:
        return None
    return MetricsEndpoint(registry, 0 if port == METRICS_ANY_PORT else port, host, auth_token, tls)
