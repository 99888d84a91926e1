"""A gRPC server interceptor that traces requests by id: one log line at start, one at finish.

It wraps every unary-request method whose request message has a ``request_id`` field, on the
event-loop servers every pdserve process runs (`grpc.aio`): coroutine handlers, async-generator
handlers, and plain handlers that run on the server's control thread pool alike. Lines read
``<method> start request_id=<id>`` and ``<method> finish request_id=<id> status=<CODE> seconds=<s>``;
the id is also the ``request_id`` field of JSON log lines.

Invariant: an id reaches a log line only through `safe_id`, which escapes control characters and
cuts it to MAX_ID_CHARS, so a client cannot forge log lines with the ids it sends (the router logs
client ids before it validates them).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from pdserve.serving import STATUS_BY_NUMBER

log = logging.getLogger("pdserve.trace")

#: Longest id written to a log line (longer ones are cut and marked).
MAX_ID_CHARS = 128


def safe_id(value: object) -> str:
    """``value`` as one printable log token: control characters escaped, at most MAX_ID_CHARS."""
    text = str(value)
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= MAX_ID_CHARS else text[:MAX_ID_CHARS] + "..."


def _status_name(context: Any, error: BaseException | None) -> str:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int) and code != 0:  # grpc.aio reports the raw status number
        return STATUS_BY_NUMBER[code].name if code in STATUS_BY_NUMBER else str(code)
    if error is not None:
        return "CANCELLED" if isinstance(error, (GeneratorExit, _cancelled_errors())) else "UNKNOWN"
    return "OK"


def _cancelled_errors() -> type[BaseException]:
    import asyncio

    return asyncio.CancelledError


class RequestLoggingInterceptor(grpc.aio.ServerInterceptor):
    """Logs start/finish of every call carrying a ``request_id`` (see the module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(method, handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(method, handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler


def _request_id(request: Any) -> str | None:
    return safe_id(request.request_id) if hasattr(request, "request_id") else None


def _client_id(request: Any) -> str:
    """The client's own id of a request (a worker's DecodeRequest carries it as a label), or ""."""
    return safe_id(request.client_request_id) if getattr(request, "client_request_id", "") else ""


def _wrap_unary(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(behavior):

        async def wrapped_async(request: Any, context: Any) -> Any:
            request_id = _request_id(request)
            if request_id is None:
                return await behavior(request, context)
            start, error = log_start(method, request_id, _client_id(request)), None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                log_finish(method, request_id, start, _status_name(context, error))

        return wrapped_async

    def wrapped(request: Any, context: Any) -> Any:
        request_id = _request_id(request)
        if request_id is None:
            return behavior(request, context)
        start, error = log_start(method, request_id, _client_id(request)), None
        try:
            return behavior(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            log_finish(method, request_id, start, _status_name(context, error))

    return wrapped


def _wrap_stream(method: str, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: Any) -> AsyncIterator[Any]:
        request_id = _request_id(request)
        start, error = log_start(method, request_id or "-", _client_id(request)), None
        try:
            async for response in behavior(request, context):
                yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            log_finish(method, request_id or "-", start, _status_name(context, error))

    return wrapped


def log_start(method: str, request_id: str, client_id: str = "", label: str = "client_request_id") -> float:
    """The start line of one call; `client_id` (already `safe_id`-ed) is logged as `label` beside it."""
    extra = {"request_id": request_id, "method": method}
    if client_id:
        extra[label] = client_id
        log.info("%s start request_id=%s %s=%s", method, request_id, label, client_id, extra=extra)
    else:
        log.info("%s start request_id=%s", method, request_id, extra=extra)
    return time.monotonic()


def log_finish(method: str, request_id: str, start: float, status: str) -> None:
    """The finish line of one call: its status and duration."""
    seconds = time.monotonic() - start
    log.info(
        "%s finish request_id=%s status=%s seconds=%.3f",
        method,
        request_id,
        status,
        seconds,
        extra={"request_id": request_id, "method": method, "status": status, "seconds": round(seconds, 6)},
    )
