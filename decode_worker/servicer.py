"""Thin gRPC face of the decode worker: DecodeWorker.Generate/GenerateMux/GetInfo/Abort.

Generate is a coroutine on the server's event loop (no thread per stream). For a remote prefill:
tokenize -> reserve blocks -> expect the KV -> ask the prefill worker -> commit the KV -> stream
tokens, which the engine loop thread hands to the event loop as they come. Every wait has a
deadline; every early exit (error, client gone) aborts the request, which frees whatever it holds.

Statuses are typed failures (pdserve/failures.py: the status plus FAILURE_KEY in the trailing
metadata): a request that broke a step is RequestFault (INTERNAL); a worker that cannot serve
(draining, engine loop dead: side DECODE; the prefill side failed: side PREFILL; a migration source
that could not hand over: MIGRATION_SOURCE) is WorkerUnavailable, so the router retries elsewhere,
avoiding that side; a bad request is RequestInvalid, no room is Overloaded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

import grpc

from pdserve import failures
from pdserve.decode_worker.mux import serve_mux
from pdserve.decode_worker.worker import AdmissionError, DecodeWorker, StreamError, Suspended, WorkerDead
from pdserve.engine import structured
from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.llm_engine import TokenOutput
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.sampler import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.trace import token_bytes
from pdserve.engine.worker_runtime import (
    Drain,
    finish_reason_to_pb,
    node_identity,
    sampling_params_from_pb,
    sampling_params_to_pb,
    trace_events_to_pb,
)
from pdserve.failures import (
    DECODE,
    MIGRATION_SOURCE,
    PREFILL,
    Overloaded,
    RequestFault,
    RequestInvalid,
    WorkerUnavailable,
)
from pdserve.kv_transfer import KvSpec, KvTransferError, KvTransferServicer, get_backend
from pdserve.kv_transfer.cuda_ipc_backend import IN_PLACE_BACKENDS, choose_backend, forget_pool
from pdserve.kv_transfer.shm_backend import SEGMENT_PREFIX as SHM_PREFIX
from pdserve.kv_transfer.shm_backend import InPlaceKv
from pdserve.telemetry.memory import trim as trim_heap
from pdserve.tokenization import chat_from_pb, encode_chat, encode_text, input_chars
from pdserve.transport import is_router_call, open_aio_channel
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})
#: Statuses from a prefill worker that are the request's own fault: passed on, never retried.
CLIENT_ERRORS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})
#: The prefill worker's step broke on this request (not the worker): passed on as INTERNAL, which the
#: router retries once elsewhere without suspecting anyone, and fails as a poison request the second time.
STEP_FAULTS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
CALL_ENDED = "the Prefill call ended before the KV arrived"


_DEADLINE = object()  # put on a request's item queue when its deadline passes


async def _call_error(call: grpc.aio.UnaryUnaryCall) -> tuple[grpc.StatusCode, str] | None:
    """The status a finished Prefill call ended with, if it failed."""
    if not call.done() or call.cancelled():
        return None
    code = await call.code()
    return None if code == grpc.StatusCode.OK else (code, await call.details() or code.name)


async def _prefill_response(call: grpc.aio.UnaryUnaryCall, pending: Any) -> worker_pb2.PrefillResponse:
    """The Prefill answer; a call we cancelled because the KV intake failed raises that failure."""
    try:
        return await call
    except asyncio.CancelledError:
        if call.cancelled() and pending.error():
            raise KvTransferError(pending.error()) from None
        raise


async def _kv_of(pending: Any, timeout_s: float) -> tuple[Any, int]:
    """Wait (without a thread) until the KV intake completes; its result, or KvTransferError."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def on_done(_pending: Any) -> None:
        loop.call_soon_threadsafe(lambda: None if done.done() else done.set_result(None))

    pending.add_done_callback(on_done)
    try:
        await asyncio.wait_for(done, timeout=max(0.0, timeout_s))
    except asyncio.TimeoutError:
        raise KvTransferError(f"KV for {pending.request_id!r} not complete after waiting {timeout_s:.1f}s") from None
    return pending.wait(0)


