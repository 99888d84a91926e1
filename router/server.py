"""The Router gRPC service: validate, assign workers, relay the decode worker's stream.

Invariants:
- Validation runs before anything else, so invalid requests fail with INVALID_ARGUMENT even when no
  worker is reachable.
- Exactly one DecodeWorker.Generate call per accepted request, with a deadline (the client's remaining
  time, capped by RouterConfig.max_stream_timeout_s). When the client cancels, that call is cancelled
  (the decode worker then cancels its prefill call). When it fails, the client gets its status code and
  details unchanged.
- The router overwrites timings.ttft_s and timings.e2e_s of the last message with its own measurements.
- The worker lease of a request is released on every exit path.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Generator, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router.auth import BearerTokenInterceptor
from router.config import MAX_RECEIVE_MESSAGE_BYTES, RouterConfig
from router.metrics import RequestClock, RouterMetrics
from router.policies import DECODE, PREFILL, estimate_prompt_tokens, make_policy, prefix_key
from router.validation import InvalidRequest, validate_generate_request
from router.worker_pool import Lease, NoHealthyWorker, WorkerPool
from telemetry.grpc_logging import RequestLoggingInterceptor

log = logging.getLogger(__name__)

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


#: Statuses from a decode worker that mean "a worker failed", not "the request is wrong".
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
#: Details prefix of a decode worker's UNAVAILABLE caused by the prefill side (decode_worker.servicer).
PREFILL_FAILURE = "prefill failed on"
#: After a failure, how long to wait for some worker of the needed role to be healthy again.
RECOVERY_WAIT_S = 3.0


@dataclass(frozen=True)
class _Failure:
    address: str  # the worker to avoid next time
    details: str


@dataclass
class _Outcome:
    """How one Generate stream ended (a finish reason name or a status code name), for metrics."""

    name: str = "CANCELLED"


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Thin servicer: protobuf in, pool + policies, protobuf out."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self._config = config
        self._pool = pool
        self._metrics = metrics
        self._prefill_policy = make_policy(config.prefill_policy, PREFILL)
        self._decode_policy = make_policy(config.decode_policy, DECODE)
        self._admission = threading.BoundedSemaphore(config.max_concurrent_streams)  # backpressure

    def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.GenerateResponse]:
        if not self._admission.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router at capacity: {self._config.max_concurrent_streams} requests in flight; retry later",
            )
        clock = RequestClock(self._metrics)
        outcome = _Outcome()
        self._metrics.started()
        try:
            yield from self._generate(request, context, clock, outcome)
        finally:
            self._metrics.finished(outcome.name)
            self._admission.release()

    def GetStatus(self, request: router_pb2.StatusRequest, context: grpc.ServicerContext) -> router_pb2.StatusResponse:
        return router_pb2.StatusResponse(
            workers=self._pool.snapshot(),
            in_flight_requests=self._metrics.in_flight,
            total_requests=self._metrics.total_requests,
        )

    def _generate(
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext, clock: RequestClock, outcome: _Outcome
    ) -> Iterator[router_pb2.GenerateResponse]:
        """Validate, then relay from one (decode, prefill) pair; when a worker fails, resume the request
        on another pair with the tokens already delivered, at most config.max_attempts times."""
        try:
            validate_generate_request(request)
        except InvalidRequest as exc:
            _abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = request.request_id or uuid.uuid4().hex
        delivered: list[int] = []  # token ids the client already has
        avoid: set[str] = set()
        failure: _Failure | None = None
        for attempt in range(self._config.max_attempts):
            if attempt:
                self._metrics.failed_over()
                time.sleep(min(1.0, 0.1 * 2**attempt))  # let health polls catch up with a dead worker
            lease = self._assign(request, avoid, context, outcome)
            try:
                decode_request = _decode_request(request, request_id, lease, delivered)
                failure = yield from self._relay(decode_request, lease, context, clock, outcome, delivered)
            finally:
                lease.release()
            if failure is None:
                return
            log.warning("request_id=%s attempt %d failed on %s: %s; %d tokens delivered so far", request_id,
                        attempt + 1, failure.address, failure.details, len(delivered))
            avoid.add(failure.address)
            self._pool.suspect(failure.address)
        assert failure is not None
        _abort(context, outcome, grpc.StatusCode.UNAVAILABLE,
               f"gave up after {self._config.max_attempts} attempts; last: {failure.details}")

    def _assign(
        self, request: router_pb2.GenerateRequest, avoid: set[str], context: grpc.ServicerContext, outcome: _Outcome
    ) -> Lease:
        """Pick workers. After a failure (`avoid` not empty) wait a few health polls for a worker that
        was only suspected to come back, then give up with UNAVAILABLE."""
        deadline = time.monotonic() + (RECOVERY_WAIT_S if avoid else 0.0)
        while True:
            try:
                return self._pool.assign(
                    self._decode_policy, self._prefill_policy, estimate_prompt_tokens(request), frozenset(avoid),
                    prefix_key(request),
                )
            except NoHealthyWorker as exc:
                if time.monotonic() >= deadline or not context.is_active():
                    _abort(context, outcome, grpc.StatusCode.UNAVAILABLE, str(exc))
            time.sleep(0.1)

    def _relay(
        self,
        decode_request: worker_pb2.DecodeRequest,
        lease: Lease,
        context: grpc.ServicerContext,
        clock: RequestClock,
        outcome: _Outcome,
        delivered: list[int],
    ) -> Generator[router_pb2.GenerateResponse, None, _Failure | None]:
        """Relay one decode worker's stream. Returns None when the request ended (finished, or the
        client left), a _Failure when a worker failed in a way worth retrying; aborts otherwise."""
        call = lease.decode_stub.Generate(decode_request, timeout=self._stream_timeout(context))
        if not context.add_callback(call.cancel):
            call.cancel()
        try:
            for response in call:
                finished = _stamp(response, decode_request.request_id, lease, clock)
                delivered.extend(response.token_ids)
                if finished:
                    outcome.name = common_pb2.FinishReason.Name(response.finish_reason)
                yield response
                if finished:
                    return None
        except grpc.RpcError as exc:
            if not context.is_active():
                outcome.name = "CANCELLED"
                return None
            if exc.code() not in RETRYABLE:
                _relay_failure(exc, lease, context, outcome)
            details = exc.details() or exc.code().name
            failed = lease.prefill_address if details.startswith(PREFILL_FAILURE) else lease.decode_address
            return _Failure(failed, f"{exc.code().name}: {details}")
        finally:
            call.cancel()
        return _Failure(lease.decode_address, f"decode worker {lease.decode_address} ended the stream early")

    def _stream_timeout(self, context: grpc.ServicerContext) -> float:
        remaining = context.time_remaining()
        cap = self._config.max_stream_timeout_s
        return cap if remaining is None else max(0.0, min(remaining, cap))


def _stamp(response: router_pb2.GenerateResponse, request_id: str, lease: Lease, clock: RequestClock) -> bool:
    """Fill router-side fields of one relayed response; return True if it is the last one."""
    response.request_id = request_id
    if response.text or response.token_ids:
        clock.on_tokens()
        lease.prefill_done()
    if response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        return False
    response.timings.ttft_s = clock.ttft_s
    response.timings.e2e_s = clock.finish()
    clock.count_tokens(response.usage.prompt_tokens, response.usage.completion_tokens)
    return True


def _relay_failure(exc: grpc.RpcError, lease: Lease, context: grpc.ServicerContext, outcome: _Outcome) -> None:
    """Client gone: end quietly. Otherwise pass the decode worker's status to the client."""
    if not context.is_active():
        outcome.name = "CANCELLED"
        return
    log.info("decode worker %s failed: %s: %s", lease.decode_address, exc.code().name, exc.details())
    _abort(context, outcome, exc.code(), exc.details() or f"decode worker {lease.decode_address} failed")


