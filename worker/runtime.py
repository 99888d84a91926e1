"""Process plumbing shared by both worker roles: threads, the event-loop gRPC server, health and
liveness, READY line, signals, and the protobuf <-> engine conversions both roles need.

The launcher (`cluster.local`) reads exactly one line `PDSERVE_READY {json}` from a worker's
stdout once it serves; everything else a worker says goes to stderr.

Liveness: a worker whose engine loop thread died reports NOT_SERVING on gRPC health and
`healthy: false` (with `unhealthy_reason`) in GetInfo, and refuses new requests with UNAVAILABLE, so
the router stops routing to it and fails its requests over (`LivenessWatch`).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_events import KvEventLog
from pdserve.engine.sampler import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stop_checker import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, FINISH_STOP_STRING
from pdserve.engine.trace import DecodeStepEvent, DetokenizeHoldEvent, PrefillPassEvent, TraceEvent, token_bytes
from pdserve.failures import RequestInvalid
from pdserve.omp_pool import dedicate_engine_thread
from pdserve.serving import AioServer, CallLimits, PeerCallLimiter, RequestParseInterceptor, on_stop_signal, ready_line
from pdserve.settings import ModelSection
from pdserve.telemetry.grpc_logging import RequestLoggingInterceptor
from pdserve.telemetry.logs import configure_logging
from pdserve.telemetry.memory import bound_heap
from pdserve.transport import add_port, server_interceptors, use_internal_token_file
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.config import WorkerConfig

log = logging.getLogger(__name__)

_FINISH_TO_PB = {
    FINISH_STOP: common_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FINISH_STOP_STRING: common_pb2.FINISH_REASON_STOP_STRING,
    FINISH_ABORT: common_pb2.FINISH_REASON_CANCELLED,
    FINISH_ERROR: common_pb2.FINISH_REASON_ERROR,
}


NODE_ID_ENV = "PDSERVE_NODE_ID"  # set by the Ray worker actor before it starts the worker (cluster.ray_actors)
NODE_HOST_ENV = "PDSERVE_NODE_HOST"


def node_identity() -> tuple[str, str]:
    """(node_id, host) this worker reports in WorkerInfo: the Ray node's id and IP inside a Ray actor,
    ("", host name) outside Ray."""
    import socket

    return os.environ.get(NODE_ID_ENV, ""), os.environ.get(NODE_HOST_ENV) or socket.gethostname()


def finish_reason_to_pb(reason: str | None) -> common_pb2.FinishReason:
    return _FINISH_TO_PB.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


def sampling_params_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Protobuf -> validated SamplingParams (RequestInvalid names the bad field)."""
    if pb.n > 1:
        raise RequestInvalid(
            f"n: a worker generates one choice; n={pb.n} is served by the router, which runs "
            "each choice as a request of its own"
        )
    return SamplingParams(
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else 16,
        temperature=pb.temperature if pb.HasField("temperature") else 0.0,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=pb.top_k,
        seed=pb.seed if pb.HasField("seed") else None,
        stop=tuple(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
        presence_penalty=pb.presence_penalty if pb.HasField("presence_penalty") else 0.0,
        frequency_penalty=pb.frequency_penalty if pb.HasField("frequency_penalty") else 0.0,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        min_p=pb.min_p if pb.HasField("min_p") else 0.0,
        min_tokens=pb.min_tokens,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        allowed_token_ids=tuple(pb.allowed_token_ids),
        bad_words=tuple(pb.bad_words),
        skip_special_tokens=pb.skip_special_tokens if pb.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(
            pb.spaces_between_special_tokens if pb.HasField("spaces_between_special_tokens") else True
        ),
        include_stop_str_in_output=pb.include_stop_str_in_output,
        cache_salt=pb.cache_salt,
        structured=structured_from_pb(pb.structured) if pb.HasField("structured") else None,
    )


def structured_from_pb(pb: common_pb2.StructuredOutput) -> tuple[str, str] | None:
    """(kind, spec) of a StructuredOutput (engine/structured.py); a choice list as JSON text."""
    kind = pb.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not pb.json_object):
        return None
    if kind == "choice":
        return kind, json.dumps(list(pb.choice.choices))
    if kind == "json_object":
        return kind, ""
    return kind, str(getattr(pb, kind))


