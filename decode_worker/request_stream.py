"""One request's outputs on their way from the engine loop thread to the serving event loop.

The loop thread calls the request's sink with each TokenOutput (or a StreamError, or Suspended);
the sink hands it to the event loop (`call_soon_threadsafe`); nothing polls. A timer puts a marker
in the queue when the request's deadline passes. Leaving the `with` block closes the stream and
aborts the request, which frees whatever it holds (a no-op for a request that finished).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdserve.decode_worker.outcomes import DeadlinePassed
from pdserve.decode_worker.worker import DecodeWorker, StreamError, Suspended
from pdserve.engine.llm_engine import TokenOutput
from pdserve.failures import DECODE, RequestFault, WorkerUnavailable

_DEADLINE = object()  # put on a request's item queue when its deadline passes


class RequestStream:
    def __init__(self, worker: DecodeWorker, worker_id: str, request_id: str, deadline: float) -> None:
        self.worker, self.worker_id, self.request_id, self.deadline = worker, worker_id, request_id, deadline
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue = asyncio.Queue()
        self._timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> RequestStream:
        delay = max(0.0, self.deadline - time.perf_counter())
        self._timer = self._loop.call_later(delay, self._items.put_nowait, _DEADLINE)
        self.worker.open_stream(self.request_id, self._sink)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.worker.close_stream(self.request_id)
        self.worker.abort(self.request_id)

    def _sink(self, item: Any) -> None:  # noqa: ANN401 - a StreamSink, called on the engine loop thread
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    async def next(self) -> TokenOutput | Suspended:
        """The next output, or Suspended (live migration: the stream ends there). DeadlinePassed after
        the deadline; WorkerUnavailable(DECODE) when the loop died; RequestFault(DECODE) when the
        request broke its step."""
        item = await self._items.get()
        if item is _DEADLINE:
            raise DeadlinePassed("request deadline passed while decoding")
        if isinstance(item, StreamError):
            kind = WorkerUnavailable if item.worker_failed else RequestFault
            raise kind(f"decode worker {self.worker_id}: {item.message}", DECODE)
        return item
