"""Discrete-event simulation of a pdserve deployment (heapq event queue, times in profile seconds).

The model follows the workers' code paths pass by pass, with the pass times of a profile
(`engine.sim_profile`), so that it predicts what a sim-engine cluster measures:

* Router: round robin over prefill workers and, independently, over decode (or colocated) workers,
  starting after the warm-up requests (``Timing.rr_offset``).
* Worker loops (`DecodeWorker._loop`, `PrefillWorker._loop`): work that arrives while a pass runs
  (a reservation, a commit of arrived KV, a new local request) is taken at the end of that pass;
  an idle worker takes it at once.
* Decode worker, disaggregated: reserves blocks for prompt + 1 tokens (parked, retried after every
  pass, when the pool is full), then hands the request to its prefill worker. Arrived KV is
  committed between passes: the first token is emitted then, and the sequence decodes from the
  next pass. A pass is `LLMEngine.step`: one token for every running sequence (growing its blocks,
  preempting the newest when the pool is empty), plus, in the same pass, recomputation of
  preempted sequences within the token budget (a mixed pass).
* Prefill worker: admits queued prompts FIFO when its pool holds them, then runs passes of at most
  ``prefill_chunk_tokens`` per prompt within ``max_batched_tokens`` (chunked prefill); a finished
  prompt's KV reaches its decode worker ``transfer_s`` later, without blocking the next pass.
* Colocated worker: the same engine with local prefills: new prompts are admitted FIFO within batch
  slots and free blocks (one block of headroom per sequence that will decode) and prefilled in
  chunks that join the decode pass (mixed batch), sized as `engine.scheduler` sizes them
  (`engine.chunk_cost.next_chunk`): at most ``prefill_chunk_tokens`` each within the token budget,
  and, while streams decode in the pass, together no costlier than one plain chunk (a chunk deep in
  a long prompt gets fewer tokens; K is the profile's `profile_crossover`). A prompt's first token
  is emitted at the end of the pass of its last chunk. Preemption takes prompts still prefilling
  first (newest first), then the newest running sequence, as the scheduler does.
* Pass spread: with ``overhead.pass_sigma`` > 0 the pass model's time of each pass is multiplied by
  a random factor of mean 1 (lognormal, from the same seeded generator): a real machine's passes
  spread around the fit (`pdserve plan fit` measures it on a pass log).
* Overhead: every pass over n sequences takes ``(overhead.per_pass_s + n * overhead.per_seq_s) *
  overhead_scale`` more (a decode worker's commit of arrived KV counts as one sequence of its next
  pass: it emits and streams a token), multiplied, when ``overhead.jitter_sigma`` > 0, by a random
  factor of mean 1 (lognormal with that log-space deviation; one generator per worker, seeded by
  ``Timing.seed``: the same seed gives the same timeline), plus a delay that does not depend on the
  batch (``overhead.wake_s`` on average, lognormal with log-space deviation ``overhead.wake_sigma``:
  a sleep that ends late, a process waiting for a core), and every token of a
  request reaches the client ``overhead.per_request_s * overhead_scale`` after it is emitted
  (``overhead_scale`` is the sim cluster's speedup when predicting a sim sweep: wall-clock overhead
  reads K times larger in profile time).

Per-request results are ``metrics.RequestRecord``s, so the simulated summary uses the very same
metric code as the load generator. Prefix-cache hits are modelled when the prompts' block hashes
are given (`simulate`: on prefill workers, and on colocated workers, which prefill too). Not
modelled: request deadlines and admission timeouts, the transfer thread pool's size, CPU
contention between processes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.capacity.metrics import RequestRecord
from pdserve.engine.chunk_cost import chunk_cost, next_chunk, profile_crossover, stream_allowance
from pdserve.engine.sim_profile import Profile


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


@dataclass(frozen=True)
class Deployment:
    """Worker counts of one simulated configuration."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("simulate either colocated workers or prefill + decode pools, not both")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError("need prefill >= 1 and decode >= 1, or colocated >= 1")

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def name(self) -> str:
        return f"colocated x{self.colocated}" if self.colocated else f"{self.prefill}P{self.decode}D"

    @classmethod
    def parse(cls, name: str) -> Deployment:
        """``"3P5D"`` or ``"colocated x4"``."""
        try:
            if name.startswith("colocated x"):
                return cls(colocated=int(name.removeprefix("colocated x")))
            p, _, d = name.removesuffix("D").partition("P")
            return cls(int(p), int(d))
        except ValueError:
            raise ValueError(f"deployment must look like 3P5D or 'colocated x4', got {name!r}") from None


