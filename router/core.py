"""The router's request path, shared by the gRPC servicer and the OpenAI HTTP API: validate, queue
for a decode slot, relay the decode worker's stream, fail over.

Runs on the router's event loop (`pdserve.serving.LoopThread`); every open request is a coroutine,
not a thread. Errors leave as `RouterError(code, details)`, which each front end maps to its own
status (gRPC status, HTTP status).

Invariants:
- Validation runs before anything else, so invalid requests fail with INVALID_ARGUMENT even when no
  worker is reachable.
- The router assigns every request an internal id (a fresh uuid) that workers key on; the client's
  id is only a label, echoed in each response and logged beside the internal id. Two requests with
  the same client id never touch each other.
- Admission: a request waits in the `AdmissionQueue` until a decode worker has room; it is refused
  (RESOURCE_EXHAUSTED with a retry-after hint) only when the queue is full or the predicted wait
  exceeds the request's own deadline.
- Exactly one DecodeWorker.Generate call per attempt, with a deadline; when the client leaves, that
  call is cancelled (the decode worker then cancels its prefill call and frees the KV). With
  --decode-mux the attempt is a request on the worker's GenerateMux call instead (router/mux.py),
  read and cancelled the same way.
- Failover: UNAVAILABLE (worker down, draining, engine loop dead, prefill side failed) marks that
  worker suspect and resumes the request elsewhere with the tokens already delivered. INTERNAL or
  UNKNOWN (a request that breaks a worker's step) is retried once on another worker without
  suspecting anyone; failing the same way twice, it is a poison request and fails.
- Restart wait (`worker_restart_wait_s`, set by the Ray launcher): when a stage has no healthy
  worker but some are still registered and not draining (a dead Ray actor stays registered while
  Ray restarts it), a request, new or failing over, waits for one within that bound and its own
  deadline instead of failing; a stall, not an error. Waiting does not count as an attempt.
- The worker lease of a request is released on every exit path.
- Live migration (`migrate`, and for every request on a draining decode worker): the source
  suspends the request between two steps and ends its stream with a `suspended` marker after the
  last token it sent; the next attempt goes to the target with the tokens delivered so far and the
  source's address, and takes the K/V from the source instead of a prefill. Markers never reach
  the client. A migration that fails (the source or target dies, the push fails) is a failure of
  that attempt: the request fails over (re-prefilled on a healthy worker) as usual. Migrations do
  not count against max_attempts.
- Each request logs one start and one finish line (`Generate start request_id=<client id>
  internal_id=<id>`), for gRPC and HTTP alike; workers log the internal id.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from pdserve import failures
from pdserve.failures import RequestFault, WorkerUnavailable
from pdserve.router.admission import AdmissionQueue, Busy, QueueFull
from pdserve.router.auth import tenant_salt
from pdserve.router.config import MAX_RECEIVE_MESSAGE_BYTES, RouterConfig
from pdserve.router.kv_index import KvEventFeed, KvIndex, PromptKeys
from pdserve.router.metrics import RequestClock, RouterMetrics
from pdserve.router.mux import DecodeMux, MuxCall
from pdserve.router.policies import (
    DECODE,
    KV_POLICIES,
    PREFILL,
    RouteHint,
    estimate_prompt_tokens,
    make_policy,
    prefix_key,
)
from pdserve.router.slo import Calibration, SloMiss, TtftModel
from pdserve.router.slo import check as check_slo
from pdserve.router.validation import InvalidRequest, validate_generate_request
from pdserve.router.worker_pool import ROLE_PB, Lease, NoHealthyWorker, SwitchRefused, WorkerPool
from pdserve.telemetry.grpc_logging import log_finish, log_start, safe_id
from pdserve.tokenization import input_chars
from pdserve.transport import internal_metadata, open_aio_channel
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

#: Statuses from a decode worker that mean "a worker failed", not "the request is wrong", when the
#: call carries no typed failure (pdserve/failures.py): a worker that died mid-call says nothing.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
#: Of those, the statuses of a request that broke a worker's step (not the worker itself).
REQUEST_FAULTS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
#: The typed failures the router fails over on.
_RETRY_KINDS = frozenset({WorkerUnavailable.kind, RequestFault.kind})
#: Outcomes of a request that completed (StatusResponse.recent: ok).
_FINISHED_OK = frozenset({"FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_STOP_STRING"})
#: What a grpc.aio call's read() returns at the end of the stream.
_EOF = grpc.aio.EOF
#: After a failure, how long to wait for some worker of the needed role to be healthy again.
RECOVERY_WAIT_S = 3.0
#: While waiting for a restarting worker: how often to look for a healthy one again.
RESTART_POLL_S = 0.25
#: How long Router.Migrate waits for the target to hold the K/V.
MIGRATE_TIMEOUT_S = 120.0
#: Between two tries to move a request off a draining worker (it may not be decoding yet).
DRAIN_RETRY_S = 1.0


class RouterError(Exception):
    """How a request failed: a gRPC status code, its details, and for refusals a retry-after hint."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class _Failure:
    address: str  # the worker to avoid next time
    code: grpc.StatusCode
    details: str
    request_fault: bool = False  # the request broke a step there: nobody is suspected


@dataclass
class _Attempt:
    """What one relay attempt ended with: nothing (done), a failure worth retrying, or the source
    suspended the request for a migration."""

    failure: _Failure | None = None
    suspended: bool = False


