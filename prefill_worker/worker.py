"""The prefill worker's core, independent of gRPC: a queue, a batching loop, a transfer pool."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.block_pool import BlockPool, blocks_for_tokens
from engine.config import EngineConfig
from engine.llm_engine import build_cache
from engine.metrics import WorkerMetrics
from engine.model_loader import LoadedModel
from engine.model_runner import ModelRunner, StepInput
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from kv_transfer import KvSpec, get_backend
from kv_transfer.base import dtype_name
from prefill_worker.faults import FaultInjector

log = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    kv_target: str
    kv_backend: str = "grpc"
    output_index: int = 0  # output position of the token sampled here (> 0 for resumed requests)
    enqueued_at: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)


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
                 faults: FaultInjector | None = None) -> None:
        self.loaded = loaded
        self.config = config
        self.kv_cache = build_cache(loaded, config)
        self.pool = BlockPool(self.kv_cache.num_blocks, config.block_size)
        self.runner = ModelRunner(loaded, self.kv_cache)
        self.transfer_timeout_s = transfer_timeout_s
        self.max_queue = max_queue
        self.faults = faults or FaultInjector(None, 0)
        self._queue: deque[PrefillJob] = deque()
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
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise OverflowError(f"prefill queue is full ({self.max_queue} requests)")
            self._queue.append(job)
            self._cond.notify()
        return job.future

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def queued_tokens(self) -> int:
        return sum(len(j.prompt_ids) for j in list(self._queue))

    def idle(self) -> bool:
        """Nothing queued, computing or being shipped (used to finish draining)."""
        return not self._queue and self.pool.num_used == 0

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._transfers.shutdown(wait=True, cancel_futures=True)

    # ----- loop thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._prefill(batch)
            except Exception as exc:  # a failing pass fails its requests, not the worker
                log.exception("prefill pass failed")
                for job, blocks in batch:
                    self._release(blocks)
                    job.future.set_exception(exc)

    def _next_batch(self) -> list[tuple[PrefillJob, list[int]]] | None:
        """Wait for jobs; take FIFO within the token budget and the free blocks; allocate them."""
        with self._cond:
            while True:
                if self._stopped:
                    return None
                batch = self._take_batch()
                if batch:
                    return batch
                self._cond.wait(timeout=0.5)

    def _take_batch(self) -> list[tuple[PrefillJob, list[int]]]:
        batch: list[tuple[PrefillJob, list[int]]] = []
        budget = self.config.max_num_batched_tokens
        while self._queue:
            job = self._queue[0]
            needed = blocks_for_tokens(len(job.prompt_ids), self.pool.block_size)
            if not job.future.cancelled():
                if (batch and len(job.prompt_ids) > budget) or not self.pool.can_allocate(needed):
                    break
            self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            batch.append((job, self.pool.allocate(needed)))
            budget -= len(job.prompt_ids)
        return batch

    def _prefill(self, batch: list[tuple[PrefillJob, list[int]]]) -> None:
        start = time.perf_counter()
        logits = self.runner.forward([StepInput(j.prompt_ids, 0, blocks) for j, blocks in batch])
        first = sample(logits, [j.params for j, _ in batch], [j.output_index for j, _ in batch])
        prefill_s = time.perf_counter() - start
        self._observe_batch(batch, start)
        for (job, blocks), token in zip(batch, first, strict=True):
            self._transfers.submit(self._ship, job, blocks, token, start - job.enqueued_at, prefill_s)

    def _observe_batch(self, batch: list[tuple[PrefillJob, list[int]]], start: float) -> None:
        self.metrics.prefill_batch_size.observe(len(batch))
        self.metrics.prompt_tokens.inc(sum(len(job.prompt_ids) for job, _ in batch))
        for job, _ in batch:
            self.metrics.queue_time.observe(max(0.0, start - job.enqueued_at))

    # ----- transfer threads -------------------------------------------------------------------
    def spec_for(self, request_id: str, num_tokens: int) -> KvSpec:
        s = self.kv_cache.shape
        n = blocks_for_tokens(num_tokens, s.block_size)
        return KvSpec(
            request_id=request_id, model_fingerprint=self.loaded.fingerprint, dtype=dtype_name(s.dtype),
            shape=(s.num_layers, 2, n, s.block_size, s.num_kv_heads, s.head_dim),
            block_size=s.block_size, num_tokens=num_tokens,
        )

    def _ship(self, job: PrefillJob, blocks: list[int], token: int, queue_s: float, prefill_s: float) -> None:
        start = time.perf_counter()
        try:
            spec = self.spec_for(job.request_id, len(job.prompt_ids))
            kv = self.kv_cache.gather(blocks)
            sender = get_backend(job.kv_backend).sender_factory(job.kv_target)
            fault = self.faults.next_filter()
            if fault is None:
                sender.send(spec, kv, token, timeout_s=self.transfer_timeout_s)
            else:
                log.warning("request_id=%s: injecting a KV fault (%s)", job.request_id, fault.__name__)
                sender.send(spec, kv, token, timeout_s=self.transfer_timeout_s, frame_filter=fault)  # type: ignore[call-arg]
        except Exception as exc:
            log.warning("request %s: KV transfer to %s failed: %s", job.request_id, job.kv_target, exc)
            self.metrics.kv_failed(job.kv_backend, "send")
            job.future.set_exception(exc)
            return
        finally:
            self._release(blocks)
        self.kv_bytes_sent += spec.nbytes
        self.requests_finished += 1
        transfer_s = time.perf_counter() - start
        self.metrics.kv_transferred(job.kv_backend, "send", spec.nbytes, transfer_s)
        job.future.set_result(PrefillResult(token, queue_s, prefill_s, transfer_s, spec.nbytes))

    def _release(self, blocks: list[int]) -> None:
        with self._cond:
            self.pool.free(blocks)
            self._cond.notify()

