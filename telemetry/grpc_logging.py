"""A gRPC server interceptor that traces requests by id: one log line at start, one at finish.

It wraps every unary-request method whose request message has a ``request_id`` field. With
``assign_missing_ids`` (the router) an empty ``request_id`` is filled with a fresh one *before* the
servicer runs, so the same id travels to the decode and prefill workers and back to the client.
Lines read ``<method> start request_id=<id>`` and ``<method> finish request_id=<id> status=<CODE>
seconds=<s>``; the id is also the ``request_id`` field of JSON log lines.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc

log = logging.getLogger("pdserve.trace")


def _status_name(context: grpc.ServicerContext, error: BaseException | None) -> str:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is not None:
        return "CANCELLED" if isinstance(error, GeneratorExit) else "UNKNOWN"
    return "OK"


class RequestLoggingInterceptor(grpc.ServerInterceptor):
    """Logs start/finish of every call carrying a ``request_id`` (see the module docstring)."""

    def __init__(self, assign_missing_ids: bool = False) -> None:
        self._assign = assign_missing_ids

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary), handler.request_deserializer,
                handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(method, handler.unary_stream), handler.request_deserializer,
                handler.response_serializer)
        return handler

    def _request_id(self, request: Any) -> str | None:
        if not hasattr(request, "request_id"):
            return None
        if not request.request_id and self._assign:
            request.request_id = uuid.uuid4().hex
        return str(request.request_id)

    def _wrap_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            request_id = self._request_id(request)
            if request_id is None:
                return behavior(request, context)
            start = _log_start(method, request_id)
            error: BaseException | None = None
            try:
                return behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                _log_finish(method, request_id, start, _status_name(context, error))

        return wrapped

    def _wrap_stream(self, method: str, behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            request_id = self._request_id(request)
            if request_id is None:
                yield from behavior(request, context)
                return
            start = _log_start(method, request_id)
            error: BaseException | None = None
            try:
                yield from behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                status = "CANCELLED" if error is None and not context.is_active() else _status_name(context, error)
                _log_finish(method, request_id, start, status)

        return wrapped


def _log_start(method: str, request_id: str) -> float:
    log.info("%s start request_id=%s", method, request_id, extra={"request_id": request_id, "method": method})
    return time.monotonic()


def _log_finish(method: str, request_id: str, start: float, status: str) -> None:
    seconds = time.monotonic() - start
    log.info("%s finish request_id=%s status=%s seconds=%.3f", method, request_id, status, seconds,
             extra={"request_id": request_id, "method": method, "status": status, "seconds": round(seconds, 6)})
