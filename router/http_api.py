"""The router's OpenAI-compatible HTTP front end (aiohttp, in its own thread and event loop).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``: server-sent
events ``data: {chunk}`` then ``data: [DONE]``), ``GET /v1/models``, ``GET /health``.

Invariants:
- Every generation goes through the router's own gRPC ``Generate`` over a loopback channel, so
  validation, worker selection, relaying, metrics and request logging are the gRPC path's.
- One request id per request: the ``X-Request-Id`` header when given, else a new one; it is the gRPC
  ``request_id`` (so it shows in the logs of router, prefill and decode worker), the suffix of the
  answer's ``id`` and the ``X-Request-Id`` response header.
- When the HTTP client goes away (or the handler ends for any reason) the gRPC call is cancelled, so the
  workers free the request's KV blocks.
- Errors are OpenAI's error object with the HTTP status mapped from the gRPC status (see
  ``router.openai_protocol.error_from_grpc``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from aiohttp import web

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.config import MAX_RECEIVE_MESSAGE_BYTES
from router.openai_protocol import (
    CHAT,
    COMPLETION,
    OpenAIError,
    ParsedRequest,
    chunk,
    error_from_grpc,
    finish_reason,
    full_answer,
    parse_request,
    usage,
    usage_chunk,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
SERVING_ROLES = (common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_COLOCATED)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def loopback_target(host: str, port: int) -> str:
    """Address to reach a server bound to ``host:port`` from this process."""
    return f"127.0.0.1:{port}" if host in ("", "0.0.0.0", "::", "[::]") else f"{host}:{port}"


def _error_response(error: OpenAIError, request_id: str | None = None) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.json_response(error.body(), status=error.status, headers=headers)


class OpenAIHttpServer:
    """Serves the OpenAI API on ``host:port`` by calling the router at ``grpc_target``."""

    def __init__(self, grpc_target: str, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 max_streams: int = 256, timeout_s: float = 600.0) -> None:
        self.model_name = model_name
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._created = int(time.time())
        self._channel = grpc.insecure_channel(
            grpc_target, options=[("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)])
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._pool = ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="http-relay")
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-api", daemon=True)

    # ----- lifecycle ----------------------------------------------------------------------------
    def start(self) -> int:
        """Bind and serve; return the bound port (OSError when it cannot bind)."""
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1 (model %s)", self.host, self.port, self.model_name)
        return self.port

    async def _start(self) -> int:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat_completions),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
        ])
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        return int(self._runner.addresses[0][1])

    def stop(self) -> None:
        """Stop serving, cancel open generations, end the thread. Idempotent."""
        if self._thread.is_alive():
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._channel.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----- endpoints ------------------------------------------------------------------------------
    async def _models(self, _request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "pdserve"}
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, _request: web.Request) -> web.Response:
        try:
            status = await self._in_thread(
                lambda: self._stub.GetStatus(router_pb2.StatusRequest(), timeout=5.0))
        except grpc.RpcError as exc:
            return _error_response(error_from_grpc(exc.code(), exc.details() or ""))
        serving = [w for w in status.workers if w.healthy and w.role in SERVING_ROLES]
        body = {"status": "ok" if serving else "unavailable", "healthy_workers": len(serving)}
        return web.json_response(body, status=200 if serving else 503)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETION)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise OpenAIError(400, f"request body is not valid JSON: {exc}") from None
            parsed = parse_request(kind, body, self.model_name, request_id)
        except OpenAIError as exc:
            return _error_response(exc, request_id)
        auth = request.headers.get("Authorization")
        call = self._stub.Generate(parsed.grpc_request, timeout=self.timeout_s,
                                   metadata=(("authorization", auth),) if auth else None)
        try:
            if parsed.stream:
                return await self._stream(request, parsed, call)
            return await self._collect(parsed, call)
        except grpc.RpcError as exc:
            return _error_response(error_from_grpc(exc.code(), exc.details() or ""), request_id)
        except OpenAIError as exc:
            return _error_response(exc, request_id)
        finally:
            call.cancel()  # no-op once finished; frees the workers when the client left early

    # ----- relaying -------------------------------------------------------------------------------
    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def _next(self, call: Any) -> router_pb2.GenerateResponse | None:
        return await self._in_thread(lambda: next(call, None))

    async def _collect(self, parsed: ParsedRequest, call: Any) -> web.Response:
        texts: list[str] = []
        while (response := await self._next(call)) is not None:
            texts.append(response.text)
            reason = finish_reason(response)
            if reason is not None:
                answer = full_answer(parsed.kind, parsed.grpc_request.request_id, self.model_name, "".join(texts),
                                     reason, usage(response))
                return web.json_response(answer, headers={"X-Request-Id": parsed.grpc_request.request_id})
        raise OpenAIError(500, "the generation ended without a finish reason")

    async def _stream(self, request: web.Request, parsed: ParsedRequest, call: Any) -> web.StreamResponse:
        first = await self._next(call)  # errors before the first token still get a plain error answer
        request_id, kind = parsed.grpc_request.request_id, parsed.kind
        created = int(time.time())
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                          "X-Request-Id": request_id})
        await out.prepare(request)
        send = _EventWriter(out)
        try:
            if kind == CHAT:
                await send.data(chunk(kind, request_id, self.model_name, created, "", None, role=True))
            response = first
            while response is not None:
                reason = finish_reason(response)
                if response.text or reason is not None:
                    await send.data(chunk(kind, request_id, self.model_name, created,
                                          response.text if response.text or kind != CHAT else None, reason))
                if reason is not None:
                    if parsed.include_usage:
                        await send.data(usage_chunk(kind, request_id, self.model_name, created, usage(response)))
                    break
                response = await self._next(call)
            else:
                raise OpenAIError(500, "the generation ended without a finish reason")
        except grpc.RpcError as exc:
            await send.data(error_from_grpc(exc.code(), exc.details() or "").body())
        except OpenAIError as exc:
            await send.data(exc.body())
        await send.done()
        return out


class _EventWriter:
    """Writes server-sent events ``data: <json>\\n\\n``; a vanished client raises ConnectionResetError."""

    def __init__(self, out: web.StreamResponse) -> None:
        self._out = out

    async def data(self, obj: dict[str, Any]) -> None:
        await self._out.write(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())

    async def done(self) -> None:
        await self._out.write(b"data: [DONE]\n\n")
        await self._out.write_eof()
