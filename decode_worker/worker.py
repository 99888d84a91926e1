"""The decode worker's core, independent of gRPC: the engine loop and per-request streams.

The engine is the same one a prefill worker runs (one scheduler and block pool for every role),
here without a KV connector: what it prefills (colocated, or a prompt under the local-prefill
threshold) it keeps decoding, and what it reserves it decodes once the K/V arrived. A step that
fails because of one sequence fails that sequence only (the engine isolates it); its stream gets
a StreamError.

Outputs reach the serving side through a sink per request (`open_stream`): the loop thread calls
it with each TokenOutput (or a StreamError), and the gRPC side's sink hands the item to its event
loop (`call_soon_threadsafe`); nothing polls. If the loop thread itself dies, `dead_reason` says
why, every open stream gets a StreamError with `worker_failed` (the router fails it over), every
pending call fails with `LoopDead`, and the worker reports itself unhealthy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop, LoopDead
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.llm_engine import BlockWriter, LLMEngine, PrefillLogprobs, TokenOutput
from pdserve.engine.metrics import WorkerMetrics
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import KvSpec

log = logging.getLogger(__name__)
T = TypeVar("T")


class AdmissionError(RuntimeError):
    """The KV pool cannot hold the request before its admission deadline, or the queue is full."""


#: The loop thread died: what `reserve`, `commit` and friends fail with then.
WorkerDead = LoopDead


@dataclass(frozen=True)
class StreamError:
    """Put on a request's stream when it ends abnormally. `worker_failed`: the worker itself broke
    (its loop died): the router should retry elsewhere. Otherwise the request broke its step."""

    message: str
    worker_failed: bool = False


@dataclass(frozen=True)
class Suspended:
    """Put on a request's stream when it stopped decoding here to move to another decode worker
    (live migration); every token it sampled here was put on the stream before."""

    num_output_tokens: int


#: Receives a request's outputs on the loop thread; must not block.
StreamSink = Callable[["TokenOutput | StreamError | Suspended"], None]


@dataclass
class _PendingReservation:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    resume_ids: list[int]
    deadline: float
    future: Future
    trace: bool = False


class DecodeWorker:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        admission_timeout_s: float = 30.0,
        max_waiting: int = 1024,
        metrics: WorkerMetrics | None = None,
        die_after_steps: int | None = None,
        step_delay_s: float = 0.0,
        kv_cache: KVCache | None = None,
    ) -> None:
        """`step_delay_s`: testing only, a sleep before each step (slows a tiny model's streams)."""
        self.loaded = loaded
        self.step_delay_s = step_delay_s
        self.engine = LLMEngine(loaded, config, kv_cache=kv_cache)
        self.admission_timeout_s = admission_timeout_s
        self.max_waiting = max_waiting
        self._streams: dict[str, StreamSink] = {}
        self._reservations: list[_PendingReservation] = []
        self._counter_lock = threading.Lock()
        self.kv_bytes_received = 0
        self.requests_finished = 0
        self.requests_migrated_in = 0
        self.requests_migrated_out = 0
        self._suspended: dict[str, Sequence] = {}  # live migration: request id -> its held sequence (loop thread)
        self.metrics = metrics or WorkerMetrics()
        self.metrics.bind_gauges(
            running=lambda: len(self.engine.scheduler.running),
            waiting=lambda: self.queue_depth,
            blocks_used=lambda: self.engine.pool.num_used,
            blocks_total=lambda: self.engine.pool.num_blocks,
        )
        self.loop = EngineLoop(
            "decode-loop",
            self._iteration,
            lambda: self.engine.has_work or bool(self._reservations),
            die_after_iterations=die_after_steps,
        )
        self.loop.on_death = self._on_loop_death
        self.loop.start()

    @property
    def dead_reason(self) -> str:
        """Why the engine loop died ("" while it runs)."""
        return self.loop.dead_reason

    # ----- called from gRPC threads ----------------------------------------------------------
    def run_on_loop(self, fn: Callable[[], T]) -> Future:
        """Run `fn` on the loop thread; the future carries its result or exception."""
        return self.loop.call(fn)

    def open_stream(self, request_id: str, sink: StreamSink) -> None:
        """Send `request_id`'s outputs to `sink` (called on the loop thread) until close_stream."""
        self._streams[request_id] = sink
        if self.dead_reason:
            sink(StreamError(self.dead_reason, worker_failed=True))

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def add_local(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, resume_ids: list[int], trace: bool = False
    ) -> Future:
        """Prefill and decode here (colocated, or a prompt under the local-prefill threshold)."""
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return self.run_on_loop(
            lambda: self.engine.add_request(request_id, prompt_ids, params, resume_ids, trace=trace)
        )

    def reserve(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, resume_ids: list[int], trace: bool = False
    ) -> Future:
        """Hold blocks for a remote prefill; waits for room until the admission deadline."""
        future: Future = Future()
        pending = _PendingReservation(
            request_id, prompt_ids, params, resume_ids, time.monotonic() + self.admission_timeout_s, future, trace
        )
        self.loop.track(future)
        self.loop.post(lambda: self._try_reserve(pending, first=True))
        return future

    def commit(
        self,
        request_id: str,
        kv: torch.Tensor | BlockWriter,
        first_token: int,
        backend: str = "grpc",
        nbytes: int | None = None,
        logprobs: PrefillLogprobs | None = None,
    ) -> Future:
        """The prompt's KV arrived (through `backend`): a tensor to copy into the reserved blocks, or a
        writer that copies it there from shared memory (`nbytes` then says how much). Start decoding
        (`first_token` goes out with the prefill side's `logprobs`)."""
        self._count_received(kv, backend, nbytes)
        return self.run_on_loop(lambda: self._commit(request_id, kv, first_token, logprobs))

    def store(
        self, request_id: str, kv: torch.Tensor | BlockWriter, backend: str = "grpc", nbytes: int | None = None
    ) -> Future:
        """The first half of `commit`: the K/V into the reserved blocks, nothing emitted yet (an
        in-place intake whose first token must wait for the prefill worker's answer)."""
        self._count_received(kv, backend, nbytes)
        return self.run_on_loop(lambda: self.engine.store_prefilled(self._reserved(request_id), kv))

    def start(self, request_id: str, first_token: int, logprobs: PrefillLogprobs | None = None) -> Future:
        """The second half of `commit`: a stored request emits its first token and decodes."""
        return self.run_on_loop(
            lambda: self._emit(self.engine.start_decoding(self._reserved(request_id), first_token, logprobs))
        )

    def _count_received(self, kv: torch.Tensor | BlockWriter, backend: str, nbytes: int | None) -> None:
        size = kv.numel() * kv.element_size() if isinstance(kv, torch.Tensor) else int(nbytes or 0)
        with self._counter_lock:  # gRPC threads commit concurrently
            self.kv_bytes_received += size
        self.metrics.kv_transferred(backend, "receive", size, None)

    def abort(self, request_id: str) -> None:
        """End the request wherever it is; its blocks are freed. Safe to call more than once. A
        suspended request (live migration) is left alone: `release_suspended` frees it."""
        self.loop.post(lambda: self._abort(request_id))

    # ----- live migration ----------------------------------------------------------------------
    def suspend(self, request_id: str, hold_s: float) -> Future:
        """Stop decoding `request_id` between two steps and hold its blocks for `hold_s` seconds (or
        until `release_suspended`); its stream gets a `Suspended` after its last token. The future
        yields the sequence; KeyError if unknown, ValueError if it is not decoding."""
        future = self.run_on_loop(lambda: self._suspend(request_id))

        def expire(_future: Future) -> None:
            if not _future.exception():
                timer = threading.Timer(hold_s, lambda: self.release_suspended(request_id))
                timer.daemon = True
                timer.start()

        future.add_done_callback(expire)
        return future

    def suspended(self, request_id: str) -> Future:
        """The suspended sequence of `request_id` (KeyError if none, e.g. its hold expired)."""
        return self.run_on_loop(lambda: self._suspended[request_id])

    def release_suspended(self, request_id: str, migrated: bool = False) -> None:
        """Free a suspended request's blocks (its K/V left, or the migration was given up)."""

        def release() -> None:
            seq = self._suspended.pop(request_id, None)
            if seq is not None:
                self.engine.release_handoff(seq)
                if migrated:
                    self.requests_migrated_out += 1

        self.loop.post(release)

    def commit_migrated(self, request_id: str, kv: torch.Tensor, nbytes: int, block_offset: int) -> Future:
        """Live migration, target side: the K/V of every token but the last arrived; decode on."""
        with self._counter_lock:
            self.kv_bytes_received += nbytes
        self.metrics.kv_transferred("migrate", "receive", nbytes, None)

        def commit() -> None:
            seq = self.engine.sequences.get(request_id)
            if seq is None:
                raise KeyError(f"request {request_id} has no reservation (aborted?)")
            self.engine.commit_migrated(seq, kv, block_offset)
            self.requests_migrated_in += 1

        return self.run_on_loop(commit)

    def expected_spec(self, request_id: str, num_tokens: int, block_offset: int = 0) -> KvSpec:
        """The payload for `num_tokens` tokens of which the first `block_offset` blocks are held here."""
        return KvSpec.for_cache(
            request_id, self.loaded.fingerprint, self.engine.kv_cache.shape, num_tokens, block_offset
        )

    def idle(self) -> bool:
        """No request open here, none held for a migration (used to finish draining)."""
        return not self._streams and not self.engine.sequences and not self._suspended

    def stop(self) -> None:
        self.loop.stop()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for blocks, or for their prompt to be (fully) prefilled here."""
        scheduler = self.engine.scheduler
        return len(self._reservations) + len(scheduler.waiting) + len(scheduler.prefilling)

    def stats(self) -> dict[str, Any]:
        e = self.engine
        return {
            "queue_depth": self.queue_depth,
            "running": len(e.sequences),
            "kv_used": e.pool.num_used,
            "kv_total": e.pool.num_blocks,
            "prefill_tokens_computed": e.runner.num_prefill_tokens,
            "prefix_cache_hit_blocks": e.pool.cache_hits,
            "prefix_cache_blocks": e.pool.num_cached,
        }

    # ----- loop thread ------------------------------------------------------------------------
    def _iteration(self) -> None:
        self._retry_reservations()
        if self.engine.has_work:
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine isolates failing sequences; this is a bug in it
            log.exception("decode step failed")
            for request_id in list(self.engine.sequences):
                self._fail(request_id, f"decode step failed: {exc}")
            return
        generated = sum(1 for out in outputs if out.token_id >= 0)
        if generated:
            self.metrics.decode_batch_size.observe(generated)
        for out in outputs:
            if out.error is not None:  # its pass failed with it alone: the others went on
                self._fail(out.request_id, f"decode step failed: {out.error}")
            else:
                self._emit(out)

    def _emit(self, out: TokenOutput) -> None:
        if out.token_id >= 0:
            self.metrics.generation_tokens.inc()
        sink = self._streams.get(out.request_id)
        if sink is not None:
            sink(out)
        if out.finish_reason is not None:
            self.requests_finished += 1

    def _try_reserve(self, pending: _PendingReservation, first: bool) -> bool:
        """Reserve now, or park the request; True when it left the parking list."""
        if pending.future.cancelled():
            return True
        try:
            seq = self.engine.reserve(
                pending.request_id, pending.prompt_ids, pending.params, pending.resume_ids, trace=pending.trace
            )
        except ValueError as exc:
            pending.future.set_exception(exc)
            return True
        if seq is not None:
            if not pending.future.set_running_or_notify_cancel():  # the caller gave up meanwhile
                self.engine.abort(pending.request_id)
            else:
                pending.future.set_result(seq)
            return True
        if time.monotonic() > pending.deadline:
            pending.future.set_exception(
                AdmissionError(
                    f"KV pool full: {self.engine.pool.num_free} of {self.engine.pool.num_blocks} blocks free, "
                    f"request needs {blocks_for_tokens(len(pending.prompt_ids) + 1, self.engine.pool.block_size)}"
                )
            )
            return True
        if first:
            if len(self._reservations) >= self.max_waiting:
                pending.future.set_exception(AdmissionError(f"admission queue full ({self.max_waiting})"))
                return True
            self._reservations.append(pending)
        return False

    def _retry_reservations(self) -> None:
        self._reservations = [p for p in self._reservations if not self._try_reserve(p, first=False)]

    def _reserved(self, request_id: str) -> Sequence:
        seq: Sequence | None = self.engine.sequences.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id} has no reservation (aborted?)")
        return seq

    def _commit(
        self, request_id: str, kv: torch.Tensor | BlockWriter, first_token: int, logprobs: PrefillLogprobs | None
    ) -> None:
        self._emit(self.engine.commit_prefilled(self._reserved(request_id), kv, first_token, logprobs))

    def _suspend(self, request_id: str) -> Sequence:
        seq = self.engine.sequences.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id} is not on this worker (finished?)")
        if seq.num_cached != seq.num_tokens - 1:
            raise ValueError(f"request {request_id} is not decoding (status {seq.status.value})")
        self.engine.suspend(request_id)
        self._suspended[request_id] = seq
        sink = self._streams.get(request_id)
        if sink is not None:
            sink(Suspended(len(seq.output_ids)))
        return seq

    def _abort(self, request_id: str) -> None:
        for pending in self._reservations:
            if pending.request_id == request_id:
                pending.future.cancel()
        self.engine.abort(request_id)

    def _fail(self, request_id: str, message: str) -> None:
        self.engine.abort(request_id)
        sink = self._streams.get(request_id)
        if sink is not None:
            sink(StreamError(message))

    def _on_loop_death(self, reason: str) -> None:
        for sink in list(self._streams.values()):
            sink(StreamError(reason, worker_failed=True))
