"""The decode worker's gRPC adapter: DecodeWorker.Generate/GenerateMux/GetInfo/Abort, Tokenize and
Detokenize (decode_worker/token_service.py), and the source side of live migration. It reads
protos into typed calls (decode_worker/codec.py), calls the core
(`DecodeWorker`, the decode-side KV contract `KvIntake`, `MigrationSource`) and maps their typed
outcomes to statuses in one place (`_abort`): pdserve/failures.py's failures with their label in the
trailing metadata, decode_worker/outcomes.py's others by `STATUSES`.

Generate is a coroutine on the server's event loop (no thread per stream): the engine loop thread
hands each request's outputs to the event loop as they come. Every wait has a deadline; every exit
(error, client gone) aborts the request, which frees whatever it holds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import NoReturn

import grpc

from pdserve import failures
from pdserve.decode_worker.codec import (
    ReadRequest,
    add_logprobs,
    read_request,
    record_prefill,
    response_of,
    tokenize_event,
    worker_info,
)
from pdserve.decode_worker.kv_intake import IntakeSettings, KvIntake
from pdserve.decode_worker.migration_source import MigrationSource
from pdserve.decode_worker.mux import serve_mux
from pdserve.decode_worker.outcomes import (
    DeadlinePassed,
    NotFound,
    NotPermitted,
    WrongState,
    await_loop,
    internal_fault,
)
from pdserve.decode_worker.peers import GrpcPeers
from pdserve.decode_worker.request_stream import RequestStream
from pdserve.decode_worker.token_service import answer_detokenize, answer_tokenize
from pdserve.decode_worker.worker import DecodeWorker, Suspended
from pdserve.failures import DECODE, Failure, RequestInvalid, WorkerUnavailable
from pdserve.kv_transfer import KvReceiver
from pdserve.transport import is_router_call
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.runtime import Drain, node_identity, trace_events_to_pb

#: The core's outcomes that are not a typed failure, and their statuses.
STATUSES = {
    DeadlinePassed: grpc.StatusCode.DEADLINE_EXCEEDED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    NotPermitted: grpc.StatusCode.PERMISSION_DENIED,
    WrongState: grpc.StatusCode.FAILED_PRECONDITION,
}
OUTCOMES: tuple[type[Exception], ...] = (Failure, *STATUSES)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End the call with the status of a typed outcome."""
    if isinstance(exc, Failure):
        await failures.abort(context, exc)
    await context.abort(STATUSES[type(exc)], str(exc))
    raise AssertionError("unreachable")  # context.abort raises


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        worker: DecodeWorker,
        kv_receiver: KvReceiver,
        worker_id: str,
        address: str,
        colocated: bool,
        local_prefill_threshold: int,
        request_timeout_s: float,
        kv_timeout_s: float = 120.0,
        drain: Drain | None = None,
        kv_backend: str = "grpc",
        kv_target: str = "",
        kv_checksum: str = "",
    ) -> None:
        self.worker = worker
        self.worker_id, self.address, self.kv_target = worker_id, address, kv_target or address
        self.node_id, self.node_host = node_identity()
        self.colocated = colocated
        self.local_prefill_threshold = local_prefill_threshold
        self.request_timeout_s = request_timeout_s
        self.drain = drain or Drain()
        peers = GrpcPeers()
        settings = IntakeSettings(worker_id, address, self.kv_target, kv_backend, kv_checksum, kv_timeout_s)
        self.intake = KvIntake(worker, kv_receiver, settings, peers, peers)
        self.migration = MigrationSource(worker, worker_id, kv_timeout_s)

    def unhealthy_reason(self) -> str:
        """Why this worker takes no new requests ("" when it does)."""
        return self.worker.dead_reason or ("draining" if self.drain.draining else "")

    async def Generate(  # noqa: N802
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        start = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if reason := self.unhealthy_reason():
                raise WorkerUnavailable(f"decode worker {self.worker_id}: {reason}", DECODE)
            read = await read_request(self.worker.loaded, request, self.worker_id, request_id)
            async for response in self._generate(request_id, request, read, start, context):
                yield response
        except OUTCOMES as exc:
            await _abort(context, exc)

    async def GenerateMux(
        self,
        request_iterator: AsyncIterator[worker_pb2.MuxRequest],  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Generate for many requests on one stream (decode_worker/mux.py)."""
        await serve_mux(self.Generate, request_iterator, context)

    async def _generate(
        self,
        request_id: str,
        request: worker_pb2.DecodeRequest,
        read: ReadRequest,
        start: float,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        self.worker.metrics.tokenize_time.observe(read.tokenize_s)
        timings = common_pb2.Timings(tokenize_s=read.tokenize_s)
        trace: list[common_pb2.TraceEvent] | None = None  # events not sent yet (traced requests only)
        if request.trace:
            event = tokenize_event(self.worker.loaded, self.worker_id, read.prompt_ids, read.tokenize_s)
            yield router_pb2.GenerateResponse(request_id=request_id, trace=[event])
            trace = []
        remaining = context.time_remaining()
        deadline = start + (self.request_timeout_s if remaining is None else min(remaining, self.request_timeout_s))
        prompt_ids, resume_ids, params, traced = read.prompt_ids, read.resume_ids, read.params, trace is not None
        with RequestStream(self.worker, self.worker_id, request_id, deadline) as stream:
            prefill_cached = 0
            if request.migrate_from_address:
                marker = await self.intake.migrate_in(
                    request_id,
                    request.migrate_from_address,
                    request.migrate_request_id,
                    prompt_ids,
                    resume_ids,
                    params,
                    deadline,
                    traced,
                )
                yield router_pb2.GenerateResponse(request_id=request_id, migration=marker)
            elif self._prefill_locally(request, prompt_ids):
                await await_loop(
                    self.worker.add_local(request_id, prompt_ids, params, resume_ids, traced), deadline, self.worker_id
                )
            else:
                outcome = await self.intake.remote_prefill(
                    request_id, request.prefill_address, prompt_ids, resume_ids, params, deadline, traced
                )
                record_prefill(outcome, self.worker_id, timings, trace)
                prefill_cached = outcome.response.cached_tokens
            async for response in self._stream(stream, timings, start, trace, prefill_cached):
                yield response

    def _prefill_locally(self, request: worker_pb2.DecodeRequest, prompt_ids: list[int]) -> bool:
        # log-probabilities are computed where the prompt is (the prefill worker ships the first
        # token's and the prompt's with its answer); only a resumed request that wants the prompt's
        # is prefilled here: the prefill worker would see prompt + resumed tokens as its prompt
        resumed_prompt_logprobs = bool(request.resume_output_ids) and request.params.HasField("prompt_logprobs")
        return (
            self.colocated
            or not request.prefill_address
            or len(prompt_ids) < self.local_prefill_threshold
            or resumed_prompt_logprobs
        )

    async def _stream(
        self,
        stream: RequestStream,
        timings: common_pb2.Timings,
        start: float,
        trace: list[common_pb2.TraceEvent] | None,
        prefill_cached: int = 0,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        first_at: float | None = None
        tokenizer = self.worker.loaded.tokenizer
        while True:
            item = await stream.next()
            if isinstance(item, Suspended):  # live migration: another decode worker takes over
                yield router_pb2.GenerateResponse(
                    request_id=stream.request_id, migration=router_pb2.MigrationMarker(suspended=True)
                )
                return
            first_at = first_at or time.perf_counter()
            response = response_of(stream.request_id, item, timings, start, first_at, prefill_cached)
            if item.logprob is not None or item.prompt_logprobs is not None:
                add_logprobs(response, item, tokenizer)
            if trace is not None:
                response.trace.extend(trace + trace_events_to_pb(item.trace, self.worker_id, tokenizer))
                trace.clear()
            if item.finish_reason is not None:
                self.worker.metrics.detokenize_time.observe(item.detokenize_s)
            yield response
            if item.finish_reason is not None:
                return

    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.WorkerInfo:  # noqa: N802
        return worker_info(
            self.worker,
            self.worker_id,
            self.address,
            self.kv_target,
            self.colocated,
            self.unhealthy_reason(),
            (self.node_id, self.node_host),
        )

    def Abort(self, request: worker_pb2.AbortRequest, context: grpc.ServicerContext) -> worker_pb2.AbortResponse:  # noqa: N802
        found = request.request_id in self.worker.engine.sequences
        self.worker.abort(request.request_id)
        self.worker.release_suspended(request.request_id)  # a migration given up
        return worker_pb2.AbortResponse(found=found)

    # ----- the tokenizer, for the HTTP API's /tokenize and /detokenize (decode_worker/token_service.py)
    async def Tokenize(
        self,
        request: worker_pb2.TokenizeRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.TokenizeResponse:
        try:
            return await answer_tokenize(self.worker.loaded, request)
        except RequestInvalid as exc:
            await _abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - not the request's fault: our bug, said as such
            await _abort(context, internal_fault(self.worker_id, "", "tokenizing", exc))

    async def Detokenize(
        self,
        request: worker_pb2.DetokenizeRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.DetokenizeResponse:
        try:
            return await answer_detokenize(self.worker.loaded, request)
        except RequestInvalid as exc:
            await _abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - not the request's fault: our bug, said as such
            await _abort(context, internal_fault(self.worker_id, "", "detokenizing", exc))

    # ----- live migration, source side (decode_worker/migration_source.py) -------------------------
    def SetKvTargets(
        self,
        request: worker_pb2.KvTargets,  # noqa: N802
        context: grpc.ServicerContext,
    ) -> worker_pb2.KvTargetsAck:
        if not is_router_call(context.invocation_metadata()):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "only the router may set KV targets (router credential missing or wrong)",
            )
        self.migration.set_targets(frozenset(t for t in request.targets if t))
        return worker_pb2.KvTargetsAck(num_targets=len(self.migration.kv_targets))

    async def Suspend(
        self,
        request: worker_pb2.SuspendRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.SuspendResponse:
        try:
            seq = await self.migration.suspend(request.request_id)
        except OUTCOMES as exc:
            await _abort(context, exc)
        return worker_pb2.SuspendResponse(num_output_tokens=len(seq.output_ids), num_cached_tokens=seq.num_cached)

    async def MigrateOut(
        self,
        request: worker_pb2.MigrateOutRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.MigrateOutResponse:
        """Push a suspended request's K/V to a registered decode worker, then free them here."""
        try:
            return await self.migration.migrate_out(request)
        except OUTCOMES as exc:
            await _abort(context, exc)
