"""The event-loop gRPC server every pdserve process runs (router, prefill and decode workers).

A `grpc.aio` server lives on an asyncio event loop in a thread of its own (`LoopThread`), so
callers (launchers, Ray actors, tests) keep a plain blocking API: `start()`, `stop(grace)`,
`wait_for_termination()`.

Invariants:
- Streaming calls (Router.Generate, DecodeWorker.Generate, PrefillWorker.Prefill) are coroutines on
  the loop: an open stream holds no thread, so a thousand of them cost a thousand small tasks.
- Plain (non-async) handlers, the control plane (GetInfo, Abort, PushKv, health), run on a thread
  pool of their own (`control_threads`) that streams never occupy, so they answer while every
  stream is open.
- Engine threads hand results to the loop with `LoopThread.call` (`call_soon_threadsafe`); nothing
  polls a queue.

- Every server bounds its open calls (`CallLimits`): per connection by HTTP/2's
  ``max_concurrent_streams``, per peer host and in total by `PeerCallLimiter`, which refuses a call
  over either with RESOURCE_EXHAUSTED before it reads the call's message.
- Every server bounds its connections (`CallLimits.options`): their number, the time one may stay
  without a call or without finishing its handshake, and (the router's public port) their age, with
  a grace that outlasts the longest request, so no stream is cut by it.

Hand-written (not generated); imports only grpc, `pdserve.limits`, `pdserve.omp_pool` and the
standard library (and uvloop when installed).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from pdserve.limits import (
    GRPC_CALLS_PER_PEER,
    GRPC_CALLS_TOTAL,
    GRPC_CONNECTION_IDLE_S,
    GRPC_CONNECTIONS_SHARE,
    GRPC_HANDSHAKE_S,
    GRPC_KEEPALIVE_S,
    GRPC_KEEPALIVE_TIMEOUT_S,
    GRPC_MIN_PING_INTERVAL_S,
    GRPC_PING_STRIKES,
    GRPC_STREAMS_PER_CONNECTION,
    fd_share,
)
from pdserve.omp_pool import release_thread_pool

T = TypeVar("T")

#: Threads for the non-streaming handlers of one server (GetInfo, Abort, PushKv, health).
CONTROL_THREADS = 32
#: Start of the one stdout line a pdserve process prints once it serves: ``PDSERVE_READY {json}``
#: (address, worker_id, pid, role and optional extra addresses); the launchers wait for it.
READY_PREFIX = "PDSERVE_READY"
#: grpc.StatusCode by its number: grpc.aio reports some statuses as raw numbers, and GenerateMux end
#: items carry them as numbers.
STATUS_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


#: Which event loop the servers run on: ``uvloop`` (default when installed; cheaper per message) or
#: ``asyncio`` (the standard library's). Set with the environment variable PDSERVE_EVENT_LOOP.
EVENT_LOOP_ENV = "PDSERVE_EVENT_LOOP"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the configured kind (see EVENT_LOOP_ENV)."""
    kind = os.environ.get(EVENT_LOOP_ENV, "uvloop").strip().lower()
    if kind not in ("uvloop", "asyncio"):
        raise ValueError(f"{EVENT_LOOP_ENV}={kind!r}: expected 'uvloop' or 'asyncio'")
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:  # not installed (e.g. Windows): the standard loop serves the same
            return asyncio.new_event_loop()
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    """An asyncio event loop running forever in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # an event loop serves, it never computes: no OpenMP pool of its own, nor in its executor
        # (a second pool throttles the engine thread's, see pdserve/omp_pool.py)
        release_thread_pool()
        self.loop.set_default_executor(futures.ThreadPoolExecutor(initializer=release_thread_pool))
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop (any thread; a no-op once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: the server is gone, nobody listens
            pass

    @property
    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self) -> None:
        """Stop the loop and join its thread (idempotent). The loop is left stopped, not closed:
        grpc's completion-queue poller may still post late events of finished calls to it."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class AioServer:
    """A `grpc.aio.Server` on its own `LoopThread`, driven through a blocking API."""

    def __init__(
        self,
        name: str,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        control_threads: int = CONTROL_THREADS,
    ) -> None:
        self.loop_thread = LoopThread(name)
        self._control = futures.ThreadPoolExecutor(
            max_workers=control_threads, thread_name_prefix=f"{name}-ctl", initializer=release_thread_pool
        )
        self._stopped = threading.Event()
        self.server: grpc.aio.Server = self.loop_thread.run(self._create(list(options), list(interceptors)))

    async def _create(
        self, options: list[tuple[str, Any]], interceptors: list[grpc.aio.ServerInterceptor]
    ) -> grpc.aio.Server:
        return grpc.aio.server(migration_thread_pool=self._control, options=options, interceptors=interceptors)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.loop_thread.loop

    def register(self, add: Callable[[grpc.aio.Server], None]) -> None:
        """Add servicers, e.g. ``server.register(lambda s: add_FooServicer_to_server(foo, s))``."""

        async def _add() -> None:
            add(self.server)

        self.loop_thread.run(_add())

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """What the generated ``add_*Servicer_to_server`` functions call."""
        self.register(lambda s: s.add_generic_rpc_handlers(handlers))

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        self.register(lambda s: s.add_registered_method_handlers(service_name, method_handlers))

    def add_insecure_port(self, address: str) -> int:
        return self.server.add_insecure_port(address)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self.server.add_secure_port(address, credentials)

    def start(self) -> None:
        self.loop_thread.run(self.server.start(), timeout=30)

    def stop(self, grace: float | None = None) -> None:
        """Stop taking calls, give open ones ``grace`` seconds, then end them; blocks (idempotent)."""
        if self._stopped.is_set():
            return
        try:
            self.loop_thread.run(self.server.stop(grace), timeout=(grace or 0) + 30)
        finally:
            self._stopped.set()
            self._control.shutdown(wait=False, cancel_futures=True)
            self.loop_thread.close()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until `stop()` finished (True) or ``timeout`` passed (False)."""
        return self._stopped.wait(timeout)


#: Set by a launcher (`pdserve serve`) in its children's environment: it stops them itself, in order.
SUPERVISED_ENV = "PDSERVE_SUPERVISED"


def on_stop_signal(handler: Callable[[], None]) -> None:
    """Call `handler` (on the main thread) on SIGTERM, and on SIGINT unless a launcher supervises this
    process: a terminal's Ctrl-C reaches the launcher's whole process group, and the launcher stops
    its children itself in order (router first, so it drains before the workers go), so there a
    supervised child ignores SIGINT."""
    import signal

    signal.signal(signal.SIGTERM, lambda _signum, _frame: handler())
    if os.environ.get(SUPERVISED_ENV) == "1":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, lambda _signum, _frame: handler())


def ready_line(address: str, worker_id: str, **extra: Any) -> str:
    """The READY line announcing this serving process (see READY_PREFIX)."""
    payload = {"address": address, "worker_id": worker_id, "pid": os.getpid(), **extra}
    return f"{READY_PREFIX} {json.dumps(payload)}"


class RequestParseInterceptor(grpc.aio.ServerInterceptor):
    """Answers a unary request that does not parse (e.g. a string field with invalid UTF-8) with
    INVALID_ARGUMENT naming the message type, instead of grpc.aio's UNKNOWN. Put it first in the
    interceptor list: it parses the bytes itself and hands the message to the rest of the chain."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
            behavior = handler.unary_unary

            async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await behavior(await _parse(parse, raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)
        if handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream):
            writer_behavior = handler.unary_stream  # writes its responses with context.write

            async def writer(raw: bytes, context: grpc.aio.ServicerContext) -> None:
                await writer_behavior(await _parse(parse, raw, context), context)

            return grpc.unary_stream_rpc_method_handler(writer, None, handler.response_serializer)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            stream_behavior = handler.unary_stream

            # a coroutine writing each response, as grpc.aio itself does for an async generator; not
            # a wrapping async generator, which would add a layer to every streamed message
            async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> None:
                write = context.write
                async for response in stream_behavior(await _parse(parse, raw, context), context):
                    await write(response)

            return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)
        return handler


