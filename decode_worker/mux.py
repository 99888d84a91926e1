"""DecodeWorker.GenerateMux, worker side: many Generate requests on one bidirectional stream.

The router (with --decode-mux) keeps one GenerateMux call per decode worker. Each `open` runs the
worker's own Generate coroutine for that request, exactly as a Generate call would (same admission,
prefill, KV hand-off, migration, deadline and abort on exit); only the transport differs:

- every response is tagged with its request id and put in one outbox;
- a request task that finds no write in flight writes the outbox at once, and keeps writing what
  the others put meanwhile until it is empty: the first response of a decode step leaves at once,
  the rest of the step travel together in the next message(s), so under load one gRPC write here
  and one read in the router carry many requests' tokens instead of one each (MuxSession);
- a request ends with an item whose `end` is set and whose code/details are the status its Generate
  call would have ended with (what `context.abort` raised, UNKNOWN for an unexpected exception);
- `cancel` cancels the request's task (its Generate `finally` aborts it and frees its KV blocks);
  the call ending, or the connection dropping, cancels every request on it.

The per-call interceptors see the GenerateMux call (the internal token is checked once per call);
the start/finish lines of each request are logged here, as the logging interceptor does for Generate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from typing import Any

import grpc

from pdserve.failures import FAILURE_KEY
from pdserve.telemetry.grpc_logging import log_finish, log_start, safe_id
from pdserve.v1 import router_pb2, worker_pb2

log = logging.getLogger(__name__)

GenerateFn = Callable[[worker_pb2.DecodeRequest, Any], AsyncGenerator[router_pb2.GenerateResponse, None]]


class MuxAbort(Exception):
    """What `_MuxContext.abort` raises: the request ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str, failure: str = "") -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.failure = failure  # the typed failure's label (FAILURE_KEY), "" for none


class _MuxContext:
    """The part of a grpc.aio ServicerContext that Generate uses, for one request on a mux call."""

    __slots__ = ("_deadline",)

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s if timeout_s > 0 else None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        raise MuxAbort(code, details, next((v for k, v in trailing_metadata if k == FAILURE_KEY), ""))


class MuxSession:
    """One GenerateMux call: its requests' tasks and the outbox.

    Writing: a request task that puts an item while no write is in flight writes it at once, then
    keeps writing whatever the other tasks put meanwhile, until the outbox is empty (they only
    append). So the first response of a burst leaves without waiting for the rest of the burst to be
    produced, and the rest travel together in the next message(s): batches grow with the load
    (as TCP's Nagle algorithm does), and a light load pays no batching delay.
    """

    def __init__(self, generate: GenerateFn, context: grpc.aio.ServicerContext) -> None:
        self._generate = generate
        self._write = context.write
        self._outbox: list[worker_pb2.MuxItem] = []
        self._writer: asyncio.Task | None = None  # the task writing now
        self._cancel_after_write: set[asyncio.Task] = set()  # cancelled while writing for everyone
        self._tasks: dict[str, asyncio.Task] = {}
        self._idle = asyncio.Event()  # no write in flight and nothing waiting
        self._idle.set()
        self.failed: BaseException | None = None  # the write that broke the call

    async def _send(self, item: worker_pb2.MuxItem) -> None:
        if self.failed is not None:
            return
        self._outbox.append(item)
        if self._writer is not None:
            return  # the task writing now takes it along
        me = self._writer = asyncio.current_task()
        self._idle.clear()
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                # awaited here, not in a task of its own, so the write starts now (a task would wait
                # for the rest of the burst). The router's cancel of this request waits until the
                # line is handed back (`_cancel`): only the call's end cancels a writer.
                await self._write(worker_pb2.MuxResponse(items=batch))
        except Exception as exc:  # noqa: BLE001 - the call is broken (the router went away)
            self._fail(exc)
            return
        finally:
            self._writer = None
            self._idle.set()
        if me in self._cancel_after_write:
            self._cancel_after_write.discard(me)
            raise asyncio.CancelledError

    def _fail(self, exc: BaseException) -> None:
        log.info("GenerateMux: writing failed (%s); ending every request on the call", exc)
        self.failed = exc
        self._outbox.clear()
        for task in self._tasks.values():
            task.cancel()

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is None:
            return
        if task is self._writer:  # it is writing other requests' responses: cancel it once written
            self._cancel_after_write.add(task)
        else:
            task.cancel()

    async def run(self, requests: AsyncIterable[worker_pb2.MuxRequest]) -> None:
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "open":
                    self._open(message.open)
                elif kind == "cancel":
                    self._cancel(message.cancel)
            # the router half-closed: finish what is open, send the rest, end the call
            while self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            await self._idle.wait()
        finally:
            for task in self._tasks.values():
                task.cancel()
            self._tasks.clear()

    def _open(self, opened: worker_pb2.MuxOpen) -> None:
        request_id = opened.request.request_id
        if not request_id:
            asyncio.ensure_future(
                self._send(
                    worker_pb2.MuxItem(
                        request_id="",
                        end=True,
                        code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                        details="request_id: must not be empty",
                    )
                )
            )
            return
        if request_id in self._tasks:
            # an answer tagged with this id would reach the open request: the second open is dropped
            log.warning(
                "GenerateMux: request id %s is already open on this stream; the second open is ignored",
                safe_id(request_id),
            )
            return
        self._tasks[request_id] = asyncio.ensure_future(self._drive(opened))

    async def _drive(self, opened: worker_pb2.MuxOpen) -> None:
        request = opened.request
        request_id = request.request_id
        label = safe_id(request.client_request_id) if request.client_request_id else ""
        started = log_start("GenerateMux", safe_id(request_id), label)
        code, details, failure = grpc.StatusCode.OK, "", ""
        send, item = self._send, worker_pb2.MuxItem
        stream = self._generate(request, _MuxContext(opened.timeout_s))
        try:
            try:
                async for response in stream:
                    await send(item(request_id=request_id, response=response))
            finally:
                await stream.aclose()  # a cancel may land in send(): Generate's own clean-up runs now
        except MuxAbort as exc:
            code, details, failure = exc.code, exc.details, exc.failure
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise  # cancelled by the router, or the call ended: nobody reads an end item
        except Exception as exc:  # noqa: BLE001 - what grpc.aio would answer for a Generate call
            log.exception("request_id=%s failed", safe_id(request_id))
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}"
        finally:
            if self._tasks.get(request_id) is asyncio.current_task():
                del self._tasks[request_id]
            log_finish("GenerateMux", safe_id(request_id), started, code.name)
        await send(item(request_id=request_id, end=True, code=code.value[0], details=details, failure=failure))


async def serve_mux(
    generate: GenerateFn, requests: AsyncIterable[worker_pb2.MuxRequest], context: grpc.aio.ServicerContext
) -> None:
    """Serve one GenerateMux call with `generate` (a servicer's Generate)."""
    await MuxSession(generate, context).run(requests)
