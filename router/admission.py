"""The router's admission queue: requests wait for a decode slot instead of being refused.

A request is admitted when `try_assign` finds it a (decode, prefill) pair with a free slot (see
`WorkerPool.assign`); until then it waits here, highest priority first, then first come, first
served. Failover retries go to the front.

Invariants:
- At most `max_queued` requests wait; one more is refused at once with `QueueFull` (the router
  answers RESOURCE_EXHAUSTED / HTTP 429 with a retry-after hint), never queued.
- A request whose predicted wait exceeds its own deadline is refused at once the same way, so a
  client is not kept waiting for an answer it cannot use.
- Order: a waiter is admitted only when every waiter ahead of it was admitted or left; the head
  blocks the queue while no worker has room (no overtaking, no starvation).
- Each waiter leaves exactly once: admitted (its future holds the Lease), failed (no healthy worker,
  deadline), or cancelled (the client left). A lease handed to a waiter that left is released.
- Event-loop only (not thread-safe); other threads call `wake()` through the loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

L = TypeVar("L")

#: Re-check the head this often even without a wake-up (a poll may free a worker silently).
RECHECK_INTERVAL_S = 0.05
#: Weight of the newest sample in the moving average of service time.
SERVICE_TIME_ALPHA = 0.05
#: The queue's pace: the mean of this many recent intervals between two departures from a backlogged
#: queue, once at least MIN_PACE_SAMPLES are known.
PACE_SAMPLES = 64
MIN_PACE_SAMPLES = 8


class QueueFull(RuntimeError):
    """Refused at admission; `retry_after_s` is the hint for the client."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Busy(RuntimeError):
    """`try_assign` raises it when healthy workers exist but none has room right now."""


@dataclass(order=True)
class _Waiter(Generic[L]):
    key: tuple[int, int, int]
    assign: Callable[[], L] = field(compare=False)
    future: asyncio.Future[L] = field(compare=False)
    enqueued_at: float = field(compare=False, default_factory=time.monotonic)


class AdmissionQueue(Generic[L]):
    """Priority-then-FIFO waiting room in front of `assign` callables (see the module docstring)."""

    def __init__(self, max_queued: int, release: Callable[[L], None]) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self._release = release
        self._heap: list[_Waiter[L]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self.admitted = 0
        self.queue_time_s_sum = 0.0
        self._service_time_s = 0.0  # moving average of admitted -> finished, seconds
        self._slots = 1  # requests served at once, as the last successful assignment saw it
        # intervals between departures while requests kept waiting: the pace at which the queue moves
        self._pace: deque[float] = deque(maxlen=PACE_SAMPLES)
        self._backlogged_since: float | None = None  # the last departure that left others waiting

    def __len__(self) -> int:
        return sum(1 for w in self._heap if not w.future.done())

    async def acquire(
        self, assign: Callable[[], L], priority: int = 0, retry: bool = False, deadline_s: float | None = None
    ) -> L:
        """Wait until `assign()` returns a lease (it raises Busy while every worker is full; any
        other exception fails this waiter). Raises QueueFull when refused at once."""
        lease = self.try_now(assign)
        if lease is not None:
            return lease
        self._refuse_if_hopeless(deadline_s)
        waiter: _Waiter[L] = _Waiter(
            (0 if retry else 1, -priority, next(self._order)), assign, asyncio.get_running_loop().create_future()
        )
        heapq.heappush(self._heap, waiter)
        self._arm_timer()
        try:
            return await waiter.future
        except asyncio.CancelledError:  # the client left
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self._release(waiter.future.result())  # admitted in the same tick it left
            waiter.future.cancel()
            raise

    def try_now(self, assign: Callable[[], L]) -> L | None:
        """The fast path of `acquire`, without awaiting: a lease when nobody waits and `assign()`
        finds room, None when the caller has to queue (exceptions of `assign` other than Busy pass)."""
        if self._heap:
            return None
        try:
            return self._admitted(assign(), time.monotonic())
        except Busy:
            return None

    def wake(self) -> None:
        """Capacity may have changed: admit waiters from the head while they fit."""
        while self._heap:
            head = self._heap[0]
            if head.future.done():
                heapq.heappop(self._heap)
                continue
            try:
                lease = head.assign()
            except Busy:
                break
            except Exception as exc:  # noqa: BLE001 - e.g. NoHealthyWorker: this waiter fails
                heapq.heappop(self._heap)
                head.future.set_exception(exc)
                continue
            heapq.heappop(self._heap)
            head.future.set_result(self._admitted(lease, head.enqueued_at))
            self._departed(time.monotonic())
        self._arm_timer()

    def _departed(self, now: float) -> None:
        """A waiter left the queue admitted: learn the pace from the interval since the previous
        departure, when the queue stayed backlogged between the two."""
        if self._backlogged_since is not None:
            self._pace.append(now - self._backlogged_since)
        # is anyone still waiting (stops at the first live waiter; len() would count them all, per departure)
        waiting = any(not w.future.done() for w in self._heap)
        self._backlogged_since = now if waiting else None

    def finished(self, service_time_s: float, slots: int) -> None:
        """A request admitted earlier ended after `service_time_s`; `slots` requests run at once."""
        self._slots = max(1, slots)
        if self._service_time_s == 0.0:
            self._service_time_s = service_time_s
        else:
            self._service_time_s += SERVICE_TIME_ALPHA * (service_time_s - self._service_time_s)
        self.wake()

    def predicted_wait_s(self, position: int | None = None) -> float:
        """Expected wait of a request joining at `position` (default: the back of the queue): the
        queue's measured pace (the mean interval between departures while it was backlogged) per
        request ahead, or, before that is known, the mean service time over the slots."""
        ahead = len(self) if position is None else position
        if len(self._pace) >= MIN_PACE_SAMPLES:
            return (ahead + 1) * sum(self._pace) / len(self._pace)
        return (ahead + 1) / self._slots * self._service_time_s

    def _admitted(self, lease: L, enqueued_at: float) -> L:
        self.admitted += 1
        self.queue_time_s_sum += time.monotonic() - enqueued_at
        return lease

    def _refuse_if_hopeless(self, deadline_s: float | None) -> None:
        waiting = len(self)
        if waiting >= self.max_queued:
            raise QueueFull(
                f"router queue full: {waiting} requests waiting (--max-queued-requests {self.max_queued}); retry later",
                self._retry_after(),
            )
        predicted = self.predicted_wait_s()
        if deadline_s is not None and predicted > deadline_s:
            raise QueueFull(
                f"predicted queue wait {predicted:.1f}s exceeds the request's deadline "
                f"({deadline_s:.1f}s left); retry later",
                self._retry_after(),
            )

    def _retry_after(self) -> float:
        return float(max(1, math.ceil(self.predicted_wait_s())))

    def _arm_timer(self) -> None:
        if self._heap and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_INTERVAL_S, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.wake()
