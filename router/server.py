"""The Router gRPC service on an event loop: a thin servicer over `router.core.RouterCore`.

Invariants:
- One `grpc.aio` server on one event loop thread serves every stream (no thread per stream); the
  OpenAI HTTP API, when on, runs on the same loop and calls the same `RouterCore` directly (no
  loopback gRPC hop).
- `RouterError`s become the gRPC status with the same code and details; a refusal from the admission
  queue also carries `retry-after` (seconds) in the trailing metadata.
- The router overwrites timings.ttft_s and timings.e2e_s of the last message with its own measurements.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.router.auth import BearerToken, BearerTokenInterceptor
from pdserve.router.config import MAX_RECEIVE_MESSAGE_BYTES, RouterConfig
from pdserve.router.core import RouterCore, RouterError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import COLOCATED, DECODE, PREFILL
from pdserve.router.worker_pool import WorkerPool
from pdserve.serving import AioServer, CallLimits, PeerCallLimiter, RequestParseInterceptor
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

if TYPE_CHECKING:  # aiohttp is imported only where the HTTP API starts
    from pdserve.router.http_api import OpenAIHttpServer

log = logging.getLogger(__name__)

DEFAULT_SWITCH_TIMEOUT_S = 120.0
ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: PREFILL,
    common_pb2.WORKER_ROLE_DECODE: DECODE,
    common_pb2.WORKER_ROLE_COLOCATED: COLOCATED,
}
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Thin servicer: protobuf in, RouterCore, protobuf out."""

    def __init__(self, core: RouterCore, tokens: BearerToken | None = None) -> None:
        self._core = core
        self._tokens = tokens  # to find the caller's tenant (the interceptor already refused strangers)

    async def Generate(  # noqa: N802
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # grpc.aio's writer API (a coroutine calling context.write) rather than an async generator:
        # one generator layer less per relayed token
        write = context.write
        tenant = self._tokens.tenant_in(context.invocation_metadata()) if self._tokens else None
        try:
            async for response in self._core.generate(request, context.time_remaining(), tenant or None):
                await write(response)
        except RouterError as exc:
            if exc.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(int(exc.retry_after_s))),))
            await context.abort(exc.code, exc.details)

    async def Migrate(  # noqa: N802
        self, request: router_pb2.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.MigrateResponse:
        try:
            return await self._core.migrate(request.request_id, request.to_worker_id)
        except RouterError as exc:
            await context.abort(exc.code, exc.details)
            raise AssertionError("unreachable") from exc  # context.abort raises

    async def GetStatus(  # noqa: N802
        self, request: router_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.StatusResponse:
        return self._core.status(request.recent_window_s)

    async def SwitchRole(  # noqa: N802
        self, request: router_pb2.SwitchRoleRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.SwitchRoleResponse:
        role = ROLE_NAMES.get(request.role)
        if role is None or not request.worker_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "worker_id and role (prefill, decode or colocated) are required"
            )
            raise AssertionError("unreachable")  # context.abort raises
        timeout_s = request.drain_timeout_s if request.drain_timeout_s > 0 else DEFAULT_SWITCH_TIMEOUT_S
        try:
            return await self._core.switch_role(request.worker_id, role, timeout_s)
        except RouterError as exc:
            await context.abort(exc.code, exc.details)
            raise AssertionError("unreachable") from exc  # context.abort raises


class RouterServer:
    """A running router: the event-loop gRPC server, its core, worker pool, metrics, health, HTTP API."""

    def __init__(
        self, server: AioServer, core: RouterCore, health_servicer: health.HealthServicer, host: str, port: int
    ) -> None:
        self.grpc_server = server
        self.core = core
        self.pool = core.pool
        self.metrics = core.metrics
        self._health = health_servicer
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self._http: OpenAIHttpServer | None = None  # once started
        self.http_port: int | None = None

    def start_http(
        self,
        port: int,
        model_name: str,
        auth_token: str | Mapping[str, str | None] | None,
        timeout_s: float,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> int:
        """Serve the OpenAI-compatible HTTP API on this router's loop; return the bound port."""
        from pdserve.router.http_api import OpenAIHttpServer  # aiohttp only when asked

        self._http = http = OpenAIHttpServer(
            self.core, model_name, self.host, port, auth_token, timeout_s, tls_cert_file, tls_key_file
        )
        return self.grpc_server.loop_thread.run(http.start(), timeout=30)

    def drain(self, timeout_s: float) -> int:
        """Shutdown's first step: report NOT_SERVING, refuse new requests (UNAVAILABLE; HTTP 503), let
        open ones finish for up to `timeout_s`, then end those left with UNAVAILABLE (their workers
        abort them and free their KV). Returns how many were ended so; `stop` comes next."""
        self._health.enter_graceful_shutdown()
        return self.grpc_server.loop_thread.run(self.core.drain(timeout_s), timeout=timeout_s + 30)

    def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting calls, let open streams finish for ``grace`` seconds, close worker channels."""
        self._health.enter_graceful_shutdown()
        self.pool.on_change = None
        if self._http is not None:
            self.grpc_server.loop_thread.run(self._http.stop(), timeout=30)
        if not self.grpc_server.wait_for_termination(0):
            self.grpc_server.loop_thread.run(self.core.close(), timeout=10)
        self.grpc_server.stop(grace)
        self.pool.close()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until the server stopped (True) or ``timeout`` passed (False)."""
        return self.grpc_server.wait_for_termination(timeout)


def serve(config: RouterConfig) -> tuple[RouterServer, int]:
    """Poll the workers once, start the router server on config.host:config.port (and the HTTP API
    when config.http_port is set); return it and its gRPC port."""
    pool = WorkerPool(config.endpoints(), config.poll_interval_s, config.info_timeout_s)
    pool.start()
    limits = call_limits(config)
    server = AioServer(
        "router",
        options=[("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES), *limits.options()],
        interceptors=_interceptors(config, limits),
    )

    async def make_core() -> RouterCore:
        return RouterCore(config, pool, RouterMetrics())

    core = server.loop_thread.run(make_core())
    health_servicer = health.HealthServicer()

    def add(s: grpc.aio.Server) -> None:
        tokens = config.api_tokens
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(core, BearerToken(tokens) if tokens else None), s)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, s)
        reflection.enable_server_reflection((ROUTER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), s)

    server.register(add)
    try:
        port = _bind(server, config)
        server.start()
    except OSError:
        pool.close()
        server.stop(None)
        raise
    for service in ("", ROUTER_SERVICE):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    pool.on_change = lambda: server.loop_thread.call(core.wake)
    router = RouterServer(server, core, health_servicer, config.host, port)
    if config.http_port is not None:
        try:
            router.http_port = router.start_http(
                config.http_port,
                config.model_name,
                config.api_tokens,
                config.max_stream_timeout_s,
                config.tls_cert_file,
                config.tls_key_file,
            )
        except OSError:
            router.stop(None)
            raise
    return router, port


#: Beyond the stream deadline cap, what a call still needs to end once its deadline passed (its
#: cancellation reaching the workers and the last message); an aged connection gets the cap plus this.
AGE_GRACE_MARGIN_S = 30.0


def call_limits(config: RouterConfig) -> CallLimits:
    """The public port's call and connection limits. An aged connection's grace outlasts the longest
    call (the stream deadline cap), so the age cap never cuts a stream."""
    return CallLimits(
        per_peer=config.grpc_calls_per_peer,
        total=config.grpc_calls_total,
        connection_idle_s=config.grpc_connection_idle_s,
        connection_age_s=config.grpc_connection_age_s,
        connection_age_grace_s=config.max_stream_timeout_s + AGE_GRACE_MARGIN_S,
    )


def _interceptors(config: RouterConfig, limits: CallLimits) -> list[grpc.aio.ServerInterceptor]:
    # no RequestLoggingInterceptor: RouterCore logs each request's start and finish, for gRPC and HTTP.
    # Order: the token check, then the call limits (an unauthenticated call is never counted), then parsing
    interceptors: list[grpc.aio.ServerInterceptor] = [
        PeerCallLimiter(limits, "router.grpc_calls_per_peer, router.grpc_calls_total"),
        RequestParseInterceptor(),
    ]
    tokens = config.api_tokens
    if tokens:
        interceptors.insert(0, BearerTokenInterceptor(tokens))
    return interceptors


def _bind(server: AioServer, config: RouterConfig) -> int:
    """Bind the public port, over TLS when a certificate is configured; return the port."""
    address = f"{config.host}:{config.port}"
    try:
        if config.tls_cert_file and config.tls_key_file:
            with open(config.tls_key_file, "rb") as key, open(config.tls_cert_file, "rb") as cert:
                credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind router to {address}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot bind router to {address}")
    return port
