"""The prefill worker's core, independent of gRPC: the shared engine in its prefill role, plus the
KV hand-off.

The engine (`engine.llm_engine`) queues, admits, chunks and computes prompts with the same
scheduler, block pool and prefix cache as a decode or colocated worker. This worker is its
`KvConnector`: once a prompt's K/V are complete and its first token sampled, a transfer thread
ships the blocks to the decode worker that asked; with `--kv-streaming layer` the frames leave
while the pass that completes the prompt still runs.

Threads: gRPC threads call `submit`; one loop thread (`EngineLoop`) owns the engine; transfer
threads ship. Blocks are freed only by the engine on the loop thread: a transfer thread, when its
transfer ended (acknowledged or failed), posts `release_handoff` for that very sequence, which is a
no-op if the engine already ended it (a failed pass), so no block is ever freed twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import count

import torch

from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_connector import KvConnector
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.metrics import WorkerMetrics
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.model_runner import LayerCallback
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.trace import TraceEvent
from pdserve.failures import RequestInvalid
from pdserve.kv_transfer import KvSpec, get_backend
from pdserve.kv_transfer.base import KvSender, check_request_id
from pdserve.prefill_worker.faults import FaultInjector
from pdserve.prefill_worker.layer_stream import LayerStream

log = logging.getLogger(__name__)

KV_STREAMING_MODES = ("request", "layer")


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    kv_target: str
    kv_backend: str = "grpc"
    output_index: int = 0  # output position of the token sampled here (> 0 for resumed requests)
    kv_block_offset: int = 0  # leading blocks the decode worker already holds: not shipped
    trace: bool = False  # collect the step trace of its passes (engine.trace)
    kv_checksum: str = ""  # checksum algorithm the decode worker asked for ("": none; shm backend)
    enqueued_at: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)
    # set on the loop thread
    seq: Sequence | None = None  # its sequence in the engine, once queued there
    prefill_s: float = 0.0  # admission -> first token
    trace_events: tuple[TraceEvent, ...] = ()  # its prefill passes, when traced


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    kv_bytes: int
    trace: tuple[TraceEvent, ...] = ()  # the prefill passes (PrefillJob.trace)
    cached_tokens: int = 0  # prompt tokens taken from this worker's prefix cache


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> None:
    """Complete `future` unless the caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class PrefillWorker(KvConnector):
    def __init__(self, loaded: LoadedModel, config: EngineConfig, transfer_timeout_s: float = 60.0,
                 max_queue: int = 1024, metrics: WorkerMetrics | None = None,
                 faults: FaultInjector | None = None, prefill_chunk_tokens: int | None = None,
                 prefix_caching: bool = False, kv_streaming: str = "request", shared_kv_cache: bool = False,
                 kv_cache: KVCache | None = None) -> None:
        if kv_streaming not in KV_STREAMING_MODES:
            raise ValueError(f"kv_streaming must be one of {KV_STREAMING_MODES}, got {kv_streaming!r}")
        self.loaded = loaded
        self.config = replace(config, prefix_caching=prefix_caching or config.prefix_caching,
                              prefill_chunk_tokens=prefill_chunk_tokens or config.prefill_chunk_tokens)
        # in shared memory, same-host decode workers copy blocks straight out of it ("shm" backend)
        self.engine = LLMEngine(loaded, self.config, connector=self, shared_kv_cache=shared_kv_cache,
                                kv_cache=kv_cache)
        self.transfer_timeout_s = transfer_timeout_s
        self.max_queue = max_queue
        self.faults = faults or FaultInjector(None, 0)
        self.kv_streaming = kv_streaming
        self._jobs: dict[str, PrefillJob] = {}  # engine key -> job, until its blocks are released (loop thread)
        self._streams: dict[str, LayerStream] = {}  # engine key -> layer stream of the pass running (loop thread)
        self._keys = count()
        self._lock = threading.Lock()  # guards the counters below (gRPC and transfer threads)
        self._incoming_jobs = 0  # submitted, not yet in the engine
        self._incoming_tokens = 0
        self.kv_bytes_sent = 0
        self.requests_finished = 0
        self._transfers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-send")
        self.metrics = metrics or WorkerMetrics()
        self.metrics.bind_gauges(running=lambda: 0, waiting=lambda: self.queue_depth,
                                 blocks_used=lambda: self.pool.num_used, blocks_total=lambda: self.pool.num_blocks)
        self.loop = EngineLoop("prefill-loop", self._step, lambda: self.engine.has_work)
        self.loop.start()

    # ----- public, thread-safe ---------------------------------------------------------------
    @property
    def pool(self):  # noqa: ANN201 - the engine's BlockPool
        return self.engine.pool

    @property
    def runner(self):  # noqa: ANN201 - the engine's ModelRunner
        return self.engine.runner

    @property
    def kv_cache(self):  # noqa: ANN201 - the engine's KVCache
        return self.engine.kv_cache

    def submit(self, job: PrefillJob) -> Future:
        """Queue a prompt; the future yields a PrefillResult once the decode side holds the KV.
        Cancelling the future drops the job wherever it is (a transfer under way runs to its end)."""
        self._check(job)
        with self._lock:
            if self.queue_depth >= self.max_queue:
                raise OverflowError(f"prefill queue is full ({self.max_queue} requests)")
            self._incoming_jobs += 1
            self._incoming_tokens += len(job.prompt_ids)
        self.loop.post(lambda: self._enqueue(job))
        job.future.add_done_callback(lambda f: self.loop.post(lambda: self._cancel(job)) if f.cancelled() else None)
        return job.future

    def _check(self, job: PrefillJob) -> None:
        """Refuse (RequestInvalid) what would only fail after the prefill: an id no KV transfer can carry,
        an unknown backend, token ids outside the vocabulary, a prompt the pool cannot hold, a block
        offset outside the prompt."""
        try:  # kv_transfer's own checks, of fields the request chose
            check_request_id(job.request_id)
            get_backend(job.kv_backend)
        except ValueError as exc:
            raise RequestInvalid(str(exc)) from exc
        self.engine.check_request(job.prompt_ids)
        self.engine.check_fits_pool(len(job.prompt_ids))
        num_blocks = blocks_for_tokens(len(job.prompt_ids), self.pool.block_size)
        if not 0 <= job.kv_block_offset < num_blocks:
            raise RequestInvalid(f"kv_block_offset: must be in [0, {num_blocks}) for a prompt of "
                             f"{len(job.prompt_ids)} tokens, got {job.kv_block_offset}")

    def loop_alive(self) -> bool:
        """False once the loop thread died (not after a clean stop)."""
        return not self.loop.dead_reason

    @property
    def queue_depth(self) -> int:
        """Requests waiting or being prefilled here."""
        scheduler = self.engine.scheduler
        return self._incoming_jobs + len(scheduler.waiting) + len(scheduler.prefilling)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute here."""
        return self._incoming_tokens + self.engine.scheduler.pending_prefill_tokens()

    def idle(self) -> bool:
        """Nothing queued, computing or being shipped (used to finish draining)."""
        return not self._incoming_jobs and not self._jobs and self.pool.num_used == 0

    def stop(self) -> None:
        self.loop.stop()
        self._transfers.shutdown(wait=True, cancel_futures=True)

    # ----- loop thread ------------------------------------------------------------------------
    def _enqueue(self, job: PrefillJob) -> None:
        with self._lock:
            self._incoming_jobs -= 1
            self._incoming_tokens -= len(job.prompt_ids)
        if job.future.cancelled():
            return
        key = job.request_id if job.request_id not in self.engine.sequences else f"{job.request_id}#{next(self._keys)}"
        try:
            job.seq = self.engine.add_request(key, job.prompt_ids, job.params, output_index=job.output_index,
                                              trace=job.trace)
        except ValueError as exc:
            _settle(job.future, error=exc)
            return
        self._jobs[key] = job

    def _cancel(self, job: PrefillJob) -> None:
        """The caller gave up: drop the job (a handed-off one ends when its transfer does)."""
        if job.seq is not None and self._jobs.get(job.seq.request_id) is job:
            self.engine.abort(job.seq.request_id)
            if job.seq.request_id not in self.engine.sequences:
                del self._jobs[job.seq.request_id]

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine isolates failing sequences; this is a bug in it
            log.exception("prefill step failed")
            self._fail_all(exc)
            return
        self._observe_pass()
        for out in outputs:  # a prefill engine hands every first token off: only failures come back
            job = self._jobs.pop(out.request_id, None)
            if job is not None:
                _settle(job.future, error=RuntimeError(out.error or out.finish_reason))

    def _fail_all(self, exc: Exception) -> None:
        """A step raised outside the engine's isolation: fail every job still computing."""
        for stream in self._streams.values():
            stream.fail(exc)
        self._streams.clear()
        for key, job in list(self._jobs.items()):
            if job.seq is not None and job.seq.status is not SequenceStatus.HANDED_OFF:
                self.engine.abort(key)
                del self._jobs[key]
                _settle(job.future, error=exc)

    def _observe_pass(self) -> None:
        planned = self.engine.last_pass
        if planned is not None and planned.num_prefill_seqs:
            self.metrics.prefill_batch_size.observe(planned.num_prefill_seqs)
            self.metrics.prompt_tokens.inc(planned.num_prefill_tokens)

    def _release(self, job: PrefillJob, seq: Sequence) -> None:
        """The transfer of `seq` ended: its blocks go back to the pool (cached ones stay reusable)."""
        self.engine.release_handoff(seq)
        if self._jobs.get(seq.request_id) is job:
            del self._jobs[seq.request_id]

    # ----- KvConnector (loop thread, inside engine.step) ----------------------------------------
    def layer_hook(self, completing: list[Sequence]) -> LayerCallback | None:
        """Start a layer-wise transfer for each prompt this pass completes whose backend can stream
        layers (`--kv-streaming layer`); the others ship after the pass, as with `request`."""
        if self.kv_streaming != "layer":
            return None
        streaming = []
        for seq in completing:
            job = self._jobs[seq.request_id]
            if self._can_stream_layers(job):
                spec = self.spec_for(job)
                stream = LayerStream(torch.empty(spec.shape, dtype=spec.torch_dtype), self.transfer_timeout_s)
                self._streams[seq.request_id] = stream
                self._transfers.submit(self._transfer, job, seq, partial(self._send_layers, job, spec, stream))
                streaming.append((stream, seq.block_table[job.kv_block_offset :]))
        if not streaming:
            return None

        def on_layer_done(layer: int) -> None:
            for stream, blocks in streaming:
                stream.buffer[layer] = self.kv_cache.kv[layer, :, blocks]  # [2, n, block, heads, dim]
                stream.layer_done(layer)

        return on_layer_done

    def pass_failed(self, completing: list[Sequence], error: Exception) -> list[Sequence]:
        """Streams of the failed pass carry partial K/V: fail them; the engine fails their sequences."""
        lost = []
        for seq in completing:
            stream = self._streams.pop(seq.request_id, None)
            if stream is not None:
                stream.fail(error)
                lost.append(seq)
        return lost

    def prefill_done(self, seq: Sequence, first_token: int) -> None:
        job = self._jobs[seq.request_id]
        started = seq.scheduled_time or job.enqueued_at
        job.prefill_s = time.perf_counter() - started
        job.trace_events = seq.take_trace()
        self.metrics.queue_time.observe(max(0.0, started - job.enqueued_at))
        stream = self._streams.pop(seq.request_id, None)
        if stream is not None:
            stream.finish(first_token)  # its transfer thread is already sending
        else:
            shipped = list(seq.block_table[job.kv_block_offset :])
            self._transfers.submit(self._transfer, job, seq, partial(self._send_blocks, job, shipped, first_token))

    # ----- transfer threads -------------------------------------------------------------------
    def spec_for(self, job: PrefillJob) -> KvSpec:
        """What this job ships: its prompt's blocks from `kv_block_offset` on."""
        return KvSpec.for_cache(job.request_id, self.loaded.fingerprint, self.kv_cache.shape, len(job.prompt_ids),
                                job.kv_block_offset)

    def _transfer(self, job: PrefillJob, seq: Sequence, send: Callable[[], tuple[KvSpec, int]]) -> None:
        """Run `send` (it returns what it shipped and the first token), answer the Prefill call,
        and in every case have the loop thread release `seq`'s blocks. Frees nothing itself: if a
        failed pass already ended `seq` in the engine, the release is a no-op."""
        start = time.perf_counter()
        try:
            spec, token = send()
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            self._fail_transfer(job, exc)
        else:
            self._finish_job(job, spec, token, start)
        finally:
            self.loop.post(lambda: self._release(job, seq))

    def _send_blocks(self, job: PrefillJob, shipped: list[int], token: int) -> tuple[KvSpec, int]:
        """Ship the job's blocks once its pass is over (`--kv-streaming request`)."""
        spec = self.spec_for(job)
        sender = self._sender(job)
        fault = self.faults.next_filter()
        if fault is None:
            sender.send_blocks(spec, self.kv_cache, shipped, token, timeout_s=self.transfer_timeout_s,
                               checksum=job.kv_checksum)
        else:
            log.warning("request_id=%s: injecting a KV fault (%s)", job.request_id, fault.__name__)
            sender.send(spec, self.kv_cache.gather(shipped), token, timeout_s=self.transfer_timeout_s,
                        frame_filter=fault)  # type: ignore[call-arg]
        return spec, token

    def _send_layers(self, job: PrefillJob, spec: KvSpec, stream: LayerStream) -> tuple[KvSpec, int]:
        """Stream frames as the pass fills `stream` layer by layer, then take the first token."""
        self._sender(job).send_layers(spec, stream, timeout_s=self.transfer_timeout_s)
        return spec, stream.first_token()

    def _can_stream_layers(self, job: PrefillJob) -> bool:
        try:
            return self._sender(job).supports_layer_streaming
        except Exception:  # noqa: BLE001 - a bad backend or target fails the job in `_send_blocks`, not the pass
            return False

    @staticmethod
    def _sender(job: PrefillJob) -> KvSender:
        return get_backend(job.kv_backend).sender_factory(job.kv_target)

    def _fail_transfer(self, job: PrefillJob, exc: Exception) -> None:
        """The KV did not reach the decode side: count it and fail the Prefill call."""
        log.warning("request_id=%s: KV transfer to %s failed: %s", job.request_id, job.kv_target, exc)
        self.metrics.kv_failed(job.kv_backend, "send")
        _settle(job.future, error=exc)

    def _finish_job(self, job: PrefillJob, spec: KvSpec, token: int, transfer_start: float) -> None:
        """The decode side acknowledged the KV: account it and answer the Prefill call."""
        with self._lock:  # transfer threads finish concurrently: keep the counters exact
            self.kv_bytes_sent += spec.nbytes
            self.requests_finished += 1
        transfer_s = time.perf_counter() - transfer_start
        self.metrics.kv_transferred(job.kv_backend, "send", spec.nbytes, transfer_s)
        queue_s = max(0.0, (job.seq.scheduled_time or job.enqueued_at) - job.enqueued_at) if job.seq else 0.0
        cached = job.seq.num_prefix_hit_tokens if job.seq else 0
        _settle(job.future, PrefillResult(token, queue_s, job.prefill_s, transfer_s, spec.nbytes, job.trace_events,
                                          cached))