class PrefixCache:
    """A prefill worker's cached prompt blocks, by chained block hash (`engine.block_pool.block_hashes`),
    least recently used evicted beyond `capacity_blocks`. Survives across `simulate` calls, as a
    worker's cache survives across the rates of a sweep."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def hits(self, hashes: Sequence[Hashable]) -> int:
        """Length of the longest cached prefix of `hashes` (those blocks become most recent)."""
        count = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            count += 1
        return count

    def add(self, hashes: Sequence[Hashable]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


@dataclass(frozen=True)
class Timing:
    """Profiles of the two pools and how to read the serving stack's overhead."""

    prefill: Profile  # prefill workers (and the KV links)
    decode: Profile  # decode and colocated workers
    overhead_scale: float = 1.0
    backend: str = "shm"
    rr_offset: int = 0
    seed: int = 0  # of the overhead's random delays (same seed, same timeline)


@dataclass(eq=False)  # identity: requests are removed from lists by who they are
class SimRequest:
    index: int
    arrival: float
    input_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    blocks: int = 0  # blocks held on the decode / colocated worker
    recompute: bool = False  # preempted: its next pass recomputes prompt + outputs
    prefix_hit: int = 0  # prompt tokens a colocated worker's prefix cache held when its prefill was scheduled
    computed: int = 0  # tokens of its current prefill (prompt, or prompt + outputs to recompute) computed so far
    block_hashes: Sequence[Hashable] = ()  # chained hashes of the prompt's full blocks (prefix cache)

    @property
    def num_tokens(self) -> int:
        return self.input_len + len(self.token_times)

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output_len

    def record(self, latency: float) -> RequestRecord:
        times = [t + latency for t in self.token_times]
        itl = [b - a for a, b in itertools.pairwise(times)]
        return RequestRecord(
            self.index, self.arrival, self.input_len, len(times), times[0] - self.arrival, itl, times[-1] - self.arrival
        )


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, time: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, next(self._seq), fn))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


class _Loop:
    """A worker's loop thread: calls arriving during a pass run when it ends (`_drain`)."""

    def __init__(self, loop: EventLoop, profile: Profile, scale: float, rng: np.random.Generator | None = None) -> None:
        self.loop, self.profile = loop, profile
        self.limits = profile.engine
        self.overhead, self.scale = profile.overhead, scale
        self.rng = rng or np.random.default_rng(0)
        self.free = profile.engine.num_blocks
        self.busy = False
        self.inbox: deque[Callable[[], None]] = deque()

    def call(self, fn: Callable[[], None]) -> None:
        self.inbox.append(fn)
        if not self.busy:
            self._iterate()

    def _iterate(self) -> None:
        while self.inbox:
            self.inbox.popleft()()
        self._after_inbox()
        self._start_pass()

    def _after_inbox(self) -> None:
        """Hook between the inbox and the next pass (decode: retry parked reservations)."""

    def _start_pass(self) -> None:
        raise NotImplementedError

    def _run_pass(self, seconds: float, num_seqs: int, then: Callable[[], None]) -> None:
        self.busy = True

        def end() -> None:
            then()
            self.busy = False
            self._iterate()

        spread = self.overhead.pass_sigma
        if spread > 0:  # drawn only when modelled: older profiles keep their timelines
            seconds *= float(self.rng.lognormal(-(spread**2) / 2, spread))
        extra = self.overhead.pass_s(num_seqs) * self.scale
        sigma = self.overhead.jitter_sigma
        if sigma > 0 and extra > 0:
            extra *= float(self.rng.lognormal(-(sigma**2) / 2, sigma))
        wake, wake_sigma = self.overhead.wake_s * self.scale, self.overhead.wake_sigma
        if wake > 0:  # drawn only when modelled: older profiles keep their timelines
            extra += wake * float(self.rng.lognormal(-(wake_sigma**2) / 2, wake_sigma)) if wake_sigma > 0 else wake
        self.loop.at(self.loop.now + seconds + extra, end)