def _abort(context: grpc.ServicerContext, outcome: _Outcome, code: grpc.StatusCode, details: str) -> NoReturn:
    outcome.name = code.name
    context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")


def _decode_request(
    request: router_pb2.GenerateRequest, request_id: str, lease: Lease, delivered: list[int]
) -> worker_pb2.DecodeRequest:
    decode_request = worker_pb2.DecodeRequest(
        request_id=request_id, prefill_address=lease.prefill_address, resume_output_ids=delivered
    )
    kind = request.WhichOneof("input")
    if kind == "prompt":
        decode_request.prompt = request.prompt
    elif kind == "messages":
        decode_request.messages.CopyFrom(request.messages)
    else:
        decode_request.token_ids.CopyFrom(request.token_ids)
    if request.HasField("params"):
        decode_request.params.CopyFrom(request.params)
    return decode_request


class RouterServer:
    """A running router: the grpc server, its worker pool, request metrics and health service."""

    def __init__(
        self,
        server: grpc.Server,
        pool: WorkerPool,
        metrics: RouterMetrics,
        health_servicer: health.HealthServicer,
        host: str,
        port: int,
    ) -> None:
        self.grpc_server = server
        self.pool = pool
        self.metrics = metrics
        self._health = health_servicer
        self.port = port
        self.address = f"{host}:{port}"
        self.bridge_port: int | None = None  # insecure loopback port for the HTTP bridge when TLS is on

    def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting calls, let open streams finish for ``grace`` seconds, close worker channels."""
        self._health.enter_graceful_shutdown()
        self.grpc_server.stop(grace).wait()
        self.pool.close()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until the server stopped (True) or ``timeout`` passed (False)."""
        return bool(self.grpc_server.wait_for_termination(timeout))


def serve(config: RouterConfig) -> tuple[RouterServer, int]:
    """Poll the workers once, start the router server on config.host:config.port; return it and its port."""
    pool = WorkerPool(config.endpoints(), config.poll_interval_s, config.info_timeout_s)
    pool.start()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_concurrent_streams + 32, thread_name_prefix="router"),
        options=[("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)],
        interceptors=_interceptors(config),
    )
    metrics = RouterMetrics()
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(config, pool, metrics), server)
    health_servicer = _add_health(server)
    reflection.enable_server_reflection((ROUTER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = _bind(server, config)
    except OSError:
        pool.close()
        raise
    server.start()
    router = RouterServer(server, pool, metrics, health_servicer, config.host, port)
    if config.tls_cert_file and config.http_port is not None:  # the HTTP bridge's own loopback door
        router.bridge_port = server.add_insecure_port("127.0.0.1:0")
    return router, port


def _interceptors(config: RouterConfig) -> list[grpc.ServerInterceptor]:
    interceptors: list[grpc.ServerInterceptor] = [RequestLoggingInterceptor(assign_missing_ids=True)]
    if config.auth_token:
        interceptors.insert(0, BearerTokenInterceptor(config.auth_token))
    return interceptors


def _bind(server: grpc.Server, config: RouterConfig) -> int:
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


def _add_health(server: grpc.Server) -> health.HealthServicer:
    health_servicer = health.HealthServicer()
    for service in ("", ROUTER_SERVICE):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return health_servicer
