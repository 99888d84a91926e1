"""Discrete-event simulation of a pdserve deployment (heapq event queue, times in seconds).

Model (mirrors the code paths of the workers, at the granularity of forward passes):

* Router: round robin over decode workers and over prefill workers (colocated: over colocated workers).
* Decode worker, disaggregated: admits a request when its KV pool can hold prompt + output tokens
  (FIFO admission queue otherwise; no preemption is modelled), then the prefill worker gets it.
  Continuous batching: one step = one token for every running sequence (at most ``max_num_seqs``),
  lasting ``decode_s(batch, mean context)``. A prompt whose KV arrived joins at the next step
  boundary (at once when idle), and its first token is emitted then.
* Prefill worker: FIFO queue; a pass takes queued prompts within a token budget (the first always)
  and lasts ``prefill_s(batch tokens)``; each prompt's KV transfer then takes ``transfer_s(tokens)``
  without blocking the next pass (the worker ships KV from a thread pool).
* Colocated worker: one engine; a prefill pass of waiting prompts has priority over a decode step
  (``LLMEngine.step``); first tokens are emitted at the end of their prefill pass.

Per-request results are ``metrics.RequestRecord``s, so the simulated summary uses the very same
metric code as the load generator.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from capacity.metrics import RequestRecord


@dataclass(frozen=True)
class LatencyModel:
    """Fitted latencies: prefill a + b*tokens + c*tokens^2; decode step a + b*batch + c*batch*mean_ctx;
    KV transfer a + b*bytes with ``kv_bytes_per_token``."""

    prefill: tuple[float, float, float]
    decode: tuple[float, float, float]
    transfer: tuple[float, float] = (0.0, 0.0)
    kv_bytes_per_token: float = 0.0

    def prefill_s(self, tokens: int) -> float:
        a, b, c = self.prefill
        return max(0.0, a + b * tokens + c * tokens * tokens)

    def decode_s(self, batch: int, mean_ctx: float) -> float:
        a, b, c = self.decode
        return max(0.0, a + b * batch + c * batch * mean_ctx)

    def transfer_s(self, tokens: int) -> float:
        return max(0.0, self.transfer[0] + self.transfer[1] * tokens * self.kv_bytes_per_token)


@dataclass(frozen=True)
class Deployment:
    """Worker counts and engine limits of one simulated configuration."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    prefill_token_budget: int = 4096
    max_num_seqs: int = 64
    kv_capacity_tokens: int = 10**9
    block_size: int = 16

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


@dataclass
class SimRequest:
    index: int
    arrival: float
    input_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    prefill_start: float | None = None

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output_len

    def blocks(self, block_size: int) -> int:
        return math.ceil((self.input_len + self.output_len) / block_size)

    def record(self) -> RequestRecord:
        times = self.token_times
        itl = [b - a for a, b in itertools.pairwise(times)]
        return RequestRecord(self.index, self.arrival, self.input_len, len(times), times[0] - self.arrival,
                             itl, times[-1] - self.arrival)


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