class _EngineWorker(_Loop):
    """Decode or colocated worker: `LLMEngine` (scheduler + block pool) behind the loop."""

    def __init__(
        self,
        loop: EventLoop,
        profile: Profile,
        scale: float,
        rng: np.random.Generator | None = None,
        cache: PrefixCache | None = None,
    ) -> None:
        super().__init__(loop, profile, scale, rng)
        self.cache = cache  # colocated workers' prefix cache (a decode worker prefills nothing)
        self.running: list[SimRequest] = []
        self.prefilling: list[SimRequest] = []  # admitted (blocks held), their prompt chunk by chunk
        self.waiting: deque[SimRequest] = deque()
        self.crossover = profile_crossover(profile)
        self.parked: list[tuple[SimRequest, Callable[[], None]]] = []
        self.commits = 0  # arrived KV committed since the last pass (their cost joins the next pass)

    # ----- blocks ------------------------------------------------------------------------------
    def _grow(self, req: SimRequest, tokens: int) -> bool:
        missing = blocks_for(tokens, self.limits.block_size) - req.blocks
        if missing <= 0:
            return True
        if missing > self.free:
            return False
        self.free -= missing
        req.blocks += missing
        return True

    def _release(self, req: SimRequest) -> None:
        self.free += req.blocks
        req.blocks = 0

    # ----- disaggregated: reservation, then KV commit ------------------------------------------
    def reserve(self, req: SimRequest, then: Callable[[], None]) -> None:
        self.call(lambda: self._reserve_or_park(req, then))

    def _reserve_or_park(self, req: SimRequest, then: Callable[[], None]) -> None:
        if not self._try_reserve(req, then):
            self.parked.append((req, then))

    def _try_reserve(self, req: SimRequest, then: Callable[[], None]) -> bool:
        if not self._grow(req, req.input_len + 1):
            return False
        then()
        return True

    def _after_inbox(self) -> None:
        self.parked = [(r, t) for r, t in self.parked if not self._try_reserve(r, t)]

    def commit(self, req: SimRequest) -> None:
        self.call(lambda: self._commit(req))

    def _commit(self, req: SimRequest) -> None:
        self.commits += 1
        self._emit(req)
        if not req.done:
            self.running.append(req)

    # ----- colocated ---------------------------------------------------------------------------
    def add_local(self, req: SimRequest) -> None:
        self.call(lambda: self.waiting.append(req))

    # ----- the pass ------------------------------------------------------------------------------
    def _emit(self, req: SimRequest) -> None:
        req.token_times.append(self.loop.now)
        if req.done:
            if req in self.running:
                self.running.remove(req)
            self._release(req)

    def _schedule_decode(self) -> list[SimRequest]:
        scheduled: list[SimRequest] = []
        while self.running:
            req = self.running.pop(0)
            while not self._grow(req, req.num_tokens):
                if self.prefilling:  # the scheduler's victims: prompts still prefilling, newest first
                    self._preempt_prefill(self.prefilling.pop())
                    continue
                if self.running:
                    self._preempt(self.running.pop())
                    continue
                if scheduled:
                    self._preempt(req)
                else:  # alone and too long for the pool: ends (finish reason "length")
                    self._release(req)
                    req.output_len = len(req.token_times)
                break
            else:
                scheduled.append(req)
        self.running = scheduled
        return list(scheduled)

    def _preempt(self, req: SimRequest) -> None:
        self._release(req)
        req.recompute = True
        self.waiting.appendleft(req)

    def _preempt_prefill(self, req: SimRequest) -> None:
        """A prompt preempted before its last chunk starts over when it is admitted again."""
        self._release(req)
        req.computed = req.prefix_hit = 0
        self.waiting.appendleft(req)

    def _prefill_tokens(self, req: SimRequest) -> int:
        return req.num_tokens - 1 if req.token_times else req.input_len

    def _cache_hit(self, req: SimRequest) -> int:
        """Prompt tokens of a fresh request the prefix cache holds (full blocks, at least one token
        left to compute), as `BlockPool` finds them."""
        if self.cache is None or req.recompute or req.token_times:
            return 0
        bs = self.limits.block_size
        return self.cache.hits(req.block_hashes[: (req.input_len - 1) // bs]) * bs

    def _schedule_prefill(self, budget: int, allowance: float) -> list[tuple[SimRequest, int]]:
        """(request, new tokens) chunks of this pass, as `Scheduler.schedule_prefill` plans them:
        prompts already prefilling continue FIFO, then waiting ones are admitted FIFO."""
        chunks: list[tuple[SimRequest, int]] = []
        for req in self.prefilling:
            n = self._chunk(req, budget, allowance, first=not chunks)
            if n == 0:
                break
            chunks.append((req, n))
            budget -= n
            allowance -= chunk_cost(n, req.computed, self.crossover)
        while budget > 0 and allowance >= 1 and self.waiting and self._has_slot() and self._admit(self.waiting[0]):
            req = self.waiting.popleft()
            self.prefilling.append(req)
            n = self._chunk(req, budget, allowance, first=not chunks)
            if n == 0:
                break
            chunks.append((req, n))
            budget -= n
            allowance -= chunk_cost(n, req.computed, self.crossover)
        return chunks

    def _chunk(self, req: SimRequest, budget: int, allowance: float, first: bool) -> int:
        return next_chunk(
            self._prefill_tokens(req) - req.computed,
            req.computed,
            self.limits.prefill_chunk_tokens,
            budget,
            allowance,
            self.crossover,
            first,
        )

    def _has_slot(self) -> bool:
        return len(self.running) + len(self.prefilling) < self.limits.max_num_seqs

    def _admit(self, req: SimRequest) -> bool:
        """Blocks for the whole prefill (a block of headroom per sequence that will decode); its
        cached prefix is not computed again."""
        tokens = self._prefill_tokens(req)
        needed = blocks_for(tokens, self.limits.block_size) + len(self.running) + len(self.prefilling)
        if self.free < needed or not self._grow(req, tokens):
            return False
        req.prefix_hit = req.computed = self._cache_hit(req)
        return True

    def _start_pass(self) -> None:
        decode = self._schedule_decode()
        allowance = stream_allowance(self.limits.prefill_chunk_tokens, self.crossover) if decode else math.inf
        chunks = self._schedule_prefill(self.limits.max_batched_tokens - len(decode), allowance)
        if not decode and not chunks:
            return
        items = [(n, req.computed) for req, n in chunks]
        seconds = self.profile.pass_s(items, len(decode), sum(r.num_tokens for r in decode))
        num_seqs, self.commits = len(decode) + len(chunks) + self.commits, 0
        self._run_pass(seconds, num_seqs, lambda: self._end_pass(decode, chunks))

    def _end_pass(self, decode: list[SimRequest], chunks: list[tuple[SimRequest, int]]) -> None:
        for req in decode:
            self._emit(req)
        for req, n in chunks:
            req.computed += n
            fresh = not req.recompute
            if fresh and self.cache is not None:  # full blocks are registered as soon as they are computed
                self.cache.add(req.block_hashes[: min(req.computed, req.input_len) // self.limits.block_size])
            if req.computed < self._prefill_tokens(req):
                continue
            self.prefilling.remove(req)
            req.recompute, req.prefix_hit, req.computed = False, 0, 0
            if fresh:
                self._emit(req)
            if not req.done:
                self.running.append(req)


@dataclass(eq=False)
class _PrefillJob:
    req: SimRequest
    target: _EngineWorker
    blocks: int = 0
    computed: int = 0


class _PrefillWorker(_Loop):
    """`PrefillWorker`: FIFO admission by free blocks, chunked passes, KV shipped after each prompt."""

    def __init__(
        self,
        loop: EventLoop,
        profile: Profile,
        scale: float,
        backend: str,
        cache: PrefixCache | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        super().__init__(loop, profile, scale, rng)
        self.backend = backend
        self.cache = cache
        self.queue: deque[_PrefillJob] = deque()
        self.active: list[_PrefillJob] = []

    def submit(self, req: SimRequest, target: _EngineWorker) -> None:
        self.call(lambda: self.queue.append(_PrefillJob(req, target)))

    def _admit(self) -> None:
        while self.queue:
            job = self.queue[0]
            bs = self.limits.block_size
            needed = blocks_for(job.req.input_len, bs)
            if needed > self.free:
                return
            self.queue.popleft()
            hits = self.cache.hits(job.req.block_hashes[: (job.req.input_len - 1) // bs]) if self.cache else 0
            self.free -= needed - hits
            job.blocks = needed - hits
            job.computed = hits * bs
            self.active.append(job)

    def _start_pass(self) -> None:
        self._admit()
        step: list[tuple[_PrefillJob, int]] = []
        budget = self.limits.max_batched_tokens
        for job in self.active:
            n = min(job.req.input_len - job.computed, self.limits.prefill_chunk_tokens, budget)
            if n <= 0:
                break
            step.append((job, n))
            budget -= n
        if step:
            seconds = self.profile.pass_s([(n, job.computed) for job, n in step], 0, 0)
            self._run_pass(seconds, len(step), lambda: self._end_pass(step))

    def _end_pass(self, step: list[tuple[_PrefillJob, int]]) -> None:
        for job, n in step:
            job.computed += n
            if self.cache is not None:
                self.cache.add(job.req.block_hashes[: job.computed // self.limits.block_size])
            if job.computed == job.req.input_len:
                self.active.remove(job)
                delay = self.profile.transfer_s(self.backend, job.req.input_len)
                self.loop.at(self.loop.now + delay, self._delivered(job))

    def _delivered(self, job: _PrefillJob) -> Callable[[], None]:
        def deliver() -> None:
            self.free += job.blocks
            job.target.commit(job.req)
            if not self.busy:
                self._iterate()

        return deliver


def simulate(
    dep: Deployment,
    arrivals: Sequence[float],
    input_lens: Sequence[int],
    output_lens: Sequence[int],
    timing: Timing,
    prompt_hashes: Sequence[Sequence[Hashable]] | None = None,
    prefix_caches: Sequence[PrefixCache] | None = None,
) -> list[RequestRecord]:
    """Run every request to completion; return their records (send_time = arrival). With
    `prompt_hashes` (each prompt's full-block hashes) and one `PrefixCache` per prefill worker (per
    colocated worker in a colocated deployment), those workers skip the cached prefix of a prompt,
    as with `--prefix-caching`."""
    loop = EventLoop()
    hashes = prompt_hashes or [()] * len(arrivals)
    reqs = [
        SimRequest(i, t, max(1, n), max(1, m), block_hashes=h)
        for i, (t, n, m, h) in enumerate(zip(arrivals, input_lens, output_lens, hashes, strict=True))
    ]
    scale = timing.overhead_scale
    colocated_caches = list(prefix_caches) if prefix_caches is not None and dep.colocated else []
    engines = [
        _EngineWorker(
            loop,
            timing.decode,
            scale,
            np.random.default_rng([timing.seed, 0, i]),
            colocated_caches[i] if colocated_caches else None,
        )
        for i in range(dep.colocated or dep.decode)
    ]
    caches = list(prefix_caches) if prefix_caches is not None and dep.prefill else [None] * dep.prefill
    prefills = []
    for i, cache in enumerate(caches[: dep.prefill]):
        rng = np.random.default_rng([timing.seed, 1, i])
        prefills.append(_PrefillWorker(loop, timing.prefill, scale, timing.backend, cache, rng))
    for req in reqs:
        slot = req.index + timing.rr_offset
        engine = engines[slot % len(engines)]
        if dep.colocated:
            loop.at(req.arrival, _bind(engine.add_local, req))
        else:
            prefill = prefills[slot % len(prefills)]
            loop.at(req.arrival, _bind_reserve(engine, prefill, req))
    loop.run()
    latency = timing.decode.overhead.per_request_s * scale
    return [r.record(latency) for r in reqs]


def _bind(fn: Callable[[SimRequest], None], req: SimRequest) -> Callable[[], None]:
    return lambda: fn(req)


def _bind_reserve(engine: _EngineWorker, prefill: _PrefillWorker, req: SimRequest) -> Callable[[], None]:
    return lambda: engine.reserve(req, lambda: prefill.submit(req, engine))
