"""The prefill worker's core, independent of gRPC: the shared engine in its prefill role, plus the
KV hand-off.

The engine (`engine.llm_engine`) queues, admits, chunks and computes prompts with the same
scheduler, block pool and prefix cache as a decode or colocated worker. This worker has a
`KvConnector`, `kv_handoff.KvHandoff` (the prefill side of the KV contract): once a prompt's K/V are
complete and its first token sampled, a transfer thread ships the blocks to the decode worker that
asked; with `--kv-streaming layer` the frames leave while the pass that completes the prompt still
runs. The worker keeps the jobs and answers the Prefill calls (`HandoffOwner`).

Threads: gRPC threads call `submit`; one loop thread (`EngineLoop`) owns the engine; transfer
threads ship. Blocks are freed only by the engine on the loop thread: a transfer thread, when its
transfer ended (acknowledged or failed), posts `release_handoff` for that very sequence, which is a
no-op if the engine already ended it (a failed pass), so no block is ever freed twice.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from itertools import count

from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.metrics import WorkerMetrics
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.failures import RequestInvalid
from pdserve.kv_transfer import KvSpec, get_backend
from pdserve.kv_transfer.base import check_request_id
from pdserve.prefill_worker.faults import FaultInjector
from pdserve.prefill_worker.job import PrefillJob, PrefillResult, settle
from pdserve.prefill_worker.kv_handoff import KvHandoff

log = logging.getLogger(__name__)

__all__ = ["PrefillJob", "PrefillResult", "PrefillWorker"]  # the job types live in prefill_worker/job.py


class PrefillWorker:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        transfer_timeout_s: float = 60.0,
        max_queue: int = 1024,
        metrics: WorkerMetrics | None = None,
        faults: FaultInjector | None = None,
        prefill_chunk_tokens: int | None = None,
        prefix_caching: bool = False,
        kv_streaming: str = "request",
        shared_kv_cache: bool = False,
        kv_cache: KVCache | None = None,
    ) -> None:
        self.loaded = loaded
        self.config = replace(
            config,
            prefix_caching=prefix_caching or config.prefix_caching,
            prefill_chunk_tokens=prefill_chunk_tokens or config.prefill_chunk_tokens,
        )
        # the prefill side of the KV contract: where the engine hands every finished prefill
        self.connector = KvHandoff(self, loaded.fingerprint, transfer_timeout_s, kv_streaming, faults)
        # in shared memory, same-host decode workers copy blocks straight out of it ("shm" backend)
        self.engine = LLMEngine(
            loaded, self.config, connector=self.connector, shared_kv_cache=shared_kv_cache, kv_cache=kv_cache
        )
        self.max_queue = max_queue
        self._jobs: dict[str, PrefillJob] = {}  # engine key -> job, until its blocks are released (loop thread)
        self._keys = count()
        self._lock = threading.Lock()  # guards the counters below (gRPC and transfer threads)
        self._incoming_jobs = 0  # submitted, not yet in the engine
        self._incoming_tokens = 0
        self.kv_bytes_sent = 0
        self.requests_finished = 0
        self.metrics = metrics or WorkerMetrics()
        self.metrics.bind_gauges(
            running=lambda: 0,
            waiting=lambda: self.queue_depth,
            blocks_used=lambda: self.pool.num_used,
            blocks_total=lambda: self.pool.num_blocks,
        )
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
            raise RequestInvalid(
                f"kv_block_offset: must be in [0, {num_blocks}) for a prompt of "
                f"{len(job.prompt_ids)} tokens, got {job.kv_block_offset}"
            )

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
        self.connector.stop()

    def spec_for(self, job: PrefillJob) -> KvSpec:
        """What `job` ships: its prompt's blocks from `kv_block_offset` on."""
        return self.connector.spec_for(job)

    # ----- loop thread ------------------------------------------------------------------------
    def _enqueue(self, job: PrefillJob) -> None:
        with self._lock:
            self._incoming_jobs -= 1
            self._incoming_tokens -= len(job.prompt_ids)
        if job.future.cancelled():
            return
        key = job.request_id if job.request_id not in self.engine.sequences else f"{job.request_id}#{next(self._keys)}"
        try:
            job.seq = self.engine.add_request(
                key, job.prompt_ids, job.params, output_index=job.output_index, trace=job.trace
            )
        except ValueError as exc:
            settle(job.future, error=exc)
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
                settle(job.future, error=RuntimeError(out.error or out.finish_reason))

    def _fail_all(self, exc: Exception) -> None:
        """A step raised outside the engine's isolation: fail every job still computing."""
        self.connector.fail_streams(exc)
        for key, job in list(self._jobs.items()):
            if job.seq is not None and job.seq.status is not SequenceStatus.HANDED_OFF:
                self.engine.abort(key)
                del self._jobs[key]
                settle(job.future, error=exc)

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

    # ----- HandoffOwner (what the connector, kv_handoff.KvHandoff, asks of this worker) ------------
    def job(self, key: str) -> PrefillJob:
        return self._jobs[key]

    def prefilled(self, seq: Sequence) -> PrefillJob:
        job = self._jobs[seq.request_id]
        started = seq.scheduled_time or job.enqueued_at
        job.prefill_s = time.perf_counter() - started
        job.trace_events = seq.take_trace()
        # log-probabilities are computed where the prompt is: they travel with the answer
        job.first_logprob = seq.next_logprob
        job.prompt_logprobs = tuple(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None
        self.metrics.queue_time.observe(max(0.0, started - job.enqueued_at))
        return job

    def transfer_ended(self, job: PrefillJob, seq: Sequence) -> None:
        self.loop.post(lambda: self._release(job, seq))

    def not_shipped(self, job: PrefillJob, error: Exception) -> None:
        """The KV did not reach the decode side: count it and fail the Prefill call."""
        self.metrics.kv_failed(job.kv_backend, "send")
        settle(job.future, error=error)

    def shipped(self, job: PrefillJob, spec: KvSpec, first_token: int, transfer_s: float) -> None:
        """The decode side acknowledged the KV: account it and answer the Prefill call."""
        with self._lock:  # transfer threads finish concurrently: keep the counters exact
            self.kv_bytes_sent += spec.nbytes
            self.requests_finished += 1
        self.metrics.kv_transferred(job.kv_backend, "send", spec.nbytes, transfer_s)
        queue_s = max(0.0, (job.seq.scheduled_time or job.enqueued_at) - job.enqueued_at) if job.seq else 0.0
        cached = job.seq.num_prefix_hit_tokens if job.seq else 0
        settle(
            job.future,
            PrefillResult(
                first_token,
                queue_s,
                job.prefill_s,
                transfer_s,
                spec.nbytes,
                job.trace_events,
                cached,
                job.first_logprob,
                job.prompt_logprobs,
            ),
        )