async def _parse(parse: Callable[[bytes], Any], raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(raw)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request does not parse: {exc}")


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


@dataclass(frozen=True)
class CallLimits:
    """How many calls a gRPC server keeps open (per peer host, in total, streams per connection) and
    how long and how many connections it keeps (`pdserve.limits` says why each value).

    `connection_age_s` (0: no cap) sends a connection a GOAWAY after that long; its open calls then
    get `connection_age_grace_s` to finish before it is closed, so the grace must outlast the longest
    call the server allows (the router: its stream deadline cap). Workers set no age: the router's
    GenerateMux and KvEvents.Subscribe streams last as long as the deployment."""

    per_peer: int = GRPC_CALLS_PER_PEER
    total: int = GRPC_CALLS_TOTAL
    streams_per_connection: int = GRPC_STREAMS_PER_CONNECTION
    connection_idle_s: float = GRPC_CONNECTION_IDLE_S
    connection_age_s: float = 0.0
    connection_age_grace_s: float = 0.0
    connections: int = field(default_factory=lambda: fd_share(GRPC_CONNECTIONS_SHARE))

    def __post_init__(self) -> None:
        for name in ("per_peer", "total", "streams_per_connection", "connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.connection_idle_s > 0:
            raise ValueError(f"connection_idle_s must be > 0, got {self.connection_idle_s}")
        for name in ("connection_age_s", "connection_age_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def options(self) -> list[tuple[str, int]]:
        """The server options of these limits: streams per connection, the connection cap, idle,
        handshake and age timers, keepalive and ping-abuse enforcement."""
        options = [
            ("grpc.max_concurrent_streams", self.streams_per_connection),
            ("grpc.max_allowed_incoming_connections", self.connections),
            ("grpc.max_connection_idle_ms", _ms(self.connection_idle_s)),
            ("grpc.server_handshake_timeout_ms", _ms(min(self.connection_idle_s, GRPC_HANDSHAKE_S))),
            ("grpc.keepalive_time_ms", _ms(GRPC_KEEPALIVE_S)),
            ("grpc.keepalive_timeout_ms", _ms(GRPC_KEEPALIVE_TIMEOUT_S)),
            ("grpc.http2.min_ping_interval_without_data_ms", _ms(GRPC_MIN_PING_INTERVAL_S)),
            ("grpc.http2.max_ping_strikes", GRPC_PING_STRIKES),
        ]
        if self.connection_age_s:
            options += [
                ("grpc.max_connection_age_ms", _ms(self.connection_age_s)),
                ("grpc.max_connection_age_grace_ms", _ms(self.connection_age_grace_s)),
            ]
        return options


#: Calls the limiter never counts: health checks, so that a peer at its cap (the router at a worker)
#: still learns whether the server is alive.
UNLIMITED_PREFIXES = ("/grpc.health.v1.Health/",)


def peer_host(peer: str) -> str:
    """The host part of `context.peer()`: ``ipv4:10.0.0.1:5000`` -> ``ipv4:10.0.0.1``; ``unix:...`` -> ``unix``."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer.split(":", 1)[0]


class PeerCallLimiter(grpc.aio.ServerInterceptor):
    """Refuses a call with RESOURCE_EXHAUSTED when its peer host already holds `limits.per_peer` open
    calls, or the server `limits.total`. The count is taken when the handler starts, before it reads
    the request (put this interceptor before `RequestParseInterceptor`, after any token check), and
    given back when the handler returns, fails or is cancelled. Handlers that run on the control
    thread pool are counted the same way."""

    def __init__(self, limits: CallLimits, setting: str = "") -> None:
        self.limits = limits
        self._setting = f" ({setting})" if setting else ""
        self._lock = threading.Lock()
        self._by_host: dict[str, int] = {}
        self._total = 0

    def open_calls(self, host: str | None = None) -> int:
        """Calls open now, from `host` (a `peer_host`) or from every peer."""
        with self._lock:
            return self._total if host is None else self._by_host.get(host, 0)

    def _enter(self, peer: str) -> tuple[str, str | None]:
        """(host, None) when the call may run (and is counted), else (host, why it is refused)."""
        host = peer_host(peer)
        with self._lock:
            held = self._by_host.get(host, 0)
            if held >= self.limits.per_peer:
                return host, (
                    f"too many concurrent calls from {host}: at most {self.limits.per_peer} per peer"
                    f"{self._setting}; retry when some have finished"
                )
            if self._total >= self.limits.total:
                return host, (
                    f"the server holds its limit of {self.limits.total} concurrent calls{self._setting}; retry later"
                )
            self._by_host[host] = held + 1
            self._total += 1
        return host, None

    def _leave(self, host: str) -> None:
        with self._lock:
            self._total -= 1
            left = self._by_host[host] - 1
            if left:
                self._by_host[host] = left
            else:
                del self._by_host[host]

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNLIMITED_PREFIXES):
            return handler
        kind, make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, kind)
        return make(
            self._wrap(behavior, handler.response_streaming), handler.request_deserializer, handler.response_serializer
        )

    def _wrap(self, behavior: Callable[..., Any], response_streaming: bool) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: ANN401
                host = await self._admit(context)
                try:
                    write = context.write
                    async for response in behavior(request, context):
                        await write(response)
                finally:
                    self._leave(host)

            return stream
        if inspect.iscoroutinefunction(behavior):

            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
                host = await self._admit(context)
                try:
                    return await behavior(request, context)
                finally:
                    self._leave(host)

            return call
        if response_streaming:  # a plain generator, iterated on the control thread pool

            def generate(request: Any, context: grpc.ServicerContext) -> Any:  # noqa: ANN401
                host = self._admit_sync(context)
                try:
                    yield from behavior(request, context)
                finally:
                    self._leave(host)

            return generate

        def plain(request: Any, context: grpc.ServicerContext) -> Any:  # noqa: ANN401
            host = self._admit_sync(context)
            try:
                return behavior(request, context)
            finally:
                self._leave(host)

        return plain

    async def _admit(self, context: grpc.aio.ServicerContext) -> str:
        host, refused = self._enter(context.peer())
        if refused is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        return host

    def _admit_sync(self, context: grpc.ServicerContext) -> str:
        host, refused = self._enter(context.peer())
        if refused is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        return host


_HANDLER_KINDS: dict[tuple[bool, bool], tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}
