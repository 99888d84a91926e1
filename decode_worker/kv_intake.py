"""The decode side of the KV contract: how K/V computed elsewhere enter this worker's cache.

The prefill side is `engine.kv_connector.KvConnector` (a prefill worker's `KvHandoff`): it ships a
finished prefill's blocks. This side asks for them and takes them in, for one request at a time:

    route -> reserve -> expect -> ask the peer -> (K/V arrive) -> commit

1. route: `kv_transfer.routing.choose_route` picks the backend from `--kv-backend`, this worker's
   cache device (CUDA: same-host K/V go device to device, "cuda_ipc") and facts about the prefill
   worker (same host? its shared-memory segment prefix, asked once and remembered until a prefill
   there fails, when its mapped device pool is dropped too);
2. reserve: the engine holds blocks for prompt + resumed tokens (a cached prefix is not shipped);
3. expect: the receiver registers the intake with one `ExpectOptions` before any byte can arrive;
4. ask: `PrefillPeers.prefill` (the network: gRPC in the worker, an in-process fake in tests);
5. commit: the K/V go into the reserved blocks and the request decodes on.

Live migration in (`migrate_in`) is the same with `MigrationSources.migrate_out` as the peer.
Every wait has a deadline. Whatever ends the hand-off early (a failed intake, a failed call, the
caller cancelled) cancels the other leg; the blocks are freed by whoever ends the request
(`DecodeWorker.abort`, the servicer's `finally`), never here. Failures are typed
(pdserve/failures.py and decode_worker/outcomes.py); nothing here knows a gRPC status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.decode_worker.outcomes import await_loop
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.llm_engine import PrefillLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.failures import (
    MIGRATION_SOURCE,
    PREFILL,
    Failure,
    Overloaded,
    RequestFault,
    RequestInvalid,
    WorkerUnavailable,
)
from pdserve.kv_transfer import KvReceiver, KvTransferError, PendingKv
from pdserve.kv_transfer.cuda_ipc_backend import forget_pool
from pdserve.kv_transfer.routing import KvRoute, PeerFacts, choose_route, migration_route, wants_shm
from pdserve.kv_transfer.shm_backend import InPlaceKv
from pdserve.v1 import router_pb2, worker_pb2
from pdserve.worker.runtime import logprob_from_pb, sampling_params_to_pb

log = logging.getLogger(__name__)

CALL_ENDED = "the Prefill call ended before the KV arrived"


class PeerCallFailed(Exception):
    """A call to a peer worker failed: `kind` is the typed failure its status stands for
    (RequestInvalid, Overloaded, RequestFault for a step that broke on the request, WorkerUnavailable
    otherwise), `code` the status's name, `details` its message."""

    def __init__(self, kind: type[Failure], code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.kind, self.code, self.details = kind, code, details


class PrefillPeers(Protocol):
    """The network to the prefill workers (decode_worker/peers.py over gRPC; a fake in tests)."""

    async def segment_prefix(self, address: str, timeout_s: float) -> str:
        """The shared-memory segment prefix the worker reports ("" for none); PeerCallFailed."""

    async def prefill(
        self, address: str, request: worker_pb2.PrefillRequest, timeout_s: float
    ) -> worker_pb2.PrefillResponse:
        """Have it prefill and push the K/V here; its answer once the K/V were acknowledged, or PeerCallFailed."""


class MigrationSources(Protocol):
    """The network to other decode workers, as sources of a live migration."""

    async def migrate_out(
        self, address: str, request: worker_pb2.MigrateOutRequest, timeout_s: float
    ) -> worker_pb2.MigrateOutResponse:
        """Have it push a suspended request's K/V here; PeerCallFailed."""


@dataclass(frozen=True)
class IntakeSettings:
    worker_id: str
    address: str  # this worker's gRPC address (same host as a prefill worker?)
    kv_target: str  # where senders push K/V: this address, or "ray:<actor>"
    kv_backend: str = "auto"  # --kv-backend
    kv_checksum: str = ""  # checksum asked of shared-memory K/V ("": none)
    kv_timeout_s: float = 120.0  # a remote prefill (queue, compute, transfer) or a migration, at most


@dataclass(frozen=True)
class PrefillOutcome:
    """A remote prefill that committed: the peer's answer and the backend the K/V took."""

    response: worker_pb2.PrefillResponse
    backend: str


async def _kv_of(pending: PendingKv, timeout_s: float) -> tuple[Any, int]:
    """Wait (without a thread) until the intake completes; its result, or KvTransferError."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def on_done(_pending: PendingKv) -> None:
        loop.call_soon_threadsafe(lambda: None if done.done() else done.set_result(None))

    pending.add_done_callback(on_done)
    try:
        await asyncio.wait_for(done, timeout=max(0.0, timeout_s))
    except asyncio.TimeoutError:
        raise KvTransferError(f"KV for {pending.request_id!r} not complete after waiting {timeout_s:.1f}s") from None
    return pending.wait(0)


def _prefill_logprobs(
    response: worker_pb2.PrefillResponse, params: SamplingParams, prefill_address: str
) -> PrefillLogprobs:
    """The log-probabilities the prefill worker computed with the prompt, as asked in `params`; a
    worker that left out what was asked failed the hand-off (WorkerUnavailable(PREFILL))."""
    if params.logprobs is not None and not response.HasField("first_logprob"):
        raise WorkerUnavailable(f"prefill worker {prefill_address} sent no logprobs for the first token", PREFILL)
    if params.prompt_logprobs is not None and not response.prompt_logprobs:
        raise WorkerUnavailable(f"prefill worker {prefill_address} sent no prompt logprobs", PREFILL)
    return PrefillLogprobs(
        logprob_from_pb(response.first_logprob) if params.logprobs is not None else None,
        tuple(logprob_from_pb(e) for e in response.prompt_logprobs) if params.prompt_logprobs is not None else None,
    )


@dataclass
class _Legs:
    """How the two legs of a hand-off (the intake, the Prefill call) ended each other."""

    intake_failed: bool = False  # the intake failed while the call ran: we cancelled the call
    call_ended: bool = False  # the call ended while the intake waited: we failed the intake


async def _answer(call: asyncio.Task, pending: PendingKv, legs: _Legs) -> worker_pb2.PrefillResponse:
    """The Prefill answer; a call we cancelled because the intake failed raises that failure (a call
    cancelled because our caller was, stays a cancellation)."""
    try:
        return await call
    except asyncio.CancelledError:
        if call.cancelled() and legs.intake_failed and pending.error():
            raise KvTransferError(pending.error()) from None
        raise


def _call_error(call: asyncio.Task) -> PeerCallFailed | None:
    """How a finished call failed, if it did."""
    if not call.done() or call.cancelled():
        return None
    exc = call.exception()
    return exc if isinstance(exc, PeerCallFailed) else None


class KvIntake:
    """One per decode worker; its coroutines run on the serving event loop."""

    def __init__(
        self,
        worker: DecodeWorker,
        receiver: KvReceiver,
        settings: IntakeSettings,
        prefill_peers: PrefillPeers,
        migration_sources: MigrationSources,
    ) -> None:
        self.worker = worker
        self.receiver = receiver
        self.settings = settings
        self.prefill_peers = prefill_peers
        self.migration_sources = migration_sources
        self._peers: dict[str, PeerFacts] = {}  # prefill address -> what it told us (shared memory only)

    # ----- remote prefill --------------------------------------------------------------------
    async def remote_prefill(
        self,
        request_id: str,
        prefill_address: str,
        prompt_ids: list[int],
        resume_ids: list[int],
        params: SamplingParams,
        deadline: float,
        trace: bool = False,
    ) -> PrefillOutcome:
        """Have `prefill_address` compute the K/V of prompt + resumed tokens, take them in and start
        decoding. A failure on the prefill side is WorkerUnavailable(PREFILL) (RequestFault(PREFILL)
        when its step broke on this request; its RequestInvalid / Overloaded pass on)."""
        route = await self.route(prefill_address, deadline)
        seq = await await_loop(
            self.worker.reserve(request_id, prompt_ids, params, resume_ids, trace), deadline, self.settings.worker_id
        )
        tokens = prompt_ids + resume_ids
        kv_deadline = min(deadline, time.perf_counter() + self.settings.kv_timeout_s)
        spec = self.worker.expected_spec(request_id, len(tokens), seq.num_reused_blocks)
        pending = self.receiver.expect(spec, route.expect_options(max(0.1, kv_deadline - time.perf_counter())))
        request = worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=tokens,
            params=sampling_params_to_pb(params),
            kv_target_address=self.settings.kv_target,
            kv_backend=route.backend,
            decode_worker_id=self.settings.worker_id,
            output_index=len(resume_ids),
            kv_block_offset=spec.block_offset,
            trace=trace,
            kv_checksum=route.checksum,
        )
        call = asyncio.ensure_future(
            self.prefill_peers.prefill(prefill_address, request, max(0.1, kv_deadline - time.perf_counter()))
        )
        legs = self._link(call, pending)
        kv = None
        wants_logprobs = params.logprobs is not None or params.prompt_logprobs is not None
        worker_id = self.settings.worker_id
        try:
            if route.in_place and wants_logprobs:  # copy first (the ack waits for it); the answer has the logprobs
                kv, first_token = await _kv_of(pending, kv_deadline - time.perf_counter())
                await await_loop(self.worker.store(request_id, kv, route.backend, spec.nbytes), deadline, worker_id)
                response = await _answer(call, pending, legs)
                logprobs = _prefill_logprobs(response, params, prefill_address)
                await await_loop(self.worker.start(request_id, first_token, logprobs), deadline, worker_id)
            elif route.in_place:  # the ack (and so the answer) waits for our copy: commit first
                kv, first_token = await _kv_of(pending, kv_deadline - time.perf_counter())
                await self._commit(request_id, kv, first_token, route.backend, deadline, spec.nbytes)
                response = await _answer(call, pending, legs)
            else:
                response = await _answer(call, pending, legs)
                kv, _ = await _kv_of(pending, kv_deadline - time.perf_counter())
                # layer-wise frames cannot carry the first token: the answer does
                shipped = _prefill_logprobs(response, params, prefill_address) if wants_logprobs else None
                await self._commit(request_id, kv, response.first_token_id, route.backend, deadline, None, shipped)
        except (PeerCallFailed, KvTransferError) as exc:
            pending.cancel("prefill failed")
            call.cancel()
            raise self._prefill_failure(exc, call, pending, prefill_address, legs.call_ended) from exc
        finally:
            if isinstance(kv, InPlaceKv):
                kv.release()  # no-op once copied; otherwise the prefill worker stops waiting for us
            if not pending.done():
                pending.cancel("request ended")  # the caller left meanwhile
            call.cancel()
        return PrefillOutcome(response, route.backend)

    async def route(self, prefill_address: str, deadline: float) -> KvRoute:
        """The route of one hand-off from `prefill_address` into our cache; WorkerUnavailable(PREFILL)
        when `shm` is forced and its segments cannot be bound."""
        settings = self.settings
        peer = PeerFacts(prefill_address)
        if wants_shm(settings.kv_backend, prefill_address, settings.address):
            peer = self._peers.get(prefill_address) or await self._ask_segments(prefill_address, deadline)
        try:
            return choose_route(
                settings.kv_backend, settings.address, peer, settings.kv_checksum, self.worker.engine.kv_cache.device
            )
        except KvTransferError as exc:
            raise WorkerUnavailable(f"prefill failed on {prefill_address}: {exc}", PREFILL) from exc

    async def _ask_segments(self, address: str, deadline: float) -> PeerFacts:
        try:
            timeout_s = max(0.1, min(10.0, deadline - time.perf_counter()))
            prefix = await self.prefill_peers.segment_prefix(address, timeout_s)
            peer = PeerFacts(address, prefix)
        except PeerCallFailed as exc:
            peer = PeerFacts(address, why=f"GetInfo failed: {exc}")
        self._peers[address] = peer
        return peer

    @staticmethod
    def _link(call: asyncio.Task, pending: PendingKv) -> _Legs:
        """Each leg ends the other: a failed intake cancels the call; a call that ended before the K/V
        arrived fails the intake."""
        loop = asyncio.get_running_loop()
        legs = _Legs()

        def on_intake_done(p: PendingKv) -> None:  # any thread
            if p.error() and not call.done():
                legs.intake_failed = True
                loop.call_soon_threadsafe(call.cancel)

        def on_call_done(_call: asyncio.Task) -> None:
            _call_error(_call)  # retrieve its exception: no "never retrieved" warning when the intake failed first
            if not pending.done():
                legs.call_ended = True
                pending.cancel(CALL_ENDED)

        pending.add_done_callback(on_intake_done)
        call.add_done_callback(on_call_done)
        return legs

    async def _commit(
        self,
        request_id: str,
        kv: Any,  # noqa: ANN401
        first_token: int,
        backend: str,
        deadline: float,
        nbytes: int | None = None,
        logprobs: PrefillLogprobs | None = None,
    ) -> None:
        committed = self.worker.commit(request_id, kv, first_token, backend, nbytes, logprobs)
        await await_loop(committed, deadline, self.settings.worker_id)

    def _prefill_failure(
        self, exc: Exception, call: asyncio.Task, pending: PendingKv, prefill_address: str, call_ended: bool
    ) -> Failure:
        """Pass the request's own faults on; report everything else as the prefill side's failure."""
        peer = self._peers.pop(prefill_address, None)  # it may have restarted: ask it again next time
        if peer is not None and peer.segment_prefix:
            forget_pool(peer.segment_prefix)  # and unmap its device KV pool (cuda_ipc), if we mapped one
        status = exc if isinstance(exc, PeerCallFailed) else _call_error(call)
        if status is not None and status.kind in (RequestInvalid, Overloaded):
            return status.kind(f"prefill worker {prefill_address}: {status.details}")
        reason = pending.error()
        if status is not None and (not reason or call_ended):  # the call's own status says more
            reason = status.details
        kind = RequestFault if status is not None and status.kind is RequestFault else WorkerUnavailable
        return kind(f"prefill failed on {prefill_address}: {reason or exc}", PREFILL)

    # ----- live migration, target side -----------------------------------------------------------
    async def migrate_in(
        self,
        request_id: str,
        source: str,
        source_request_id: str,
        prompt_ids: list[int],
        resume_ids: list[int],
        params: SamplingParams,
        deadline: float,
        trace: bool = False,
    ) -> router_pb2.MigrationMarker:
        """Reserve blocks for prompt + outputs, expect the K/V of every token but the last, have the
        source push them, then decode on. No prompt token is computed here. A failure of the source or
        of the push is WorkerUnavailable(MIGRATION_SOURCE): the router then fails the request over."""
        if not resume_ids or not source_request_id:
            raise RequestInvalid("migrate_from_address needs migrate_request_id and resume_output_ids")
        started = time.perf_counter()
        worker_id = self.settings.worker_id
        seq = await await_loop(
            self.worker.reserve(request_id, prompt_ids, params, resume_ids, trace), deadline, worker_id
        )
        num_tokens = len(prompt_ids) + len(resume_ids) - 1
        n_blocks = blocks_for_tokens(num_tokens, self.worker.engine.pool.block_size)
        offset = min(seq.num_reused_blocks, n_blocks - 1)  # at least one block travels
        route = migration_route(self.settings.kv_backend)
        kv_deadline = min(deadline, time.perf_counter() + self.settings.kv_timeout_s)
        spec = self.worker.expected_spec(request_id, num_tokens, offset)
        pending = self.receiver.expect(spec, route.expect_options(max(0.1, kv_deadline - time.perf_counter())))
        order = worker_pb2.MigrateOutRequest(
            request_id=source_request_id,
            target_request_id=request_id,
            kv_target_address=self.settings.kv_target,
            kv_backend=route.backend,
            num_tokens=num_tokens,
            kv_block_offset=offset,
            target_worker_id=worker_id,
        )
        try:
            response = await self.migration_sources.migrate_out(
                source, order, max(0.1, kv_deadline - time.perf_counter())
            )
            kv, _ = await _kv_of(pending, kv_deadline - time.perf_counter())
        except (PeerCallFailed, KvTransferError) as exc:
            pending.cancel("migration failed")
            raise WorkerUnavailable(f"migration failed from {source}: {exc}", MIGRATION_SOURCE) from exc
        finally:
            if not pending.done():
                pending.cancel("request ended")
        await await_loop(self.worker.commit_migrated(request_id, kv, spec.nbytes, offset), deadline, worker_id)
        log.info(
            "request_id=%s migrated in from %s: %d tokens, %d KV bytes", request_id, source, num_tokens, spec.nbytes
        )
        return router_pb2.MigrationMarker(
            resumed=True, num_tokens=num_tokens, kv_bytes=response.kv_bytes, kv_transfer_s=time.perf_counter() - started
        )
