"""The prefill worker's core, independent of gRPC: a queue, a batching loop, a transfer pool."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.block_pool import BlockPool, block_hashes, blocks_for_tokens
from engine.config import EngineConfig
from engine.llm_engine import build_cache
from engine.metrics import WorkerMetrics
from engine.model_loader import LoadedModel
from engine.model_runner import StepInput
from engine.runners import build_runner
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from kv_transfer import KvSpec, get_backend
from kv_transfer.base import KvSender
from prefill_worker.faults import FaultInjector
from prefill_worker.layer_stream import LayerStream

log = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    kv_target: str
    kv_backend: str = "grpc"
    output_index: int = 0  # output position of the token sampled here (> 0 for resumed requests)
    kv_block_offset: int = 0  # leading blocks the decode worker already holds: not shipped
    enqueued_at: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)
    # set on admission (loop thread)
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # prefix hash of each full block of the prompt
    num_computed: int = 0  # prompt tokens whose K/V are in `blocks`
    started_at: float = 0.0


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    kv_bytes: int


class PrefillWorker:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, transfer_timeout_s: float = 60.0,
                 max_queue: int = 1024, metrics: WorkerMetrics | None = None,
                 faults: FaultInjector | None = None, prefill_chunk_tokens: int | None = None,
                 prefix_caching: bool = False, kv_streaming: str = "request", shared_kv_cache: bool = False) -> None:
        self.loaded = loaded
        self.config = config
        # in shared memory, same-host decode workers copy blocks straight out of it ("shm" backend)
        self.kv_cache = build_cache(loaded, config, shared=shared_kv_cache)
        self.pool = BlockPool(self.kv_cache.num_blocks, config.block_size)
        self.runner = build_runner(loaded, self.kv_cache)
        self.transfer_timeout_s = transfer_timeout_s
        self.max_queue = max_queue
        self.faults = faults or FaultInjector(None, 0)
        self._queue: deque[PrefillJob] = deque()
        self._active: list[PrefillJob] = []  # admitted, prompt partly computed (chunked prefill)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefix_caching = prefix_caching
        if kv_streaming not in ("request", "layer"):
            raise ValueError(f"kv_streaming must be 'request' or 'layer', got {kv_streaming!r}")
        self.kv_streaming = kv_streaming
        self._cond = threading.Condition()
        self._transfers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-send")
        self._stopped = False
        self.kv_bytes_sent = 0
        self.requests_finished = 0
        self.metrics = metrics or WorkerMetrics()
        self.metrics.bind_gauges(running=lambda: 0, waiting=lambda: len(self._queue),
                                 blocks_used=lambda: self.pool.num_used, blocks_total=lambda: self.pool.num_blocks)
        self._thread = threading.Thread(target=self._loop, name="prefill-loop", daemon=True)
        self._thread.start()

    # ----- public, thread-safe ---------------------------------------------------------------
    def submit(self, job: PrefillJob) -> Future:
        """Queue a prompt; the future yields a PrefillResult once the decode side holds the KV."""
        if len(job.prompt_ids) > self.pool.num_blocks * self.pool.block_size:
            raise ValueError(f"prompt of {len(job.prompt_ids)} tokens does not fit this worker's KV pool")
        num_blocks = blocks_for_tokens(len(job.prompt_ids), self.pool.block_size)
        if not 0 <= job.kv_block_offset < num_blocks:
            raise ValueError(f"kv_block_offset: must be in [0, {num_blocks}) for a prompt of "
                             f"{len(job.prompt_ids)} tokens, got {job.kv_block_offset}")
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise OverflowError(f"prefill queue is full ({self.max_queue} requests)")
            self._queue.append(job)
            self._cond.notify()
        return job.future

    @property
    def queue_depth(self) -> int:
        """Requests waiting or being prefilled here."""
        return len(self._queue) + len(self._active)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute here."""
        pending = list(self._queue) + list(self._active)
        return sum(len(j.prompt_ids) - j.num_computed for j in pending)

    def idle(self) -> bool:
        """Nothing queued, computing or being shipped (used to finish draining)."""
        return not self._queue and not self._active and self.pool.num_used == 0

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._transfers.shutdown(wait=True, cancel_futures=True)

    # ----- loop thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            step = self._next_step()
            if step is None:
                return
            try:
                self._prefill(step)
            except Exception as exc:  # a failing pass fails its requests, not the worker
                log.exception("prefill pass failed")
                for job, _ in step:
                    self._active.remove(job)
                    self._release(job.blocks)
                    job.future.set_exception(exc)

    def _next_step(self) -> list[tuple[PrefillJob, int]] | None:
        """Wait for work; admit queued jobs (blocks allocated, cached prefix reused) and pick the
        tokens of this pass: each active job gets at most `prefill_chunk_tokens`, FIFO, within the
        token budget. Returns (job, number of new tokens) pairs."""
        with self._cond:
            while True:
                if self._stopped:
                    return None
                self._admit()
                step = self._plan_step()
                if step:
                    return step
                self._cond.wait(timeout=0.5)

    def _admit(self) -> None:
        while self._queue:
            job = self._queue[0]
            hashes = block_hashes(job.prompt_ids, self.pool.block_size) if self.prefix_caching else []
            needed = blocks_for_tokens(len(job.prompt_ids), self.pool.block_size)
            if not job.future.cancelled() and not self.pool.can_allocate(needed):
                return
            self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            hits = self.pool.lookup(hashes[: (len(job.prompt_ids) - 1) // self.pool.block_size])
            job.blocks = hits + self.pool.allocate(needed - len(hits))
            job.hashes = hashes
            job.num_computed = len(hits) * self.pool.block_size
            job.started_at = time.perf_counter()
            self.metrics.queue_time.observe(max(0.0, job.started_at - job.enqueued_at))
            self._active.append(job)

    def _plan_step(self) -> list[tuple[PrefillJob, int]]:
        step, budget = [], self.config.max_num_batched_tokens
        chunk = self.prefill_chunk_tokens or budget
        for job in self._active:
            n = min(len(job.prompt_ids) - job.num_computed, chunk, budget)
            if n <= 0:
                break
            step.append((job, n))
            budget -= n
        return step

    def _prefill(self, step: list[tuple[PrefillJob, int]]) -> None:
        start = time.perf_counter()
        items = [StepInput(j.prompt_ids[j.num_computed : j.num_computed + n], j.num_computed, j.blocks)
                 for j, n in step]
        streams = self._open_layer_streams(step)
        try:
            logits = self.runner.forward(items, on_layer_done=self._layer_callback(streams) if streams else None)
        except BaseException as exc:
            for stream in streams.values():
                stream.fail(exc)
            raise
        done = []
        for row, (job, n) in enumerate(step):
            job.num_computed += n
            self._register_full_blocks(job)
            if job.num_computed == len(job.prompt_ids):
                done.append((row, job))
        self._observe_step(step, start)
        if not done:
            return
        first = sample(logits[[row for row, _ in done]], [j.params for _, j in done],
                       [j.output_index for _, j in done])
        now = time.perf_counter()
        for (_, job), token in zip(done, first, strict=True):
            with self._cond:
                self._active.remove(job)
            if job.request_id in streams:
                streams[job.request_id].finish(token)
            else:
                self._transfers.submit(self._ship, job, job.blocks, token, job.started_at - job.enqueued_at,
                                       now - job.started_at)

    # ----- layer-wise streaming (loop thread side) -----------------------------------------------
    def _open_layer_streams(self, step: list[tuple[PrefillJob, int]]) -> dict[str, LayerStream]:
        """Start a layer-wise transfer for each job this pass completes whose backend can stream layers
        (`--kv-streaming layer`); the others ship after the pass, as with `request`."""
        streams: dict[str, LayerStream] = {}
        if self.kv_streaming != "layer":
            return streams
        for job, n in step:
            if job.num_computed + n == len(job.prompt_ids) and self._can_stream_layers(job):
                spec = self.spec_for(job)
                stream = LayerStream(torch.empty(spec.shape, dtype=spec.torch_dtype), self.transfer_timeout_s)
                streams[job.request_id] = stream
                self._transfers.submit(self._ship_layers, job, spec, stream)
        return streams

    def _layer_callback(self, streams: dict[str, LayerStream]) -> Callable[[int], None]:
        jobs = [j for j in self._active if j.request_id in streams]

        def on_layer_done(layer: int) -> None:
            for job in jobs:
                stream = streams[job.request_id]
                # [2, n, block, heads, dim]
                stream.buffer[layer] = self.kv_cache.kv[layer, :, job.blocks[job.kv_block_offset :]]
                stream.layer_done(layer)

        return on_layer_done

    def _ship_layers(self, job: PrefillJob, spec: KvSpec, stream: LayerStream) -> None:
        """Transfer thread: stream frames as layers land, then answer with the first token."""
        start = time.perf_counter()
        try:
            self._sender(job).send_layers(spec, stream, timeout_s=self.transfer_timeout_s)
            token = stream.first_token()
        except Exception as exc:
            self._fail_transfer(job, exc)
            return
        finally:
            self._release(job.blocks)
        self._finish_job(job, spec, token, start, time.perf_counter() - job.started_at)

    def _register_full_blocks(self, job: PrefillJob) -> None:
        with self._cond:
            for index in range(min(len(job.hashes), job.num_computed // self.pool.block_size)):
                self.pool.cache_block(job.blocks[index], job.hashes[index])

    def _observe_step(self, step: list[tuple[PrefillJob, int]], start: float) -> None:
        self.metrics.prefill_batch_size.observe(len(step))
        self.metrics.prompt_tokens.inc(sum(n for _, n in step))


    # ----- transfer threads -------------------------------------------------------------------
    def spec_for(self, job: PrefillJob) -> KvSpec:
        """What this job ships: its prompt's blocks from `kv_block_offset` on."""
        return KvSpec.for_cache(job.request_id, self.loaded.fingerprint, self.kv_cache.shape, len(job.prompt_ids),
                                job.kv_block_offset)

    def _ship(self, job: PrefillJob, blocks: list[int], token: int, queue_s: float, prefill_s: float) -> None:
        start = time.perf_counter()
        try:
            spec = self.spec_for(job)
            shipped = blocks[job.kv_block_offset :]
            sender = self._sender(job)
            fault = self.faults.next_filter()
            if fault is None:
                sender.send_blocks(spec, self.kv_cache, shipped, token, timeout_s=self.transfer_timeout_s)
            else:
                log.warning("request_id=%s: injecting a KV fault (%s)", job.request_id, fault.__name__)
                sender.send(spec, self.kv_cache.gather(shipped), token, timeout_s=self.transfer_timeout_s,
                            frame_filter=fault)  # type: ignore[call-arg]
        except Exception as exc:
            self._fail_transfer(job, exc)
            return
        finally:
            self._release(blocks)
        self._finish_job(job, spec, token, start, prefill_s)

    def _can_stream_layers(self, job: PrefillJob) -> bool:
        try:
            return self._sender(job).supports_layer_streaming
        except Exception:  # noqa: BLE001 - a bad backend or target fails the job in `_ship`, not the pass
            return False

    @staticmethod
    def _sender(job: PrefillJob) -> KvSender:
        return get_backend(job.kv_backend).sender_factory(job.kv_target)

    def _fail_transfer(self, job: PrefillJob, exc: Exception) -> None:
        """The KV did not reach the decode side: count it and fail the Prefill call (blocks are freed
        by the caller's `finally`)."""
        log.warning("request_id=%s: KV transfer to %s failed: %s", job.request_id, job.kv_target, exc)
        self.metrics.kv_failed(job.kv_backend, "send")
        job.future.set_exception(exc)

    def _finish_job(self, job: PrefillJob, spec: KvSpec, token: int, transfer_start: float, prefill_s: float) -> None:
        """The decode side acknowledged the KV: account it and answer the Prefill call."""
        with self._cond:  # transfer threads finish concurrently: keep the counters exact
            self.kv_bytes_sent += spec.nbytes
            self.requests_finished += 1
        transfer_s = time.perf_counter() - transfer_start
        self.metrics.kv_transferred(job.kv_backend, "send", spec.nbytes, transfer_s)
        queue_s = job.started_at - job.enqueued_at
        job.future.set_result(PrefillResult(token, queue_s, prefill_s, transfer_s, spec.nbytes))

    def _release(self, blocks: list[int]) -> None:
        with self._cond:
            self.pool.free(blocks)
            self._cond.notify()