def structured_to_pb(structured: tuple[str, str], pb: common_pb2.StructuredOutput) -> None:
    kind, spec = structured
    if kind == "choice":
        pb.choice.choices.extend(json.loads(spec))
    elif kind == "json_object":
        pb.json_object = True
    else:
        setattr(pb, kind, spec)


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        pb.seed = params.seed
    if params.logprobs is not None:
        pb.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        pb.prompt_logprobs = params.prompt_logprobs
    if params.presence_penalty:
        pb.presence_penalty = params.presence_penalty
    if params.frequency_penalty:
        pb.frequency_penalty = params.frequency_penalty
    if params.repetition_penalty != 1.0:
        pb.repetition_penalty = params.repetition_penalty
    if params.min_p:
        pb.min_p = params.min_p
    pb.min_tokens = params.min_tokens
    pb.logit_bias.update(dict(params.logit_bias))
    pb.allowed_token_ids.extend(params.allowed_token_ids)
    pb.bad_words.extend(params.bad_words)
    if not params.skip_special_tokens:
        pb.skip_special_tokens = False
    if not params.spaces_between_special_tokens:
        pb.spaces_between_special_tokens = False
    pb.include_stop_str_in_output = params.include_stop_str_in_output
    pb.cache_salt = params.cache_salt
    if params.structured is not None:
        structured_to_pb(params.structured, pb.structured)
    return pb


def trace_event_to_pb(event: TraceEvent, worker_id: str, tokenizer: Any) -> common_pb2.TraceEvent:
    """One engine trace event as the wire's TraceEvent (token ids come with the bytes they stand for)."""
    pb = common_pb2.TraceEvent(worker_id=worker_id)
    if isinstance(event, PrefillPassEvent):
        pb.prefill.CopyFrom(
            common_pb2.TracePrefillPass(
                num_tokens=event.num_tokens,
                kv_len_before=event.kv_len_before,
                kv_len_after=event.kv_len_after,
                samples=event.first_token_id is not None,
                time_s=event.time_s,
            )
        )
        if event.first_token_id is not None:
            pb.prefill.first_token_id = event.first_token_id
            pb.prefill.first_token_piece = token_bytes(tokenizer, [event.first_token_id])[0]
    elif isinstance(event, DecodeStepEvent):
        pb.decode.CopyFrom(
            common_pb2.TraceDecodeStep(
                token_id=event.token_id,
                piece=token_bytes(tokenizer, [event.token_id])[0] if event.token_id >= 0 else b"",
                kv_len=event.kv_len,
                itl_s=event.itl_s,
            )
        )
    elif isinstance(event, DetokenizeHoldEvent):
        pb.hold.CopyFrom(
            common_pb2.TraceDetokenizeHold(
                token_id=event.token_id,
                held=b"".join(token_bytes(tokenizer, event.held_ids)),
                held_tokens=len(event.held_ids),
            )
        )
    return pb


def trace_events_to_pb(events: tuple[TraceEvent, ...], worker_id: str, tokenizer: Any) -> list[common_pb2.TraceEvent]:
    return [trace_event_to_pb(event, worker_id, tokenizer) for event in events]


