"""DecodeWorker.GenerateMux, router side (opt-in: `--decode-mux`).

One GenerateMux call per decode worker carries every request the router sends it. `DecodeMux.open`
returns a `MuxCall` that reads like the grpc.aio call of a Generate request (`read()` returns
responses, then `grpc.aio.EOF`, or raises `grpc.aio.AioRpcError`; `cancel()`), so the router's
attempt loop, failover and migration code is the same for both transports:

- a request's end item with a non-OK code raises AioRpcError(code, details) from `read()`, exactly
  the status its Generate call would have ended with;
- the request's deadline is enforced here (DEADLINE_EXCEEDED, and a cancel to the worker), as the
  Generate call's deadline was; the worker gets it too (MuxOpen.timeout_s);
- the mux call failing (the worker died, the connection dropped) fails every request on it with
  that status (UNAVAILABLE for a dead worker), so they fail over as before; the next request to that
  worker opens a new call.

Why: relaying one token used to cost the router two gRPC operations (read from the decode call,
write to the client). With the mux, the tokens of one decode step arrive in one message, so the
read is shared by the whole step (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from pdserve.failures import FAILURE_KEY
from pdserve.serving import STATUS_BY_NUMBER
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

_EOF = grpc.aio.EOF
_CLOSE = object()  # ends the outgoing request stream


def rpc_error(code: grpc.StatusCode, details: str, failure: str = "") -> grpc.aio.AioRpcError:
    """The AioRpcError a Generate call would raise, with the typed failure in its trailing metadata."""
    trailing = grpc.aio.Metadata((FAILURE_KEY, failure)) if failure else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


class MuxCall:
    """One request on a DecodeMux, read like a grpc.aio UnaryStreamCall."""

    __slots__ = ("_mux", "request_id", "_items", "_waiter", "_ended", "_timer")

    def __init__(self, mux: DecodeMux, request_id: str, timeout_s: float) -> None:
        self._mux = mux
        self.request_id = request_id
        self._items: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._ended = False  # the end (or a failure) is queued, or the call was cancelled
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    # ----- fed by the mux's reader ----------------------------------------------------------------
    def _push(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _end(self, item: Any) -> None:
        if not self._ended:
            self._ended = True
            self._timer.cancel()
            self._push(item)

    def _expire(self) -> None:
        if not self._ended:
            self._mux.cancel(self.request_id)
            self._end(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    # ----- read by the attempt loop -----------------------------------------------------------------
    async def read(self) -> Any:
        """The next response; grpc.aio.EOF after a normal end; raises AioRpcError on a failure."""
        items = self._items
        while not items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = items.popleft()
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def cancel(self) -> bool:
        """Stop the request (the worker aborts it); no-op once it ended."""
        if self._ended:
            return False
        self._ended = True
        self._timer.cancel()
        self._mux.cancel(self.request_id)
        return True


class DecodeMux:
    """The GenerateMux call to one decode worker and the requests open on it."""

    def __init__(
        self,
        address: str,
        stub: worker_pb2_grpc.DecodeWorkerStub,
        metadata: Any,
        on_closed: Callable[[DecodeMux], None],
    ) -> None:
        self.address = address
        self.closed = False
        self.messages_received = 0  # MuxResponse messages read (each carries one worker loop turn)
        self._calls: dict[str, MuxCall] = {}
        self._outgoing: asyncio.Queue[Any] = asyncio.Queue()
        self._on_closed = on_closed
        self._call = stub.GenerateMux(self._requests(), metadata=metadata)
        self._reader = asyncio.ensure_future(self._read())

    @property
    def open_requests(self) -> int:
        return len(self._calls)

    def open(self, request: worker_pb2.DecodeRequest, timeout_s: float) -> MuxCall:
        call = MuxCall(self, request.request_id, timeout_s)
        if self.closed:  # raced with the call's end: fail like a call to a dead worker
            call._end(rpc_error(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.address}: mux stream closed"))
            return call
        self._calls[request.request_id] = call
        self._outgoing.put_nowait(worker_pb2.MuxRequest(open=worker_pb2.MuxOpen(request=request, timeout_s=timeout_s)))
        return call

    def cancel(self, request_id: str) -> None:
        if self._calls.pop(request_id, None) is not None and not self.closed:
            self._outgoing.put_nowait(worker_pb2.MuxRequest(cancel=request_id))

    async def close(self) -> None:
        """End the call (every open request fails with CANCELLED)."""
        self._call.cancel()
        self._reader.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass

    async def _requests(self) -> AsyncIterator[worker_pb2.MuxRequest]:
        get = self._outgoing.get
        while True:
            message = await get()
            if message is _CLOSE:
                return
            yield message

    async def _read(self) -> None:
        failure = rpc_error(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.address}: mux stream ended")
        calls = self._calls
        try:
            read = self._call.read
            while True:
                message = await read()
                if message is _EOF:
                    break
                self.messages_received += 1
                for item in message.items:
                    call = calls.get(item.request_id)
                    if call is None:
                        continue  # cancelled meanwhile
                    if item.HasField("response"):
                        call._push(item.response)
                    if item.end:
                        del calls[item.request_id]
                        call._end(
                            _EOF
                            if item.code == 0
                            else rpc_error(
                                STATUS_BY_NUMBER.get(item.code, grpc.StatusCode.UNKNOWN), item.details, item.failure
                            )
                        )
        except grpc.aio.AioRpcError as exc:
            # the worker's side ended the call (it stopped, or the connection dropped): for the requests
            # on it that is the worker failing, as for a Generate call to a dead worker
            code = grpc.StatusCode.UNAVAILABLE if exc.code() == grpc.StatusCode.CANCELLED else exc.code()
            failure = rpc_error(code, f"decode worker {self.address}: {exc.details() or exc.code().name}")
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.warning(
                    "mux stream to decode worker %s failed: %s: %s", self.address, exc.code().name, exc.details()
                )
        except asyncio.CancelledError:
            failure = rpc_error(grpc.StatusCode.CANCELLED, "router closing")
            raise
        finally:
            self.closed = True
            self._outgoing.put_nowait(_CLOSE)
            self._on_closed(self)
            pending, self._calls = list(calls.values()), {}
            for call in pending:
                call._end(failure)