def _sink_to(loop: asyncio.AbstractEventLoop, items: asyncio.Queue) -> Callable[[Any], None]:
    """A StreamSink that hands items from the engine loop thread to `items` on `loop`."""
    def sink(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass
    return sink


#: Prompts (or chats) of more characters are tokenized in a thread, not on the event loop: tokenizing
#: 1M characters, or templating 256 long messages, took 1-13 s, during which every stream froze.
INLINE_TOKENIZE_CHARS = 16 * 1024



def _tokenize_large(loaded: LoadedModel, request: worker_pb2.DecodeRequest) -> list[int]:
    """`prompt_ids_from_pb` of a large input, then the freed heap back to the OS: tokenizing 1M
    characters in a thread left ~150 MB in that thread's malloc arena otherwise."""
    try:
        return prompt_ids_from_pb(loaded, request)
    finally:
        trim_heap()


def prompt_ids_from_pb(loaded: LoadedModel, request: worker_pb2.DecodeRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return encode_text(loaded.tokenizer, request.prompt)
    if kind == "messages":
        return encode_chat(loaded.tokenizer, *chat_from_pb(request.messages))
    if kind == "token_ids":
        count = len(request.token_ids.ids)
        if not count:
            raise RequestInvalid("token_ids: must not be empty")
        if count >= loaded.max_model_len:  # the engine's own refusal, before a million ids become a list
            raise RequestInvalid(f"prompt has {count} tokens; the model's context is {loaded.max_model_len}")
        return list(request.token_ids.ids)
    raise RequestInvalid("input: one of prompt, messages or token_ids is required")


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, kv_receiver: KvTransferServicer, worker_id: str, address: str,
                 colocated: bool, local_prefill_threshold: int, request_timeout_s: float,
                 kv_timeout_s: float = 120.0, drain: Drain | None = None, kv_backend: str = "grpc",
                 kv_target: str = "", kv_checksum: str = "") -> None:
        self.worker = worker
        self.kv_checksum = kv_checksum  # algorithm of the checksum asked of shared-memory KV ("": none)
        self.kv_backend = kv_backend  # named in every PrefillRequest: how the prefill worker ships KV here
        self.kv_target = kv_target or address  # e.g. this worker's gRPC address, or "ray:decode-0"
        self.kv_receiver = kv_receiver
        self.worker_id = worker_id
        self.node_id, self.node_host = node_identity()
        self.address = address
        self.colocated = colocated
        self.local_prefill_threshold = local_prefill_threshold
        self.request_timeout_s = request_timeout_s
        self.kv_timeout_s = kv_timeout_s
        self.drain = drain or Drain()
        self._prefill_stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}  # event-loop channels
        self._decode_stubs: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}  # migration sources
        self._kv_targets: frozenset[str] = frozenset()  # decode workers migrated KV may go to (SetKvTargets)
        self._segment_prefixes: dict[str, str] = {}  # prefill address -> its shm segment prefix ("": none)

    def unhealthy_reason(self) -> str:
        """Why this worker takes no new requests ("" when it does)."""
        if self.worker.dead_reason:
            return self.worker.dead_reason
        return "draining" if self.drain.draining else ""

    # ----- Generate --------------------------------------------------------------------------
    async def Generate(  # noqa: N802
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        start = time.perf_counter()
        if reason := self.unhealthy_reason():
            await failures.abort(context, WorkerUnavailable(f"decode worker {self.worker_id}: {reason}", DECODE))
        request_id = request.request_id or uuid.uuid4().hex
        try:
            tokenize_start = time.perf_counter()
            if input_chars(request) <= INLINE_TOKENIZE_CHARS:
                prompt_ids = prompt_ids_from_pb(self.worker.loaded, request)
            else:  # a large prompt or chat: off the event loop that relays every other stream
                prompt_ids = await asyncio.to_thread(_tokenize_large, self.worker.loaded, request)
            tokenize_s = time.perf_counter() - tokenize_start
            params = sampling_params_from_pb(request.params)
            resume_ids = list(request.resume_output_ids)
            if len(resume_ids) >= params.max_tokens:
                raise RequestInvalid("resume_output_ids: as many tokens as max_tokens; nothing left to do")
            if params.structured is not None:  # a bad schema is the request's 400, before any work
                await asyncio.to_thread(structured.check, self.worker.loaded, *params.structured)
        except RequestInvalid as exc:
            await failures.abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - not the request's fault: our bug, said as such
            await self._internal(context, request_id, "reading the request", exc)
        self.worker.metrics.tokenize_time.observe(tokenize_s)
        timings = common_pb2.Timings(tokenize_s=tokenize_s)
        trace: list[common_pb2.TraceEvent] | None = None  # events not sent yet (traced requests only)
        if request.trace:
            tokenized = self._tokenize_event(prompt_ids, tokenize_s)
            yield router_pb2.GenerateResponse(request_id=request_id, trace=[tokenized])
            trace = []
        deadline = start + self._timeout(context)
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        timer = loop.call_later(max(0.0, deadline - time.perf_counter()), items.put_nowait, _DEADLINE)
        self.worker.open_stream(request_id, _sink_to(loop, items))
        try:
            prefill_cached = 0
            if request.migrate_from_address:
                marker = await self._migrate_in(request_id, request, prompt_ids, resume_ids, params, deadline,
                                                context, trace is not None)
                yield router_pb2.GenerateResponse(request_id=request_id, migration=marker)
            elif self._prefill_locally(request, prompt_ids):
                await self._wait(self.worker.add_local(request_id, prompt_ids, params, resume_ids, trace is not None),
                                 deadline, context)
            else:
                prefill_cached = await self._remote_prefill(request_id, request.prefill_address, prompt_ids,
                                                            resume_ids, params, deadline, context, timings, trace)
            async for response in self._stream(request_id, items, context, timings, start, trace, prefill_cached):
                yield response
        finally:
            timer.cancel()
            self.worker.close_stream(request_id)
            self.worker.abort(request_id)

    async def GenerateMux(self, request_iterator: AsyncIterator[worker_pb2.MuxRequest],  # noqa: N802
                          context: grpc.aio.ServicerContext) -> None:
        """Generate for many requests on one stream (decode_worker/mux.py)."""
        await serve_mux(self.Generate, request_iterator, context)

    async def _migrate_in(self, request_id: str, request: worker_pb2.DecodeRequest, prompt_ids: list[int],
                          resume_ids: list[int], params: SamplingParams, deadline: float,
                          context: grpc.aio.ServicerContext, trace: bool) -> router_pb2.MigrationMarker:
        """Live migration, target side: reserve blocks for prompt + outputs, expect the K/V of every
        token but the last, have the source push them (MigrateOut), then decode on. No prompt token
        is computed here. A failure of the source or of the push ends with UNAVAILABLE and details
        WorkerUnavailable(MIGRATION_SOURCE): the router then fails the request over (re-prefill)."""
        source = request.migrate_from_address
        if not resume_ids or not request.migrate_request_id:
            await failures.abort(context, RequestInvalid(
                "migrate_from_address needs migrate_request_id and resume_output_ids"))
        started = time.perf_counter()
        seq = await self._wait(self.worker.reserve(request_id, prompt_ids, params, resume_ids, trace), deadline,
                               context)
        num_tokens = len(prompt_ids) + len(resume_ids) - 1
        n_blocks = blocks_for_tokens(num_tokens, self.worker.engine.pool.block_size)
        offset = min(seq.num_reused_blocks, n_blocks - 1)  # at least one block travels
        backend = "ray" if self.kv_backend == "ray" else "grpc"  # the source's cache is not in shared memory
        kv_deadline = min(deadline, time.perf_counter() + self.kv_timeout_s)
        spec = self.worker.expected_spec(request_id, num_tokens, offset)
        pending = self.kv_receiver.expect(spec, deadline_s=max(0.1, kv_deadline - time.perf_counter()))
        call = self._decode_stub(source).MigrateOut(
            worker_pb2.MigrateOutRequest(
                request_id=request.migrate_request_id, target_request_id=request_id, kv_target_address=self.kv_target,
                kv_backend=backend, num_tokens=num_tokens, kv_block_offset=offset, target_worker_id=self.worker_id),
            timeout=max(0.1, kv_deadline - time.perf_counter()))
        try:
            response = await call
            kv, _ = await _kv_of(pending, kv_deadline - time.perf_counter())
        except (grpc.aio.AioRpcError, KvTransferError) as exc:
            pending.cancel("migration failed")
            reason = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            await failures.abort(context, WorkerUnavailable(f"migration failed from {source}: {reason}",
                                                            MIGRATION_SOURCE))
        finally:
            if not pending.done():
                pending.cancel("request ended")
            call.cancel()
        await self._wait(self.worker.commit_migrated(request_id, kv, spec.nbytes, offset), deadline, context)
        log.info("request_id=%s migrated in from %s: %d tokens, %d KV bytes", request_id, source, num_tokens,
                 spec.nbytes)
        return router_pb2.MigrationMarker(resumed=True, num_tokens=num_tokens, kv_bytes=response.kv_bytes,
                                          kv_transfer_s=time.perf_counter() - started)

    def _decode_stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        stub = self._decode_stubs.get(address)
        if stub is None:
            stub = worker_pb2_grpc.DecodeWorkerStub(open_aio_channel(address))
            self._decode_stubs[address] = stub
        return stub

    def _tokenize_event(self, prompt_ids: list[int], tokenize_s: float) -> common_pb2.TraceEvent:
        pieces = token_bytes(self.worker.loaded.tokenizer, prompt_ids)
        return common_pb2.TraceEvent(worker_id=self.worker_id, tokenize=common_pb2.TraceTokenize(
            token_ids=prompt_ids, pieces=pieces, time_s=tokenize_s))

    def _prefill_locally(self, request: worker_pb2.DecodeRequest, prompt_ids: list[int]) -> bool:
        # log-probabilities (of the prompt, or of the first token, which a prefill worker samples) are
        # computed where the request is prefilled: such requests are prefilled here
        wants_logprobs = request.params.HasField("logprobs") or request.params.HasField("prompt_logprobs")
        return (self.colocated or not request.prefill_address or len(prompt_ids) < self.local_prefill_threshold
                or wants_logprobs)

    def _timeout(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return self.request_timeout_s if remaining is None else min(remaining, self.request_timeout_s)

    async def _wait(self, future: Future, deadline: float, context: grpc.aio.ServicerContext) -> Any:
        """Await an engine-loop future within the deadline, mapping its failure to a status."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout=max(0.0, deadline - time.perf_counter()))
        except AdmissionError as exc:
            await failures.abort(context, Overloaded(str(exc)))
        except WorkerDead as exc:
            await failures.abort(context, WorkerUnavailable(f"decode worker {self.worker_id}: {exc}", DECODE))
        except RequestInvalid as exc:
            await failures.abort(context, exc)
        except asyncio.TimeoutError:
            future.cancel()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed while waiting")
        except KvTransferError:
            raise  # the K/V hand-off's failure: _remote_prefill reports it as the prefill side's
        except Exception as exc:  # noqa: BLE001 - not the request's fault: our bug, said as such
            await self._internal(context, "", "the engine loop", exc)

    async def _internal(self, context: grpc.aio.ServicerContext, request_id: str, what: str,
                        exc: BaseException) -> None:
        """End the call INTERNAL for an exception that is not a typed failure: a bug here, logged with
        its traceback. Typed RequestFault (side DECODE): the router retries the request once
        elsewhere without suspecting this worker, and gives it up if it fails the same way again."""
        log.error("request_id=%s: %s failed: %s: %s", request_id or "-", what, type(exc).__name__, exc,
                  exc_info=exc)
        await failures.abort(context, RequestFault(
            f"decode worker {self.worker_id}: internal error in {what}: {type(exc).__name__}: {exc}", DECODE))

    async def _remote_prefill(self, request_id: str, prefill_address: str, prompt_ids: list[int],
                              resume_ids: list[int], params: SamplingParams, deadline: float,
                              context: grpc.aio.ServicerContext, timings: common_pb2.Timings,
                              trace: list[common_pb2.TraceEvent] | None = None) -> int:
        """Reserve, then have `prefill_address` compute the K/V of prompt + resumed tokens and push
        them here; return the prompt tokens the prefill worker took from its prefix cache. A failure on
        the prefill side ends with UNAVAILABLE (INTERNAL when the prefill worker's step broke on this
        request), typed with side PREFILL (pdserve/failures.py), so the router prefills the request again
        elsewhere (suspecting the prefill worker only for UNAVAILABLE). `trace`: gets the prefill worker's pass events
        and the KV hand-off."""
        backend, segment_prefix = await self._backend_and_segments(prefill_address, deadline, context)
        seq = await self._wait(self.worker.reserve(request_id, prompt_ids, params, resume_ids, trace is not None),
                               deadline, context)
        tokens = prompt_ids + resume_ids
        in_place = backend in IN_PLACE_BACKENDS  # blocks are copied from the prefill worker's memory into ours
        kv_deadline = min(deadline, time.perf_counter() + self.kv_timeout_s)
        spec = self.worker.expected_spec(request_id, len(tokens), seq.num_reused_blocks)
        pending = self.kv_receiver.expect(spec, deadline_s=max(0.1, kv_deadline - time.perf_counter()),
                                          in_place=in_place, shm_segment_prefix=segment_prefix,
                                          require_checksum=self.kv_checksum if in_place else "")
        call = self._prefill_stub(prefill_address).Prefill(
            worker_pb2.PrefillRequest(
                request_id=request_id, prompt_token_ids=tokens, params=sampling_params_to_pb(params),
                kv_target_address=self.kv_target, kv_backend=backend, decode_worker_id=self.worker_id,
                output_index=len(resume_ids), kv_block_offset=spec.block_offset, trace=trace is not None,
                kv_checksum=self.kv_checksum if in_place else "",
            ),
            timeout=max(0.1, kv_deadline - time.perf_counter()),
        )
        loop = asyncio.get_running_loop()
        pending.add_done_callback(lambda p: loop.call_soon_threadsafe(call.cancel) if p.error() else None)
        call_ended: list[bool] = []  # the Prefill call ended while the KV intake still waited

        def on_call_done(_call: Any) -> None:
            if not pending.done():
                call_ended.append(True)
                pending.cancel(CALL_ENDED)

        call.add_done_callback(on_call_done)
        kv = None
        try:
            if in_place:  # the ack (and so the response) waits for our copy: commit first
                kv, first_token = await _kv_of(pending, kv_deadline - time.perf_counter())
                await self._wait(self.worker.commit(request_id, kv, first_token, backend, spec.nbytes), deadline,
                                 context)
                response = await _prefill_response(call, pending)
            else:
                response = await _prefill_response(call, pending)
                kv, _ = await _kv_of(pending, kv_deadline - time.perf_counter())
                first_token = response.first_token_id  # layer-wise frames cannot carry it: the response does
                await self._wait(self.worker.commit(request_id, kv, first_token, backend), deadline, context)
        except (grpc.aio.AioRpcError, KvTransferError) as exc:
            pending.cancel("prefill failed")
            call.cancel()
            await self._prefill_failed(exc, call, pending, prefill_address, context, bool(call_ended))
        finally:
            if isinstance(kv, InPlaceKv):
                kv.release()  # no-op once copied; otherwise the prefill worker stops waiting for us
            if not pending.done():
                pending.cancel("request ended")  # the client left meanwhile
            call.cancel()
        timings.MergeFrom(response.timings)
        if trace is not None:
            trace.extend(response.trace)
            trace.append(common_pb2.TraceEvent(worker_id=self.worker_id, kv_transfer=common_pb2.TraceKvTransfer(
                backend=backend, bytes=response.kv_bytes, time_s=response.timings.kv_transfer_s)))
        return response.cached_tokens

    async def _prefill_failed(self, exc: Exception, call: grpc.aio.UnaryUnaryCall, pending: Any,
                              prefill_address: str, context: grpc.aio.ServicerContext, call_ended: bool) -> None:
        """Pass the request's own faults on; report everything else as the prefill side's failure."""
        prefix = self._segment_prefixes.pop(prefill_address, None)  # it may have restarted: ask it again next time
        if prefix:
            forget_pool(prefix)  # and unmap its device KV pool (cuda_ipc), if we mapped one
        if isinstance(exc, grpc.aio.AioRpcError):
            status: tuple[grpc.StatusCode, str] | None = (exc.code(), exc.details() or exc.code().name)
        else:
            status = await _call_error(call)
        if status is not None and status[0] in CLIENT_ERRORS:
            failure = RequestInvalid if status[0] == grpc.StatusCode.INVALID_ARGUMENT else Overloaded
            await failures.abort(context, failure(f"prefill worker {prefill_address}: {status[1]}"))
        reason = pending.error()
        if status is not None and (not reason or call_ended):  # the call's own status says more
            reason = status[1]
        step_fault = status is not None and status[0] in STEP_FAULTS
        kind = RequestFault if step_fault else WorkerUnavailable
        await failures.abort(context, kind(f"prefill failed on {prefill_address}: {reason or exc}", PREFILL))

    async def _backend_and_segments(self, prefill_address: str, deadline: float,
                                    context: grpc.aio.ServicerContext) -> tuple[str, str]:
        """The backend for one transfer and, for "shm" and "cuda_ipc", the segment prefix of that prefill
        worker (asked once with GetInfo, then remembered until a prefill there fails): only its segments
        and its device pool are accepted for this request. Under `auto`, a prefill worker that reports no
        prefix (or cannot be asked) ships over gRPC; under `shm` that is the prefill side's failure."""
        backend = self._backend_for(prefill_address)
        if backend not in IN_PLACE_BACKENDS:
            return backend, ""
        prefix = self._segment_prefixes.get(prefill_address)
        why = ""
        if prefix is None:
            try:
                info = await self._prefill_stub(prefill_address).GetInfo(
                    worker_pb2.InfoRequest(), timeout=max(0.1, min(10.0, deadline - time.perf_counter())))
                prefix = info.kv_segment_prefix
            except grpc.aio.AioRpcError as exc:
                prefix, why = "", f"GetInfo failed: {exc.code().name}: {exc.details()}"
            if not (prefix.startswith(SHM_PREFIX) and len(prefix) > len(SHM_PREFIX)):
                why, prefix = why or f"it reports no shared-memory segment prefix ({prefix!r})", ""
            self._segment_prefixes[prefill_address] = prefix
        if prefix:
            return backend, prefix
        if self.kv_backend == "auto":
            return "grpc", ""
        await failures.abort(context, WorkerUnavailable(
            f"prefill failed on {prefill_address}: cannot bind its shm segments: {why or 'no prefix'}", PREFILL))
        raise AssertionError("unreachable")  # context.abort raises

    def _backend_for(self, prefill_address: str) -> str:
        """The KV backend for one transfer: `auto` means CUDA IPC (our cache on CUDA) or shared memory
        when the prefill worker runs on this host (loopback or the same host name as ours), the gRPC
        stream otherwise (`kv_transfer.cuda_ipc_backend.choose_backend`)."""
        prefill_host = prefill_address.rsplit(":", 1)[0]
        same_host = prefill_host in LOCAL_HOSTS or prefill_host == self.address.rsplit(":", 1)[0]
        return choose_backend(self.kv_backend, same_host, self.worker.engine.kv_cache.device)

    def _prefill_stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        stub = self._prefill_stubs.get(address)
        if stub is None:
            stub = worker_pb2_grpc.PrefillWorkerStub(open_aio_channel(address))
            self._prefill_stubs[address] = stub
        return stub

    async def _stream(self, request_id: str, items: asyncio.Queue, context: grpc.aio.ServicerContext,
                      timings: common_pb2.Timings, start: float,
                      trace: list[common_pb2.TraceEvent] | None,
                      prefill_cached: int = 0) -> AsyncIterator[router_pb2.GenerateResponse]:
        first_at: float | None = None
        while True:
            item = await items.get()
            if item is _DEADLINE:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed while decoding")
            if isinstance(item, Suspended):  # live migration: another decode worker takes over
                yield router_pb2.GenerateResponse(request_id=request_id,
                                                  migration=router_pb2.MigrationMarker(suspended=True))
                return
            if isinstance(item, StreamError):
                kind = WorkerUnavailable if item.worker_failed else RequestFault
                await failures.abort(context, kind(f"decode worker {self.worker_id}: {item.message}", DECODE))
            first_at = first_at or time.perf_counter()
            response = self._response(request_id, item, timings, start, first_at, prefill_cached)
            if item.logprob is not None or item.prompt_logprobs is not None:
                _add_logprobs(response, item, self.worker.loaded.tokenizer)
            if trace is not None:
                tokenizer = self.worker.loaded.tokenizer
                response.trace.extend(trace + trace_events_to_pb(item.trace, self.worker_id, tokenizer))
                trace.clear()
            if item.finish_reason is not None:
                self.worker.metrics.detokenize_time.observe(item.detokenize_s)
            yield response
            if item.finish_reason is not None:
                return

    @staticmethod
    def _response(request_id: str, out: TokenOutput, timings: common_pb2.Timings, start: float,
                  first_at: float, prefill_cached: int = 0) -> router_pb2.GenerateResponse:
        response = router_pb2.GenerateResponse(request_id=request_id, text=out.text)
        if out.token_id >= 0:
            response.token_ids.append(out.token_id)
        if out.finish_reason is not None:
            response.finish_reason = finish_reason_to_pb(out.finish_reason)
            response.usage.prompt_tokens = out.num_prompt_tokens
            response.usage.completion_tokens = out.num_output_tokens
            # both are leading prefixes of the prompt: the longer one was not computed on one side
            response.usage.cached_tokens = min(max(out.num_cached_tokens, prefill_cached), out.num_prompt_tokens)
            now = time.perf_counter()
            response.timings.CopyFrom(timings)
            response.timings.decode_s = now - first_at
            response.timings.e2e_s = now - start
            response.timings.detokenize_s = out.detokenize_s
            if out.prefill_s and not timings.prefill_s:  # prefilled here (colocated, or a short prompt)
                response.timings.queue_s, response.timings.prefill_s = out.queue_s, out.prefill_s
        return response

    # ----- GetInfo / Abort -------------------------------------------------------------------
    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.WorkerInfo:  # noqa: N802
        s = self.worker.stats()
        role = common_pb2.WORKER_ROLE_COLOCATED if self.colocated else common_pb2.WORKER_ROLE_DECODE
        reason = self.unhealthy_reason()
        return common_pb2.WorkerInfo(
            worker_id=self.worker_id, role=role, address=self.address, pid=os.getpid(),
            queue_depth=s["queue_depth"], kv_blocks_used=s["kv_used"], kv_blocks_total=s["kv_total"],
            running_requests=s["running"], healthy=not reason, unhealthy_reason=reason, kv_address=self.kv_target,
            prefill_tokens_computed=s["prefill_tokens_computed"],
            kv_bytes_received=self.worker.kv_bytes_received, requests_finished=self.worker.requests_finished,
            prefix_cache_hit_blocks=s["prefix_cache_hit_blocks"], prefix_cache_blocks=s["prefix_cache_blocks"],
            max_running_requests=self.worker.engine.config.max_num_seqs,
            node_id=self.node_id, host=self.node_host,
            requests_migrated_in=self.worker.requests_migrated_in,
            requests_migrated_out=self.worker.requests_migrated_out,
            kv_block_size=self.worker.engine.pool.block_size,
        )

    def Abort(self, request: worker_pb2.AbortRequest, context: grpc.ServicerContext) -> worker_pb2.AbortResponse:  # noqa: N802
        found = request.request_id in self.worker.engine.sequences
        self.worker.abort(request.request_id)
        self.worker.release_suspended(request.request_id)  # a migration given up
        return worker_pb2.AbortResponse(found=found)

    # ----- live migration, source side -------------------------------------------------------
    def SetKvTargets(self, request: worker_pb2.KvTargets,  # noqa: N802
                     context: grpc.ServicerContext) -> worker_pb2.KvTargetsAck:
        if not is_router_call(context.invocation_metadata()):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "only the router may set KV targets (router credential "
                                                             "missing or wrong)")
        targets = frozenset(t for t in request.targets if t)
        if targets != self._kv_targets:
            log.info("migration KV targets: %s", ", ".join(sorted(targets)) or "none")
        self._kv_targets = targets
        return worker_pb2.KvTargetsAck(num_targets=len(targets))

    async def Suspend(self, request: worker_pb2.SuspendRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> worker_pb2.SuspendResponse:
        try:
            seq = await asyncio.wrap_future(self.worker.suspend(request.request_id, hold_s=self.kv_timeout_s))
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except WorkerDead as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker_id}: {exc}")
        log.info("request_id=%s suspended for migration after %d output tokens", request.request_id,
                 len(seq.output_ids))
        return worker_pb2.SuspendResponse(num_output_tokens=len(seq.output_ids), num_cached_tokens=seq.num_cached)

    async def MigrateOut(self, request: worker_pb2.MigrateOutRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> worker_pb2.MigrateOutResponse:
        """Push a suspended request's K/V to a registered decode worker, then free it here."""
        if request.kv_target_address not in self._kv_targets:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"kv_target_address {request.kv_target_address!r} is not a decode worker registered "
                                f"with decode worker {self.worker_id}")
        backend = request.kv_backend or "grpc"
        try:
            seq = await asyncio.wrap_future(self.worker.suspended(request.request_id))
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {request.request_id} is not suspended here")
        num_tokens = seq.num_tokens - 1
        try:
            if backend not in ("grpc", "ray"):
                raise RequestInvalid(f"kv_backend: migration ships over grpc or ray, not {backend!r}")
            if request.num_tokens != num_tokens:
                raise RequestInvalid(f"num_tokens: this worker holds {num_tokens} tokens of K/V, "
                                     f"not {request.num_tokens}")
            try:  # what it refuses here is the request's: the target's id and block offset
                spec = KvSpec.for_cache(request.target_request_id, self.worker.loaded.fingerprint,
                                        self.worker.engine.kv_cache.shape, num_tokens, request.kv_block_offset)
            except ValueError as exc:
                raise RequestInvalid(str(exc)) from exc
            sender = get_backend(backend).sender_factory(request.kv_target_address)
        except RequestInvalid as exc:
            await failures.abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - not the request's fault: our bug, said as such
            log.error("request_id=%s: MigrateOut to %s failed: %s", request.request_id, request.kv_target_address,
                      exc, exc_info=exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"migrating KV to {request.kv_target_address}: {exc}")
        blocks = seq.block_table[spec.block_offset : blocks_for_tokens(num_tokens, self.worker.engine.pool.block_size)]
        started = time.perf_counter()
        try:  # the blocks are held (suspended): no step writes them while they are read here
            await asyncio.to_thread(sender.send_blocks, spec, self.worker.engine.kv_cache, blocks,
                                    seq.output_ids[-1], timeout_s=self.kv_timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported to the target, which fails over
            self.worker.release_suspended(request.request_id)
            self.worker.metrics.kv_failed(backend, "send")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"migrating KV to {request.kv_target_address}: {exc}")
        transfer_s = time.perf_counter() - started
        self.worker.release_suspended(request.request_id, migrated=True)
        self.worker.metrics.kv_transferred(backend, "send", spec.nbytes, transfer_s)
        log.info("request_id=%s migrated out to %s (%s): %d tokens, %d bytes in %.3fs", request.request_id,
                 request.target_worker_id, request.kv_target_address, num_tokens, spec.nbytes, transfer_s)
        return worker_pb2.MigrateOutResponse(kv_bytes=spec.nbytes, kv_transfer_s=transfer_s,
                                             last_token_id=seq.output_ids[-1])


def _pieces(tokenizer: Any, ids: set[int]) -> dict[int, str]:  # noqa: ANN401
    """Each token decoded alone, in one batched call (a long prompt's logprobs name thousands of
    tokens: one decode call each held the event loop for most of a second)."""
    ordered = sorted(ids)
    texts = tokenizer.batch_decode([[t] for t in ordered], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    return dict(zip(ordered, texts, strict=True))


def _logprob_pb(entry: TokenLogprob, pieces: dict[int, str]) -> common_pb2.TokenLogprob:
    pb = common_pb2.TokenLogprob(token_id=entry.token_id, token=pieces[entry.token_id])
    if entry.logprob is not None:
        pb.logprob = entry.logprob
    pb.top.extend(common_pb2.TopLogprob(token_id=t, logprob=v, token=pieces[t]) for t, v in entry.top)
    return pb


def _add_logprobs(response: router_pb2.GenerateResponse, out: TokenOutput, tokenizer: Any) -> None:
    """The log-probabilities an engine output carries, with each token decoded alone."""
    entries = ([out.logprob] if out.logprob is not None else []) + list(out.prompt_logprobs or ())
    pieces = _pieces(tokenizer, {t for e in entries for t in (e.token_id, *(t for t, _ in e.top))})
    if out.logprob is not None:
        response.logprobs.append(_logprob_pb(out.logprob, pieces))
    if out.prompt_logprobs is not None:
        response.prompt_logprobs.extend(_logprob_pb(e, pieces) for e in out.prompt_logprobs)