def _pieces(tokenizer: Any, ids: set[int]) -> dict[int, str]:  # noqa: ANN401
    """Each token decoded alone, in one batched call (a long prompt's logprobs name thousands of
    tokens: one decode call each held the event loop for most of a second)."""
    ordered = sorted(ids)
    texts = tokenizer.batch_decode(
        [[t] for t in ordered], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return dict(zip(ordered, texts, strict=True))


def logprobs_to_pb(entries: list[TokenLogprob], tokenizer: Any) -> list[common_pb2.TokenLogprob]:  # noqa: ANN401
    """Engine log-probability entries as the wire's, each token (and alternative) decoded alone."""
    pieces = _pieces(tokenizer, {t for e in entries for t in (e.token_id, *(t for t, _ in e.top))})
    converted = []
    for entry in entries:
        pb = common_pb2.TokenLogprob(token_id=entry.token_id, token=pieces[entry.token_id])
        if entry.logprob is not None:
            pb.logprob = entry.logprob
        pb.top.extend(common_pb2.TopLogprob(token_id=t, logprob=v, token=pieces[t]) for t, v in entry.top)
        converted.append(pb)
    return converted


def logprob_from_pb(pb: common_pb2.TokenLogprob) -> TokenLogprob:
    """The wire's entry back as the engine's (the decoded pieces are dropped: the tokenizer that
    answers the client decodes them again)."""
    return TokenLogprob(
        pb.token_id, pb.logprob if pb.HasField("logprob") else None, tuple((t.token_id, t.logprob) for t in pb.top)
    )


def configure_process(
    num_threads: int | None, log_level: str = "INFO", log_format: str = "text", process_name: str = "worker"
) -> None:
    """Set up this worker's logging and give it its own thread budget so pools on one host do not fight."""
    configure_logging(process_name, log_level, log_format)
    bound_heap()
    if num_threads:
        torch.set_num_threads(num_threads)


def make_server(
    control_threads: int,
    options: list[tuple[str, int]] | None = None,
    name: str = "worker",
    limits: CallLimits | None = None,
) -> AioServer:
    """An event-loop gRPC server (streams are coroutines; `control_threads` serve GetInfo, Abort,
    PushKv and health) whose calls carrying a request_id are logged at start and finish. With an
    internal token configured, calls without it are refused first (UNAUTHENTICATED); then calls over
    `limits` (default `CallLimits()`) are refused with RESOURCE_EXHAUSTED."""
    limits = limits or CallLimits()
    interceptors = [
        *server_interceptors(),
        PeerCallLimiter(limits, "--grpc-calls-per-peer, --grpc-calls-total"),
        RequestParseInterceptor(),
        RequestLoggingInterceptor(),
    ]
    return AioServer(
        name, options=[*(options or []), *limits.options()], interceptors=interceptors, control_threads=control_threads
    )


def call_limits(config: WorkerConfig) -> CallLimits:
    """The worker's `CallLimits` of its internal port (--grpc-calls-per-peer, --grpc-calls-total)."""
    security = config.security
    return CallLimits(per_peer=security.internal_grpc_calls_per_peer, total=security.internal_grpc_calls_total)


def apply_internal_credentials(config: WorkerConfig) -> None:
    """Make ``--internal-token-file`` this process's internal token (servers and channels alike)."""
    use_internal_token_file(config.security.internal_token_file)


def add_health(server: AioServer) -> health.HealthServicer:
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


class LivenessWatch:
    """Turns a dead engine loop into NOT_SERVING: checks `dead_reason()` every `interval_s` in a
    daemon thread; once it returns a reason, health goes NOT_SERVING for good."""

    def __init__(
        self, health_servicer: health.HealthServicer, dead_reason: Callable[[], str], interval_s: float = 0.2
    ) -> None:
        self._health = health_servicer
        self._dead_reason = dead_reason
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            reason = self._dead_reason()
            if reason:
                log.error("engine loop is dead (%s): reporting NOT_SERVING", reason)
                self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                return

    def stop(self) -> None:
        self._stop.set()


def bind(server: AioServer, host: str, port: int) -> str:
    bound = add_port(server, f"{host}:{port}")  # mTLS when the deployment configures it
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return f"{host}:{bound}"


def announce_ready(address: str, worker_id: str, **extra: object) -> None:
    print(ready_line(address, worker_id, **extra), flush=True)


class Drain:
    """Set on SIGTERM: the servicer then refuses new requests (UNAVAILABLE, so the router retries them
    elsewhere) and reports itself unhealthy, while requests already accepted, and their internal
    calls such as KV pushes, keep being served."""

    def __init__(self) -> None:
        self._event = threading.Event()

    @property
    def draining(self) -> bool:
        return self._event.is_set()

    def start(self) -> None:
        self._event.set()


def serve_until_signal(
    server: AioServer,
    health_servicer: health.HealthServicer,
    drain: Drain,
    is_idle: Callable[[], bool],
    grace_s: float = 30.0,
) -> None:
    """Block until SIGTERM/SIGINT, then drain: report NOT_SERVING, refuse new requests, wait until
    `is_idle()` or `grace_s` passed, and only then stop the server."""
    stop = threading.Event()
    on_stop_signal(stop.set)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    stop.wait()
    drain_then_stop(server, health_servicer, drain, is_idle, grace_s)


def drain_then_stop(
    server: AioServer, health_servicer: health.HealthServicer, drain: Drain, is_idle: Callable[[], bool], grace_s: float
) -> None:
    """Refuse new requests, report NOT_SERVING, wait until `is_idle()` or `grace_s`, stop the server."""
    drain.start()
    health_servicer.enter_graceful_shutdown()
    deadline = time.monotonic() + grace_s
    while not is_idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop(1.0)


@dataclass
class StartedWorker:
    """A worker serving gRPC, as `start_worker` of either role returns it (process or Ray actor).

    `stop()` drains (at most `drain_timeout_s`), stops the server and the engine; idempotent."""

    server: AioServer
    address: str
    health: health.HealthServicer
    drain: Drain
    is_idle: Callable[[], bool]
    close: Callable[[], None]  # stops the engine and its helpers (after the server stopped)
    drain_timeout_s: float = 30.0
    extras: dict[str, object] = field(default_factory=dict)  # e.g. the KV receiver, metrics address
    _stopped: bool = False

    def start_draining(self) -> None:
        """Refuse new requests and report unhealthy; requests already accepted keep being served."""
        self.drain.start()
        self.health.enter_graceful_shutdown()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            drain_then_stop(self.server, self.health, self.drain, self.is_idle, self.drain_timeout_s)
        finally:
            self.close()


def check_credentials_or_exit(config: WorkerConfig) -> None:
    """A worker's first check, before it loads a model: apply its internal credentials and refuse a
    bind beyond loopback without them, exiting with status 2 and the reason on stderr."""
    from pdserve.transport import check_bind_allowed

    try:
        apply_internal_credentials(config)
        check_bind_allowed(config.host)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def load_worker_model(model: ModelSection, pool: Any, **engine: Any) -> tuple[EngineConfig, Any]:  # noqa: ANN401
    """(engine config, loaded model) of a worker: the engine config takes the `model` section, the
    pool's KV memory and pass budget (`kv_cache_mb`, `max_batched_tokens`) and the role's own engine
    settings (`engine`); the model is the simulated engine's stand-in (`--engine sim`, whose profile
    may change the engine config's limits) or the real model, resolved and loaded."""
    config = EngineConfig(
        model=model.path,
        dtype=model.dtype,
        device=model.device,
        block_size=model.block_size,
        kv_cache_memory_mb=pool.kv_cache_mb,
        max_num_batched_tokens=pool.max_batched_tokens,
        compile=model.compile,
        deterministic=model.deterministic,
        kernel_table=model.kernel_table,
        **engine,
    )
    if model.engine == "sim":
        from pdserve.engine.sim_runner import load_sim_worker

        return load_sim_worker(model, config)
    from pdserve.engine.model_fetch import resolve_model
    from pdserve.engine.model_loader import load_model

    return config, load_model(resolve_model(model.path), config.torch_dtype, config.device)


def start_serving(
    server: AioServer,
    address: str,
    drain: Drain,
    is_idle: Callable[[], bool],
    dead_reason: Callable[[], str],
    drain_timeout_s: float,
    *,
    stops: tuple[Callable[[], None], ...],
    endpoint: Any = None,
    extras: dict[str, object] | None = None,
) -> StartedWorker:  # noqa: ANN401
    """The common tail of every role's `start_worker`: add health, start `server`, report SERVING, and
    watch `dead_reason` (non-empty: the engine loop died -> NOT_SERVING). The returned worker's close()
    stops the watch, then each of `stops` in order, then the metrics `endpoint` (if any); its extras
    carry `metrics_address` ("" without an endpoint) besides `extras`."""
    health_servicer = add_health(server)
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    liveness = LivenessWatch(health_servicer, dead_reason)

    def close() -> None:
        liveness.stop()
        for stop in stops:
            stop()
        if endpoint:
            endpoint.stop()

    metrics_address = f"127.0.0.1:{endpoint.port}" if endpoint else ""
    return StartedWorker(
        server,
        address,
        health_servicer,
        drain,
        is_idle,
        close,
        drain_timeout_s,
        {**(extras or {}), "metrics_address": metrics_address},
    )


def configure_worker(config: WorkerConfig) -> None:
    """`configure_process` with a worker's config (its thread budget, logs and name)."""
    configure_process(
        config.pool.threads, config.observability.log_level, config.observability.log_format, config.worker_id
    )


def run_worker_process(config: WorkerConfig, start: Callable[[], StartedWorker], **ready: object) -> None:
    """A worker process's `main` after parsing: configure, check credentials, start, print the READY
    line (with `ready`'s fields), serve until SIGTERM/SIGINT (draining), then close."""
    configure_worker(config)
    check_credentials_or_exit(config)
    started = start()
    # the engine thread now runs every pass: the main thread's OpenMP pool (from loading the model,
    # timing its kernels, building the engine) would throttle the engine thread's (pdserve/omp_pool.py)
    if dedicate_engine_thread():
        log.info("main thread's OpenMP pool released: the engine thread's team is the process's only one")
    announce_ready(started.address, config.worker_id, **ready, metrics_address=started.extras["metrics_address"])
    try:
        serve_until_signal(started.server, started.health, started.drain, started.is_idle, config.pool.drain_timeout_s)
    finally:
        started.close()
    exit_now()


def exit_now(code: int = 0) -> None:
    """End a worker process that has drained and closed: run the atexit handlers (they unlink its
    shared-memory segments), flush the logs, and leave without the interpreter's teardown, whose
    final garbage collection of torch and the model took ~5 s per worker (every `pdserve` stop and
    every test cluster paid it)."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: How long a KvEvents.Subscribe call waits for new events before looking again (it also ends the
#: wait when the call is cancelled, and picks up a new engine after a role switch).
KV_EVENTS_POLL_S = 0.05


class KvEventsServicer(worker_pb2_grpc.KvEventsServicer):
    """KvEvents on a worker: its engine's `KvEventLog` (engine/kv_events.py) as batches. `current`
    returns the log of the engine serving now (an elastic worker's changes with its role), or None
    while there is none. Runs on the server's event loop; it never blocks it."""

    def __init__(self, worker_id: str, current: Callable[[], KvEventLog | None]) -> None:
        self._worker_id = worker_id
        self._current = current

    async def Subscribe(
        self,
        request: worker_pb2.KvEventsRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.KvEventBatch]:
        epoch, after = request.epoch, request.after_seq
        while True:
            log_ = self._current()
            batch = None
            if log_ is not None:
                batch = log_.read(after if log_.epoch == epoch else 0)
            if batch is None:
                await asyncio.sleep(KV_EVENTS_POLL_S)
                continue
            epoch, after = batch.epoch, batch.last_seq
            yield worker_pb2.KvEventBatch(
                worker_id=self._worker_id,
                epoch=batch.epoch,
                first_seq=batch.first_seq,
                last_seq=batch.last_seq,
                snapshot=batch.snapshot,
                keys=batch.keys,
                stored=batch.stored,
            )

    def Lookup(
        self,
        request: worker_pb2.KvLookupRequest,  # noqa: N802
        context: grpc.ServicerContext,
    ) -> worker_pb2.KvLookupResponse:
        log_ = self._current()
        if log_ is None:
            return worker_pb2.KvLookupResponse()
        return worker_pb2.KvLookupResponse(cached_blocks=log_.lookup(list(request.keys)), epoch=log_.epoch)