@dataclass
class _Migration:
    """A migration under way: the target's lease (taken when asked) and the Migrate call's answer."""

    target: str
    lease: Lease
    started: float
    done: asyncio.Future
    source: str = ""
    source_id: str = ""  # the request's internal id on the source

    def settle(self, result: router_pb2.MigrateResponse | None = None, error: RouterError | None = None) -> None:
        if not self.done.done():
            if error is not None:
                self.done.set_exception(error)
            else:
                self.done.set_result(result)


@dataclass
class _Request:
    """One request's router-side state across attempts."""

    request: router_pb2.GenerateRequest
    internal_id: str
    echo_id: str
    deadline: float
    clock: RequestClock
    outcome: str = "CANCELLED"
    delivered: list[int] = field(default_factory=list)  # token ids the client already has
    avoid: set[str] = field(default_factory=set)
    request_faults: int = 0
    lease: Lease | None = None  # of the attempt relaying now
    migration: _Migration | None = None  # asked for; its target attempt runs once the source suspended
    migrating: bool = False  # the attempt relaying now takes its K/V from a suspended source
    next_drain_try: float = 0.0
    index: int = 0  # the choice of an n > 1 request (GenerateResponse.index)
    pin: str = ""  # a decode worker to try first (it holds this prompt's K/V: choices after the first)
    kv_keys: list[int] = field(default_factory=list)  # the prompt's block keys (KV-aware routing)
    prompt_tokens: int = 0  # exact, when the router tokenized it (KV-aware routing); else 0
    oracle: dict[str, int] | None = None  # kv_oracle: blocks cached per worker, asked at routing time
    slo_work: int = 0  # SLO admission: prefill work ahead of it at dispatch (tokens), until its first token
    slo_worker: str = ""  # the worker that prefills it
    queued: bool = False  # it waited in the admission queue (SLO admission refuses only before that)
    predicted_ttft_s: float = 0.0  # SLO admission's prediction before it queued (calibrated by the outcome)
    dispatched_at: float = 0.0
    on_placed: Callable[[str], None] | None = None  # told the decode worker that produced the first token

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class RouterCore:
    """Pool + policies + admission queue + relaying; create it on the event loop that serves it."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self._config = config
        self.pool = pool
        self.metrics = metrics
        weights = (config.kv_request_tokens, config.kv_kv_tokens)
        self._prefill_policy = make_policy(config.prefill_policy, PREFILL, *weights)
        self._decode_policy = make_policy(config.decode_policy, DECODE, *weights)
        # KV-aware routing: the prompt's block keys, and what every worker caches (router/kv_index.py)
        self._kv_aware = bool({config.prefill_policy, config.decode_policy} & set(KV_POLICIES))
        self._kv_oracle = "kv_oracle" in (config.prefill_policy, config.decode_policy)
        self.kv_index: KvIndex | None = None
        self._prompt_keys: PromptKeys | None = None
        if self._kv_aware:
            try:
                self._prompt_keys = PromptKeys.load(config.tokenizer) if config.tokenizer else None
            except (OSError, ValueError) as exc:  # e.g. a Ray router on a node without the model folder
                log.warning("KV-aware policy: cannot load the tokenizer %r (%s)", config.tokenizer, exc)
            if self._prompt_keys is None:
                log.warning(
                    "KV-aware policy without a tokenizer (--tokenizer): only token-id prompts get "
                    "cache hints; the others are routed by load"
                )
            self.kv_index = index = KvIndex()
            self.metrics.prom.kv_index_entries.set_function(lambda: len(index))
            if not self._kv_oracle:
                pool.attach_kv_feed(KvEventFeed(index))
        self.admission: AdmissionQueue[Lease] = AdmissionQueue(config.max_queued_requests, self._release)
        self._dispatched = 0  # leases held (requests at a worker)
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.DecodeWorkerStub]] = {}
        self._muxes: dict[str, DecodeMux] = {}  # --decode-mux: one GenerateMux call per decode worker
        self._metadata = internal_metadata()
        self.ttft_model = TtftModel()  # SLO admission (router/slo.py)
        self.ttft_calibration = Calibration()
        self.slo_shed = 0
        self._live: dict[int, _Request] = {}  # requests in flight, by id() (their internal id changes)
        self._tasks: set[asyncio.Task] = set()  # drain migrations under way
        # shutdown (`drain`): the tasks consuming a `generate` now (a task may hold several), the ones
        # `drain` cancelled at its deadline, and whether new requests are refused
        self._consumers: dict[asyncio.Task, int] = {}
        self._cut: set[asyncio.Task] = set()
        self._draining = False
        self._none_open = asyncio.Event()
        self._none_open.set()

    # ----- public --------------------------------------------------------------------------------
    async def generate(
        self, request: router_pb2.GenerateRequest, timeout_s: float | None = None, tenant: str | None = None
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        """Serve one request; yields its responses. Raises RouterError when it fails. A `tenant` (the
        caller's token's) is folded into the request's cache salt after validation, so its prefix
        cache is shared only within that tenant. While the router drains (`drain`) a new request is
        refused (UNAVAILABLE); one still open at the drain's deadline fails UNAVAILABLE."""
        if self._draining:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down", retry_after_s=1.0)
        task = asyncio.current_task()
        assert task is not None
        self._consumers[task] = self._consumers.get(task, 0) + 1
        self._none_open.clear()
        try:
            async for response in self._generate(request, timeout_s, tenant):
                yield response
        except asyncio.CancelledError:
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+; 3.10 counts no cancels
            if task in self._cut and (uncancel is None or uncancel() == 0):  # drain's cancel alone: typed
                raise RouterError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the router shut down before this request finished (it drained for "
                    f"{self._config.drain_timeout_s:g} s: router.drain_timeout_s)",
                ) from None
            raise
        finally:
            left = self._consumers.pop(task) - 1
            if left:
                self._consumers[task] = left
            elif not self._consumers:
                self._none_open.set()

    async def drain(self, timeout_s: float) -> int:
        """Shutdown's first step: refuse new requests, let the open ones finish for up to `timeout_s`,
        then end those still open with UNAVAILABLE (their workers are told to abort, so they free the
        KV blocks). Returns how many were ended so."""
        self._draining = True
        try:
            await asyncio.wait_for(self._none_open.wait(), timeout_s)
            return 0
        except (asyncio.TimeoutError, TimeoutError):
            pass
        cut = [task for task in self._consumers if not task.done()]
        for task in cut:
            self._cut.add(task)
            task.cancel()
        try:
            await asyncio.wait_for(self._none_open.wait(), 5.0)
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("%d requests still open 5 s after the drain ended them", len(self._consumers))
        return len(cut)

    async def _generate(
        self, request: router_pb2.GenerateRequest, timeout_s: float | None, tenant: str | None
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        try:
            validate_generate_request(request)
        except InvalidRequest as exc:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if tenant:
            request.params.cache_salt = tenant_salt(tenant, request.params.cache_salt)
        if request.params.n > 1:
            async for response in self._choices(request, timeout_s):
                yield response
            return
        async for response in self._generate_one(request, timeout_s):
            yield response

    async def _choices(
        self, request: router_pb2.GenerateRequest, timeout_s: float | None
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """An n > 1 request as n choices, each a request of its own (own attempts, failover, lease),
        their responses interleaved with `index` set. The prompt is prefilled once: choice 0 goes
        the usual way; when its first token arrives, the others start on the decode worker that
        produced it with no prefill worker, so they share the prompt's blocks from its prefix cache
        and compute only the last partial block (a worker without room, or one that fails, sends a
        choice the usual way). Choice i > 0 with a seed uses seed + i, as vLLM. The first choice to
        fail fails the request, and the others are cancelled."""
        n = request.params.n
        loop = asyncio.get_running_loop()
        placed: asyncio.Future[str] = loop.create_future()  # choice 0's decode worker ("": none)
        events: asyncio.Queue = asyncio.Queue()  # (index, response | RouterError | None when done)

        def place(address: str) -> None:
            if not placed.done():
                placed.set_result(address)

        async def run(index: int) -> None:
            child = router_pb2.GenerateRequest()
            child.CopyFrom(request)
            child.params.ClearField("n")
            if index and request.params.HasField("seed"):
                child.params.seed = request.params.seed + index
            try:
                pin = await placed if index else ""
                async for response in self._generate_one(child, timeout_s, index, pin, place if not index else None):
                    events.put_nowait((index, response))
                events.put_nowait((index, None))
            except RouterError as exc:
                events.put_nowait((index, exc))
            finally:
                if not index:
                    place("")  # it ended before a token (or failed): the others go the usual way

        tasks = [asyncio.ensure_future(run(i)) for i in range(n)]
        try:
            running = n
            while running:
                index, item = await events.get()
                if item is None:
                    running -= 1
                elif isinstance(item, RouterError):
                    raise item
                else:
                    item.index = index
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate_one(
        self,
        request: router_pb2.GenerateRequest,
        timeout_s: float | None,
        index: int = 0,
        pin: str = "",
        on_placed: Callable[[str], None] | None = None,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        cap = self._config.max_stream_timeout_s
        state = _Request(
            request,
            uuid.uuid4().hex,
            "",
            time.monotonic() + min(timeout_s or cap, cap),
            RequestClock(self.metrics),
            index=index,
            pin=pin,
            on_placed=on_placed,
        )
        state.echo_id = request.request_id or state.internal_id
        started = log_start("Generate", safe_id(state.echo_id), state.internal_id, label="internal_id")
        self.metrics.started()
        self._live[id(state)] = state
        try:
            if self._kv_aware:
                await self._kv_keys(state)
            # one async-generator layer between the decode stream and the caller per token: the
            # attempt loop relays the decode worker's stream itself (no nested generators)
            async for response in self._attempt_loop(state):
                yield response
        except RouterError as exc:
            state.outcome = exc.code.name
            raise
        finally:
            del self._live[id(state)]
            if state.migration is not None:
                self._settle_quietly(state, RouterError(grpc.StatusCode.ABORTED, "the request ended first"))
            self.metrics.finished(state.outcome)
            self.metrics.remember(state.clock.sample(ok=state.outcome in _FINISHED_OK))
            log_finish("Generate", safe_id(state.echo_id), started, _status_of(state.outcome))

    def status(self, recent_window_s: float = 0.0) -> router_pb2.StatusResponse:
        now = time.monotonic()
        recent = [
            router_pb2.FinishedRequest(
                finished_ago_s=now - s.finished_at,
                ttft_s=s.ttft_s,
                tpot_s=s.tpot_s,
                queue_s=s.queue_s,
                prompt_tokens=s.prompt_tokens,
                output_tokens=s.output_tokens,
                ok=s.ok,
            )
            for s in (self.metrics.recent(recent_window_s) if recent_window_s > 0 else ())
        ]
        return router_pb2.StatusResponse(
            workers=self.pool.snapshot(),
            in_flight_requests=self.metrics.in_flight,
            total_requests=self.metrics.total_requests,
            queued_requests=len(self.admission),
            max_queued_requests=self.admission.max_queued,
            dequeued_requests=self.admission.admitted,
            slo_shed_requests=self.slo_shed,
            queue_time_s_sum=self.admission.queue_time_s_sum,
            recent=recent,
        )

    async def switch_role(self, worker: str, role: str, drain_timeout_s: float) -> router_pb2.SwitchRoleResponse:
        """Switch one worker's role (Router.SwitchRole): stop routing new work of its old role to it,
        wait until the requests the router sent it are done, have it switch (it finishes what it
        still holds), then route to it in its new role with the KV targets updated. Raises
        RouterError (NOT_FOUND, FAILED_PRECONDITION, DEADLINE_EXCEEDED, UNAVAILABLE)."""
        started = time.monotonic()
        try:
            address, old_role = self.pool.hold_for_switch(worker, role)
        except (KeyError, SwitchRefused) as exc:
            code = grpc.StatusCode.NOT_FOUND if isinstance(exc, KeyError) else grpc.StatusCode.FAILED_PRECONDITION
            raise RouterError(code, str(exc.args[0])) from None
        if old_role == role:
            return router_pb2.SwitchRoleResponse(worker=self.pool.info_of(address), previous_role=ROLE_PB[role])
        log.info("switching worker %s from %s to %s", address, old_role, role)
        deadline = started + drain_timeout_s
        try:
            while self.pool.in_flight_of(address) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if self.pool.in_flight_of(address):
                raise RouterError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"worker {address}: requests it holds did not finish within {drain_timeout_s:.1f}s",
                )
            drained_s = time.monotonic() - started
            await self._set_worker_role(address, role, max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.pool.release_hold(address)
            self.wake()
            raise
        info = await asyncio.to_thread(self.pool.set_role, address, role)
        self.wake()
        log.info("worker %s is now %s (switched in %.3fs)", address, role, time.monotonic() - started)
        self.metrics.prom.role_switches.labels(old_role, role).inc()
        return router_pb2.SwitchRoleResponse(
            worker=info, previous_role=ROLE_PB[old_role], drain_s=drained_s, switch_s=time.monotonic() - started
        )

    async def _set_worker_role(self, address: str, role: str, timeout_s: float) -> None:
        stub = worker_pb2_grpc.RoleControlStub(self._channel(address))
        try:
            await stub.SetRole(
                worker_pb2.SetRoleRequest(role=ROLE_PB[role], drain_timeout_s=timeout_s),
                timeout=timeout_s + 5.0,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise RouterError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"worker {address} cannot switch roles (start workers with --elastic)",
                ) from None
            raise RouterError(exc.code(), f"worker {address}: {exc.details()}") from None

    def wake(self) -> None:
        """Capacity may have changed (a poll, a release): admit queued requests that now fit, and
        move requests off draining decode workers."""
        self.admission.wake()
        self.metrics.prom.requests_waiting.set(len(self.admission))
        self._migrate_draining()

    # ----- live migration --------------------------------------------------------------------------
    async def migrate(self, request_id: str, to_worker: str = "") -> router_pb2.MigrateResponse:
        """Move a running request to another decode worker (see the module docstring); returns once
        the target holds its K/V. RouterError: NOT_FOUND, FAILED_PRECONDITION, ABORTED (the migration
        failed and the request fails over), DEADLINE_EXCEEDED."""
        state = self._find(request_id)
        lease = state.lease
        if state.migration is not None or state.migrating:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, f"request {request_id} is already migrating")
        if lease is None or lease.released:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, f"request {request_id} is not at a decode worker")
        source = lease.decode_address
        try:
            target = self.pool.migration_target(source, to_worker, self._decode_policy)
            target_lease = self.pool.lease_decode(target)
        except ValueError as exc:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        self._dispatched += 1
        migration = _Migration(
            target,
            target_lease,
            time.monotonic(),
            asyncio.get_running_loop().create_future(),
            source,
            state.internal_id,
        )
        # retrieved here, so a Migrate caller that left does not leave an unretrieved exception behind
        migration.done.add_done_callback(lambda f: f.cancelled() or f.exception())
        state.migration = migration
        try:
            await self._stub(source).Suspend(
                worker_pb2.SuspendRequest(request_id=state.internal_id), timeout=10.0, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            code = (
                exc.code()
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
                else grpc.StatusCode.ABORTED
            )
            error = RouterError(code, f"suspend on {source}: {exc.details()}")
            self._abandon(state, migration, error)
            raise error from None
        log.info(
            "request_id=%s internal_id=%s migrating from %s to %s",
            safe_id(state.echo_id),
            migration.source_id,
            source,
            target,
        )
        try:
            return await asyncio.wait_for(asyncio.shield(migration.done), timeout=MIGRATE_TIMEOUT_S)
        except (asyncio.TimeoutError, TimeoutError):
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "migration did not complete in time") from None

    def _find(self, request_id: str) -> _Request:
        """The request in flight with this internal id, or else with this (unique) client id."""
        states = list(self._live.values())
        found = [s for s in states if s.internal_id == request_id]
        found = found or [s for s in states if request_id in (s.echo_id, s.request.request_id)]
        if not found:
            raise RouterError(grpc.StatusCode.NOT_FOUND, f"no request {request_id!r} in flight")
        if len(found) > 1:
            raise RouterError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{len(found)} requests in flight have id {request_id!r}: use the internal id",
            )
        return found[0]

    def _abandon(self, state: _Request, migration: _Migration, error: RouterError) -> None:
        """Give a migration up: its target lease back, the Migrate call answered with `error`."""
        if state.migration is migration:
            state.migration = None
        self._release(migration.lease)
        migration.settle(error=error)

    def _migrate_draining(self) -> None:
        """Draining decode workers hand their running requests to others (retried while a request is
        not decoding yet; with no target, the request stays and the worker waits for it)."""
        draining = self.pool.draining()
        if not draining:
            return
        now = time.monotonic()
        for state in list(self._live.values()):
            lease = state.lease
            if (
                lease is None
                or lease.decode_address not in draining
                or state.migration is not None
                or state.migrating
                or now < state.next_drain_try
            ):
                continue
            state.next_drain_try = now + DRAIN_RETRY_S
            task = asyncio.ensure_future(self._drain_one(state, lease.decode_address))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drain_one(self, state: _Request, source: str) -> None:
        try:
            done = await self.migrate(state.internal_id)
            log.info(
                "request_id=%s moved off draining worker %s to %s", safe_id(state.echo_id), source, done.to_address
            )
        except RouterError as exc:
            log.info(
                "request_id=%s stays on draining worker %s for now: %s", safe_id(state.echo_id), source, exc.details
            )

    async def close(self) -> None:
        for mux in list(self._muxes.values()):
            await mux.close()
        self._muxes.clear()
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()

    # ----- attempts ------------------------------------------------------------------------------
    def _settle_quietly(self, state: _Request, error: RouterError) -> None:
        if state.migration is not None:
            self._abandon(state, state.migration, error)

    async def _attempt_loop(self, state: _Request) -> AsyncIterator[router_pb2.GenerateResponse]:
        failures = 0
        lease: Lease | None = None
        while True:
            if lease is None:
                if failures:
                    state.internal_id = uuid.uuid4().hex  # a fresh key: the failed attempt may still be aborting
                    self.metrics.failed_over()
                    await asyncio.sleep(min(1.0, 0.1 * 2**failures))  # let health polls catch up with a dead worker
                lease = await self._acquire(state, retry=failures > 0)
            admitted_at = time.monotonic()
            result = _Attempt()
            routed = False  # the attempt's route event went out (traced requests)
            state.lease = lease
            call: grpc.aio.UnaryStreamCall | MuxCall | None = None
            try:
                # the relay, inline (an async generator per attempt would add a layer per token)
                call = self._open_decode(state, lease)
                while True:
                    try:
                        response = await call.read()
                    except grpc.aio.AioRpcError as exc:
                        self._on_decode_error(state, lease, result, exc)  # raises when not retryable
                        break
                    if response is _EOF:
                        result.failure = _Failure(
                            lease.decode_address,
                            grpc.StatusCode.UNAVAILABLE,
                            f"decode worker {lease.decode_address} ended the stream early",
                        )
                        break
                    if response.HasField("migration"):
                        if self._on_marker(state, lease, response.migration, result):
                            break
                        continue
                    if state.request.trace and not routed:
                        routed = True
                        _prepend_route(response, state, lease, self._hint(state) if self._kv_aware else None)
                    if state.dispatched_at and (response.token_ids or response.text):
                        self._first_token(state)
                    finished = _stamp(response, state, lease)
                    if state.on_placed is not None and (response.token_ids or finished):
                        state.on_placed(lease.decode_address)
                        state.on_placed = None
                    if finished:
                        state.outcome = common_pb2.FinishReason.Name(response.finish_reason)
                    yield response
                    if finished:
                        break
            finally:
                if call is not None:
                    call.cancel()
                state.lease = None
                self._release(lease)
                self.admission.finished(time.monotonic() - admitted_at, self.pool.total_slots())
            lease = self._after_attempt(state, result)
            if lease is not None:
                continue
            if result.failure is None:
                return
            self._on_failure(state, failures, result.failure)
            failures += 1
            if failures >= self._config.max_attempts:
                raise RouterError(
                    grpc.StatusCode.UNAVAILABLE, f"gave up after {failures} attempts; last: {result.failure.details}"
                )

    def _after_attempt(self, state: _Request, result: _Attempt) -> Lease | None:
        """The target's lease when the source just suspended the request for a migration; None
        otherwise (a migration target attempt that failed gives its migration up: failover)."""
        migration = state.migration
        if result.suspended and migration is not None:
            state.migrating = True
            state.internal_id = uuid.uuid4().hex  # the target's key; the source keeps the old one
            return migration.lease
        if state.migrating or (migration is not None and result.failure is not None):
            state.migrating = False
            if migration is not None:
                details = result.failure.details if result.failure else "the source ended the request"
                if result.failure is not None:
                    self._abort_on(migration.source, migration.source_id)
                self._settle_quietly(
                    state,
                    RouterError(
                        grpc.StatusCode.ABORTED,
                        f"migration to {migration.target} failed ({details}); the request resumes by failover",
                    ),
                )
        return None

    def _abort_on(self, address: str, request_id: str) -> None:
        """Best effort: free what a worker still holds for `request_id` (a suspended source)."""

        async def abort() -> None:
            try:
                await self._stub(address).Abort(
                    worker_pb2.AbortRequest(request_id=request_id), timeout=2.0, metadata=self._metadata
                )
            except grpc.aio.AioRpcError:
                pass  # it holds the blocks until its own deadline

        task = asyncio.ensure_future(abort())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_failure(self, state: _Request, attempt: int, failure: _Failure) -> None:
        """Decide whether to retry: a worker failure suspects the worker; a request fault twice is poison."""
        log.warning(
            "request_id=%s internal_id=%s attempt %d failed on %s: %s; %d tokens delivered so far",
            safe_id(state.echo_id),
            state.internal_id,
            attempt + 1,
            failure.address,
            failure.details,
            len(state.delivered),
        )
        state.avoid.add(failure.address)
        if failure.request_fault:
            state.request_faults += 1
            if state.request_faults >= 2:
                raise RouterError(
                    failure.code, f"request failed the same way on two workers (not retried further): {failure.details}"
                )
            return
        self.pool.suspect(failure.address)

    async def _acquire(self, state: _Request, retry: bool) -> Lease:
        """Wait in the admission queue for a worker pair. After a failure, wait a few health polls for
        a worker that was only suspected to come back. When a stage has no healthy worker but some are
        still registered and the router is told they restart (worker_restart_wait_s), wait for one
        within that bound and the request's deadline: the client sees a stall, not an error."""
        recovery_deadline = time.monotonic() + (RECOVERY_WAIT_S if retry else 0.0)
        waited_since: float | None = None  # first found no healthy worker (restart wait)
        pause = 0.0  # before looking again for a healthy worker
        while True:
            try:
                if pause:  # here, so that a client leaving during it is the CancelledError below
                    await asyncio.sleep(pause)
                # room now: no queueing, and no wait_for task (the common case under capacity)
                lease = self.admission.try_now(lambda: self._assign(state)) if state.remaining_s() > 0 else None
                if lease is None and not retry:
                    self._shed_before_queueing(state)
                if lease is None:
                    state.queued = True
                    lease = await asyncio.wait_for(
                        self.admission.acquire(
                            lambda: self._assign(state), state.request.priority, retry, state.remaining_s()
                        ),
                        timeout=state.remaining_s(),
                    )
            except QueueFull as exc:
                raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), exc.retry_after_s) from None
            except SloMiss as exc:
                self.slo_shed += 1
                self.metrics.prom.slo_shed.inc()
                self.metrics.prom.slo_shed_answer.observe(state.clock.elapsed_s())
                raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), exc.retry_after_s) from None
            except (asyncio.TimeoutError, TimeoutError):
                self._end_worker_wait(waited_since, "gave_up")
                raise RouterError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed while waiting for a decode slot"
                ) from None
            except asyncio.CancelledError:  # the client left (or its deadline passed) while it waited
                self._end_worker_wait(waited_since, "cancelled")
                raise
            except NoHealthyWorker as exc:
                now = time.monotonic()
                if exc.waiting and self._config.worker_restart_wait_s > 0:
                    if waited_since is None:
                        waited_since = now
                        self.metrics.prom.worker_waits.labels(exc.stage).inc()
                        log.warning(
                            "request_id=%s waits up to %.0f s for a %s worker to restart: %s",
                            safe_id(state.echo_id),
                            self._config.worker_restart_wait_s,
                            exc.stage,
                            exc,
                        )
                    if now - waited_since < self._config.worker_restart_wait_s and state.remaining_s() > 0:
                        pause = min(RESTART_POLL_S, state.remaining_s())
                        continue
                    self._end_worker_wait(waited_since, "gave_up")
                    if state.remaining_s() <= 0:  # the request's deadline ended the wait: say so
                        raise RouterError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"request deadline passed while waiting for a {exc.stage} worker to restart ({exc})",
                        ) from None
                    raise RouterError(
                        grpc.StatusCode.UNAVAILABLE, f"{exc}; none served again within {now - waited_since:.0f} s"
                    ) from None
                if now >= recovery_deadline:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
                pause = 0.1
                continue
            finally:
                self.metrics.prom.requests_waiting.set(len(self.admission))
            self._end_worker_wait(waited_since, "served")
            if not retry:
                state.clock.queue_s = state.clock.elapsed_s()
            self.metrics.prom.queue_time.observe(state.clock.elapsed_s())
            return lease

    def _end_worker_wait(self, waited_since: float | None, outcome: str) -> None:
        if waited_since is not None:
            self.metrics.prom.worker_wait_time.labels(outcome).observe(time.monotonic() - waited_since)

    def _assign(self, state: _Request) -> Lease:
        if self._dispatched >= self._config.max_concurrent_streams:
            raise Busy(f"{self._dispatched} requests at workers (--max-concurrent-streams)")
        prompt_tokens = state.prompt_tokens or estimate_prompt_tokens(state.request)
        if state.pin and state.pin not in state.avoid:
            lease = self.pool.lease_pinned(state.pin, prompt_tokens)
            if lease is not None:
                self._dispatched += 1
                return lease
        hint = self._hint(state) if self._kv_aware else None
        lease = self.pool.assign(
            self._decode_policy,
            self._prefill_policy,
            prompt_tokens,
            frozenset(state.avoid),
            prefix_key(state.request),
            require_room=True,
            hint=hint,
            local_below=self._config.conditional_disagg_tokens if hint is not None else 0,
        )
        self._dispatched += 1
        if not state.delivered:  # SLO admission: the work ahead of its first token, and the check
            state.slo_worker = lease.prefill_address or lease.decode_address
            state.slo_work = self.pool.pending_prompt_tokens(state.slo_worker)
            state.dispatched_at = time.monotonic()
            slo_s = self._slo_s(state)
            # a request that passed the check before queueing is served, not refused after its wait:
            # a refusal comes at once or not at all (a wrong prediction shows in SLO attainment)
            if slo_s and self.ttft_model.ready and not state.queued:
                try:
                    check_slo(
                        state.clock.elapsed_s()
                        + self.ttft_model.predict(state.slo_work, lease.prefill_address or lease.decode_address),
                        slo_s,
                    )
                except SloMiss:
                    self._release(lease)
                    raise
        self.metrics.prom.route_decisions.labels(lease.route).inc()
        if hint is not None:
            self.metrics.prom.route_cached_tokens.inc(
                hint.prompt_tokens - hint.uncached(lease.prefill_address or lease.decode_address)
            )
            self.metrics.prom.route_prompt_tokens.inc(hint.prompt_tokens)
            if lease.prefill_address:  # what the decode worker lacks crosses the network
                self.metrics.prom.route_shipped_tokens.inc(hint.uncached(lease.decode_address))
        return lease

    # ----- SLO admission (router/slo.py) -----------------------------------------------------------
    def _slo_s(self, state: _Request) -> float:
        """The request's TTFT objective in seconds (0: none, or best effort: never refused)."""
        if state.request.best_effort:
            return 0.0
        return state.request.slo_ttft_ms / 1000 if state.request.slo_ttft_ms else self._config.slo_ttft_s

    def _shed_before_queueing(self, state: _Request) -> None:
        """A request that would queue: refuse it now (SloMiss) when the queue's predicted wait plus
        the best TTFT any worker is predicted to give it (its backlog, this prompt and its recent
        TTFTs) already exceed its SLO, so that its answer comes at once."""
        slo_s = self._slo_s(state)
        if slo_s and self.ttft_model.ready:
            prompt = state.prompt_tokens or estimate_prompt_tokens(state.request)
            after_queue = self.ttft_model.best(self.pool.prefill_backlogs(), prompt)
            state.predicted_ttft_s = state.clock.elapsed_s() + self.admission.predicted_wait_s() + after_queue
            check_slo(state.predicted_ttft_s * self.ttft_calibration.factor, slo_s)

    def _first_token(self, state: _Request) -> None:
        """The request's first token arrived: teach the TTFT model what its work took, and the
        calibration how its prediction before queueing compared."""
        if state.queued and state.predicted_ttft_s:
            self.ttft_calibration.observe(state.predicted_ttft_s, state.clock.elapsed_s())
            self.metrics.prom.slo_calibration.set(self.ttft_calibration.factor)
            state.predicted_ttft_s = 0.0
        if state.dispatched_at:
            self.ttft_model.observe(time.monotonic() - state.dispatched_at, state.slo_work, state.slo_worker)
            state.dispatched_at = 0.0

    # ----- KV-aware routing ----------------------------------------------------------------------
    async def _kv_keys(self, state: _Request) -> None:
        """The prompt's block keys (tokenized off the event loop when large) and, for kv_oracle,
        every worker's exact overlap."""
        block_size = self.pool.kv_block_size()
        if self._prompt_keys is None and state.request.WhichOneof("input") != "token_ids":
            return
        keys_of = (self._prompt_keys or PromptKeys(None)).keys
        if input_chars(state.request) <= INLINE_HASH_CHARS:
            state.kv_keys, state.prompt_tokens = keys_of(state.request, block_size)
        else:
            state.kv_keys, state.prompt_tokens = await asyncio.to_thread(keys_of, state.request, block_size)
        if self._kv_oracle and state.kv_keys:
            state.oracle = await self._oracle_overlap(state.kv_keys)

    async def _oracle_overlap(self, keys: list[int]) -> dict[str, int]:
        """Every worker's exact prefix overlap now (KvEvents.Lookup), for the kv_oracle policy."""
        addresses = list(self.pool.addresses())
        request = worker_pb2.KvLookupRequest(keys=keys)

        async def ask(address: str) -> int:
            try:
                stub = worker_pb2_grpc.KvEventsStub(self._channel(address))
                answer = await stub.Lookup(request, timeout=2.0, metadata=self._metadata)
                return answer.cached_blocks
            except grpc.aio.AioRpcError:
                return 0

        counts = await asyncio.gather(*(ask(a) for a in addresses))
        return {a: n for a, n in zip(addresses, counts, strict=True) if n}

    def _hint(self, state: _Request) -> RouteHint | None:
        """What each worker caches of this prompt, in tokens (None: the prompt was not tokenized)."""
        if not state.prompt_tokens:
            return None
        block_size = self.pool.kv_block_size()
        overlap = (
            state.oracle
            if self._kv_oracle
            else (self.kv_index.overlap(state.kv_keys) if self.kv_index is not None else {})
        )
        return RouteHint(state.prompt_tokens, {a: n * block_size for a, n in (overlap or {}).items()})

    def _release(self, lease: Lease) -> None:
        """Give a lease back (idempotent through Lease.release)."""
        if not lease.released:
            self._dispatched -= 1
        lease.release()

    # ----- relaying ------------------------------------------------------------------------------
    def _open_decode(self, state: _Request, lease: Lease) -> grpc.aio.UnaryStreamCall | MuxCall:
        """Start one attempt's DecodeWorker.Generate call, or its request on the worker's GenerateMux
        call with --decode-mux (either is read by `_attempt_loop`)."""
        timeout_s = max(0.001, state.remaining_s())
        if self._config.decode_mux:
            return self._mux(lease.decode_address).open(_decode_request(state, lease), timeout_s)
        return self._stub(lease.decode_address).Generate(
            _decode_request(state, lease), timeout=timeout_s, metadata=self._metadata
        )

    def _mux(self, address: str) -> DecodeMux:
        mux = self._muxes.get(address)
        if mux is None or mux.closed:
            mux = self._muxes[address] = DecodeMux(address, self._stub(address), self._metadata, self._mux_closed)
        return mux

    def _mux_closed(self, mux: DecodeMux) -> None:
        if self._muxes.get(mux.address) is mux:
            del self._muxes[mux.address]

    def _on_decode_error(self, state: _Request, lease: Lease, result: _Attempt, exc: grpc.aio.AioRpcError) -> None:
        """A decode call failed: a retryable failure goes to `result.failure`; any other raises RouterError."""
        details = exc.details() or exc.code().name
        typed = failures.received(exc.trailing_metadata())  # the status's meaning; the text is for people
        if not (typed.kind in _RETRY_KINDS if typed is not None else exc.code() in RETRYABLE):
            log.info("decode worker %s failed: %s: %s", lease.decode_address, exc.code().name, details)
            raise RouterError(exc.code(), details or f"decode worker {lease.decode_address} failed") from None
        side = typed.side if typed is not None else failures.DECODE
        failed = lease.decode_address
        if side == failures.PREFILL and lease.prefill_address:
            failed = lease.prefill_address
        elif side == failures.MIGRATION_SOURCE and state.migration is not None:
            failed = state.migration.source  # the target is fine: the source could not hand over
        fault = typed.kind == RequestFault.kind if typed is not None else exc.code() in REQUEST_FAULTS
        result.failure = _Failure(failed, exc.code(), f"{exc.code().name}: {details}", fault)

    def _on_marker(self, state: _Request, lease: Lease, marker: router_pb2.MigrationMarker, result: _Attempt) -> bool:
        """A migration marker from a decode worker (never relayed); True when the attempt ends here."""
        migration = state.migration
        if marker.suspended:
            if migration is None:
                result.failure = _Failure(
                    lease.decode_address,
                    grpc.StatusCode.UNAVAILABLE,
                    "decode worker suspended a request nobody migrates",
                )
            result.suspended = migration is not None
            return True
        if marker.resumed and migration is not None and state.migrating:
            state.migration, state.migrating = None, False
            migration.settle(
                router_pb2.MigrateResponse(
                    request_id=migration.source_id,
                    from_address=migration.source,
                    to_address=migration.target,
                    num_tokens=marker.num_tokens,
                    kv_bytes=marker.kv_bytes,
                    migrate_s=time.monotonic() - migration.started,
                )
            )
            self.metrics.migrated()
        return False

    def worker_stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        """The cached DecodeWorker stub of a worker, for calls beside Generate (the HTTP API's
        /tokenize); each call needs `internal_metadata`."""
        return self._stub(address)

    @property
    def internal_metadata(self) -> tuple[tuple[str, str], ...]:
        """The internal plane's credential, sent with every call to a worker."""
        return self._metadata

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        self._channel(address)
        return self._stubs[address][1]

    def _channel(self, address: str) -> grpc.aio.Channel:
        entry = self._stubs.get(address)
        if entry is None:
            channel = open_aio_channel(
                address, [("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)], add_token=False
            )  # the token goes in self._metadata, per call
            entry = self._stubs[address] = (channel, worker_pb2_grpc.DecodeWorkerStub(channel))
        return entry[0]


def _status_of(outcome: str) -> str:
    """A finish reason (the stream ended normally) is status OK; a status code name is itself."""
    return outcome if outcome in grpc.StatusCode.__members__ else "OK"


def _prepend_route(
    response: router_pb2.GenerateResponse, state: _Request, lease: Lease, hint: RouteHint | None
) -> None:
    """Put the router's route event first in a traced request's first response of an attempt."""
    route = common_pb2.TraceRoute(
        decision=lease.route, decode_worker=lease.decode_address, prefill_worker=lease.prefill_address
    )
    if hint is not None:
        route.prompt_tokens = hint.prompt_tokens
        route.decode_cached_tokens = hint.prompt_tokens - hint.uncached(lease.decode_address)
        if lease.prefill_address:
            route.prefill_cached_tokens = hint.prompt_tokens - hint.uncached(lease.prefill_address)
    events = [common_pb2.TraceEvent(route=route), *response.trace]
    del response.trace[:]
    response.trace.extend(events)


def _stamp(response: router_pb2.GenerateResponse, state: _Request, lease: Lease) -> bool:
    """Fill router-side fields of one relayed response; return True if it is the last one."""
    response.request_id = state.echo_id
    token_ids = response.token_ids
    count = len(token_ids)
    if count == 1:  # one token per step: cheaper than extending from the protobuf container
        state.delivered.append(token_ids[0])
    elif count:
        state.delivered.extend(token_ids)
    if count or response.text:
        state.clock.on_tokens()
        lease.prefill_done()
    if response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        return False
    response.timings.ttft_s = state.clock.ttft_s
    response.timings.e2e_s = state.clock.finish()
    state.clock.count_tokens(response.usage.prompt_tokens, response.usage.completion_tokens)
    return True


#: Prompts and chats up to this many characters are hashed for KV-aware routing on the event loop
#: (well under a millisecond); larger ones in a thread.
INLINE_HASH_CHARS = 16 * 1024


def _decode_request(state: _Request, lease: Lease) -> worker_pb2.DecodeRequest:
    request = state.request
    decode_request = worker_pb2.DecodeRequest(
        request_id=state.internal_id,
        client_request_id=request.request_id,
        prefill_address=lease.prefill_address,
        resume_output_ids=state.delivered,
        trace=request.trace,
    )
    if state.migrating and state.migration is not None:
        decode_request.migrate_from_address = state.migration.source
        decode_request.migrate_request_id = state.migration.source_id
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
