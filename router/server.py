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
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router.config import MAX_RECEIVE_MESSAGE_BYTES, RouterConfig
from router.metrics import RequestClock, RouterMetrics
from router.policies import DECODE, PREFILL, estimate_prompt_tokens, make_policy
from router.validation import InvalidRequest, validate_generate_request
from router.worker_pool import Lease, NoHealthyWorker, WorkerPool

log = logging.getLogger(__name__)

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


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

    def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.GenerateResponse]:
        clock = RequestClock(self._metrics)
        outcome = _Outcome()
        self._metrics.started()
        try:
            yield from self._generate(request, context, clock, outcome)
        finally:
            self._metrics.finished(outcome.name)

    def GetStatus(self, request: router_pb2.StatusRequest, context: grpc.ServicerContext) -> router_pb2.StatusResponse:
        return router_pb2.StatusResponse(
            workers=self._pool.snapshot(),
            in_flight_requests=self._metrics.in_flight,
            total_requests=self._metrics.total_requests,
        )

    def _generate(
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext, clock: RequestClock, outcome: _Outcome
    ) -> Iterator[router_pb2.GenerateResponse]:
        try:
            validate_generate_request(request)
            lease = self._pool.assign(self._decode_policy, self._prefill_policy, estimate_prompt_tokens(request))
        except InvalidRequest as exc:
            _abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoHealthyWorker as exc:
            _abort(context, outcome, grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            decode_request = _decode_request(request, request.request_id or uuid.uuid4().hex, lease)
            yield from self._relay(decode_request, lease, context, clock, outcome)
        finally:
            lease.release()

    def _relay(
        self,
        decode_request: worker_pb2.DecodeRequest,
        lease: Lease,
        context: grpc.ServicerContext,
        clock: RequestClock,
        outcome: _Outcome,
    ) -> Iterator[router_pb2.GenerateResponse]:
        call = lease.decode_stub.Generate(decode_request, timeout=self._stream_timeout(context))
        if not context.add_callback(call.cancel):
            call.cancel()
        finished = False
        try:
            for response in call:
                if finished:
                    log.warning("decode worker %s sent a message after the last one", lease.decode_address)
                    continue
                finished = _stamp(response, decode_request.request_id, lease, clock)
                if finished:
                    outcome.name = common_pb2.FinishReason.Name(response.finish_reason)
                yield response
        except grpc.RpcError as exc:
            _relay_failure(exc, lease, context, outcome)
            return  # the client cancelled (otherwise _relay_failure aborted)
        finally:
            call.cancel()
        if not finished:
            message = f"decode worker {lease.decode_address} ended the stream without a finish_reason"
            _abort(context, outcome, grpc.StatusCode.INTERNAL, message)

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


def _decode_request(request: router_pb2.GenerateRequest, request_id: str, lease: Lease) -> worker_pb2.DecodeRequest:
    decode_request = worker_pb2.DecodeRequest(request_id=request_id, prefill_address=lease.prefill_address)
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
        futures.ThreadPoolExecutor(max_workers=config.max_concurrent_streams, thread_name_prefix="router"),
        options=[("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)],
    )
    metrics = RouterMetrics()
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(config, pool, metrics), server)
    health_servicer = _add_health(server)
    reflection.enable_server_reflection((ROUTER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as exc:
        pool.close()
        raise OSError(f"cannot bind router to {config.host}:{config.port}: {exc}") from exc
    if port == 0:
        pool.close()
        raise OSError(f"cannot bind router to {config.host}:{config.port}")
    server.start()
    return RouterServer(server, pool, metrics, health_servicer, config.host, port), port


def _add_health(server: grpc.Server) -> health.HealthServicer:
    health_servicer = health.HealthServicer()
    for service in ("", ROUTER_SERVICE):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return health_servicer
