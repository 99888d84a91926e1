"""The one thread that owns a worker's engine, and the only way other threads reach it.

Other threads hand the loop closures (`post`, or `call` for a result); the loop runs them in
order between iterations, and runs `iteration()` while `has_work()` says there is work, sleeping
until a closure arrives otherwise. So the engine needs no locks: everything that touches it runs
on this thread. A closure that raises an Exception is logged and the loop goes on; if `iteration`
raises, or a closure raises a BaseException that is not an Exception, the loop dies: `alive` turns
False, `dead_reason` says why, every future handed out by `call` that has not finished fails with
`LoopDead` at once, and `on_death` (if set) runs, so the worker can fail its open streams and
report itself unhealthy instead of leaving callers waiting for their deadlines.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How long an idle loop sleeps before it looks at `has_work()` again without being woken.
IDLE_POLL_S = 0.05


class LoopDead(RuntimeError):
    """The engine loop thread is gone; nothing handed to it will run."""


class EngineLoop:
    def __init__(
        self,
        name: str,
        iteration: Callable[[], None],
        has_work: Callable[[], bool],
        die_after_iterations: int | None = None,
    ) -> None:
        self._iteration = iteration
        self._has_work = has_work
        self.dead_reason = ""
        self.on_death: Callable[[str], None] | None = None
        self._die_after = die_after_iterations  # fault injection (liveness tests)
        self._iterations = 0
        self._futures: weakref.WeakSet[Future] = weakref.WeakSet()
        self._inbox: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The loop thread runs (False before `start`, after `stop`, or once it died)."""
        return self._thread.is_alive()

    def post(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop thread, in order with every other posted closure."""
        self._inbox.put(fn)

    def call(self, fn: Callable[[], T]) -> Future:
        """Run `fn` on the loop thread; the future carries its result or exception."""
        future: Future = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)

        self.track(future)
        self.post(run)
        return future

    def track(self, future: Future) -> None:
        """Fail `future` with LoopDead if the loop dies before it finishes."""
        if self.dead_reason:
            future.set_exception(LoopDead(self.dead_reason))
        self._futures.add(future)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped.set()
        self.post(lambda: None)  # wake it
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(block=not self._has_work())
                if self._has_work() and not self._stopped.is_set():
                    self._iteration()
                    self._count_iteration()
        except BaseException as exc:  # noqa: BLE001 - the loop is gone: tell everyone waiting on it
            self._die(f"engine loop died: {type(exc).__name__}: {exc}")

    def _count_iteration(self) -> None:
        self._iterations += 1
        if self._die_after is not None and self._iterations >= self._die_after:
            raise RuntimeError(f"injected engine loop death after {self._iterations} iterations")

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        log.critical("%s", reason, exc_info=True)
        for future in list(self._futures):
            if not future.done():
                try:
                    future.set_exception(LoopDead(reason))
                except Exception:  # noqa: BLE001 - raced with its completion or cancellation
                    pass
        if self.on_death is not None:
            self.on_death(reason)

    def _drain(self, block: bool) -> None:
        """Run every closure waiting; wait briefly for the first one when `block`."""
        try:
            fn = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one bad closure must not end the loop
                log.exception("a closure on the engine loop failed")
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