class _KvPool:
    """Blocks of one worker's KV cache with a FIFO admission queue."""

    def __init__(self, dep: Deployment) -> None:
        self.free = max(1, dep.kv_capacity_tokens // dep.block_size)
        self.block_size = dep.block_size
        self.waiting: deque[tuple[SimRequest, Callable[[SimRequest], None]]] = deque()

    def admit(self, req: SimRequest, then: Callable[[SimRequest], None]) -> None:
        self.waiting.append((req, then))
        self._drain()

    def release(self, req: SimRequest) -> None:
        self.free += req.blocks(self.block_size)
        self._drain()

    def _drain(self) -> None:
        while self.waiting and self.waiting[0][0].blocks(self.block_size) <= self.free:
            req, then = self.waiting.popleft()
            self.free -= req.blocks(self.block_size)
            then(req)


class _Engine:
    """Continuous batching shared by decode and colocated workers (subclasses pick the next pass)."""

    def __init__(self, loop: EventLoop, model: LatencyModel, dep: Deployment) -> None:
        self.loop, self.model, self.dep = loop, model, dep
        self.kv = _KvPool(dep)
        self.running: list[SimRequest] = []
        self.busy = False

    def _emit(self, req: SimRequest) -> None:
        req.token_times.append(self.loop.now)
        if req.done:
            if req in self.running:
                self.running.remove(req)
            self.kv.release(req)

    def _decode_step(self) -> bool:
        batch = self.running[: self.dep.max_num_seqs]
        if not batch:
            return False
        mean_ctx = sum(r.input_len + len(r.token_times) for r in batch) / len(batch)
        self._busy_until(self.loop.now + self.model.decode_s(len(batch), mean_ctx), lambda: self._end_decode(batch))
        return True

    def _end_decode(self, batch: list[SimRequest]) -> None:
        for req in batch:
            self._emit(req)
        self.busy = False
        self.kick()

    def _busy_until(self, time: float, fn: Callable[[], None]) -> None:
        self.busy = True
        self.loop.at(time, fn)

    def _join(self, req: SimRequest) -> None:
        """First token of ``req`` now; it decodes from the next step on."""
        self.running.append(req)
        self._emit(req)

    def kick(self) -> None:
        raise NotImplementedError


class _DecodeWorker(_Engine):
    def __init__(self, loop: EventLoop, model: LatencyModel, dep: Deployment) -> None:
        super().__init__(loop, model, dep)
        self.arrived: list[SimRequest] = []

    def on_kv(self, req: SimRequest) -> None:
        self.arrived.append(req)
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        arrived, self.arrived = self.arrived, []
        for req in arrived:
            self._join(req)
        self._decode_step()


class _ColocatedWorker(_Engine):
    def __init__(self, loop: EventLoop, model: LatencyModel, dep: Deployment) -> None:
        super().__init__(loop, model, dep)
        self.waiting: deque[SimRequest] = deque()

    def submit(self, req: SimRequest) -> None:
        self.kv.admit(req, self._queue)

    def _queue(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.kick()

    def kick(self) -> None:
        if self.busy:
            return
        batch = _take_batch(self.waiting, self.dep.prefill_token_budget, self.dep.max_num_seqs - len(self.running))
        if batch:
            for req in batch:
                req.prefill_start = self.loop.now
            tokens = sum(r.input_len for r in batch)
            self._busy_until(self.loop.now + self.model.prefill_s(tokens), lambda: self._end_prefill(batch))
        else:
            self._decode_step()

    def _end_prefill(self, batch: list[SimRequest]) -> None:
        for req in batch:
            self._join(req)
        self.busy = False
        self.kick()


class _PrefillWorker:
    def __init__(self, loop: EventLoop, model: LatencyModel, dep: Deployment) -> None:
        self.loop, self.model, self.dep = loop, model, dep
        self.queue: deque[tuple[SimRequest, _DecodeWorker]] = deque()
        self.busy = False

    def submit(self, req: SimRequest, target: _DecodeWorker) -> None:
        self.queue.append((req, target))
        self.kick()

    def kick(self) -> None:
        if self.busy or not self.queue:
            return
        reqs = _take_batch(deque(r for r, _ in self.queue), self.dep.prefill_token_budget, len(self.queue))
        batch = [self.queue.popleft() for _ in reqs]
        for req, _ in batch:
            req.prefill_start = self.loop.now
        self.busy = True
        done = self.loop.now + self.model.prefill_s(sum(r.input_len for r, _ in batch))
        self.loop.at(done, lambda: self._end(batch))

    def _end(self, batch: list[tuple[SimRequest, _DecodeWorker]]) -> None:
        for req, target in batch:
            self.loop.at(self.loop.now + self.model.transfer_s(req.input_len), _deliver(target, req))
        self.busy = False
        self.kick()


def _deliver(target: _DecodeWorker, req: SimRequest) -> Callable[[], None]:
    return lambda: target.on_kv(req)


def _take_batch(queue: deque[SimRequest], budget: int, max_count: int) -> list[SimRequest]:
    """FIFO within a token budget; the first prompt always fits an empty batch."""
    batch: list[SimRequest] = []
    while queue and len(batch) < max_count:
        if batch and queue[0].input_len > budget:
            break
        req = queue.popleft()
        budget -= req.input_len
        batch.append(req)
    return batch


def simulate(
    dep: Deployment,
    arrivals: Sequence[float],
    input_lens: Sequence[int],
    output_lens: Sequence[int],
    prefill_model: LatencyModel,
    decode_model: LatencyModel | None = None,
) -> list[RequestRecord]:
    """Run every request to completion; return their records (send_time = arrival)."""
    decode_model = decode_model or prefill_model
    loop = EventLoop()
    reqs = [SimRequest(i, t, n, max(1, m)) for i, (t, n, m) in enumerate(zip(arrivals, input_lens, output_lens,
                                                                             strict=True))]
    if dep.colocated:
        workers = [_ColocatedWorker(loop, decode_model, dep) for _ in range(dep.colocated)]
        for req in reqs:
            loop.at(req.arrival, _submit_colocated(workers[req.index % len(workers)], req))
    else:
        prefills = [_PrefillWorker(loop, prefill_model, dep) for _ in range(dep.prefill)]
        decodes = [_DecodeWorker(loop, decode_model, dep) for _ in range(dep.decode)]
        for req in reqs:
            p, d = prefills[req.index % len(prefills)], decodes[req.index % len(decodes)]
            loop.at(req.arrival, _submit_disaggregated(p, d, req))
    loop.run()
    return [r.record() for r in reqs]


def _submit_colocated(worker: _ColocatedWorker, req: SimRequest) -> Callable[[], None]:
    return lambda: worker.submit(req)


def _submit_disaggregated(p: _PrefillWorker, d: _DecodeWorker, req: SimRequest) -> Callable[[], None]:
    return lambda: d.kv.admit(req, lambda r: p.submit(r, d))
