"""The router's OpenAI-compatible HTTP front end (aiohttp, on the router's own event loop).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``: server-sent
events ``data: {chunk}`` then ``data: [DONE]``), ``GET /v1/models``, ``GET /health``.

Invariants:
- Every generation calls the router's own `RouterCore.generate` directly (no loopback gRPC hop), so
  validation, admission queueing, worker selection, relaying, metrics and failover are the gRPC path's.
- One client request id per request: the ``X-Request-Id`` header when given, else a new one; it is
  the ``request_id`` label (logged beside the router's internal id), the suffix of the answer's ``id``
  and the ``X-Request-Id`` response header.
- With a token configured every ``/v1/*`` endpoint needs ``Authorization: Bearer <token>`` (401
  otherwise); ``/health`` stays open. With a certificate configured the API is served over HTTPS.
- When the HTTP client goes away (or the handler ends for any reason) the generation is closed, so the
  workers free the request's KV blocks.
- A refusal by the admission queue is 429 with a ``Retry-After`` header.
- Errors are OpenAI's error object with the HTTP status mapped from the gRPC status (see
  ``router.openai_protocol.error_from_grpc``).
"""

from __future__ import annotations

import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from pdserve.limits import RECEIVE_LIMIT_BYTES
from pdserve.router.auth import BearerToken
from pdserve.router.core import RouterCore, RouterError
from pdserve.router.openai_protocol import (
    CHAT,
    COMPLETION,
    OpenAIError,
    ParsedRequest,
    answer_logprobs,
    chunk,
    error_from_grpc,
    finish_reason,
    full_answer,
    parse_request,
    usage,
    usage_chunk,
)
from pdserve.v1 import common_pb2, router_pb2

log = logging.getLogger(__name__)

MAX_BODY_BYTES = RECEIVE_LIMIT_BYTES  # twice the request-size limit: larger prompts get 400 naming it
SERVING_ROLES = (common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_COLOCATED)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(error: OpenAIError, request_id: str | None = None,
                    retry_after_s: float | None = None) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(int(retry_after_s))
    return web.json_response(error.body(), status=error.status, headers=headers or None)


def _router_error(exc: RouterError, request_id: str | None = None) -> web.Response:
    return _error_response(error_from_grpc(exc.code, exc.details), request_id, exc.retry_after_s)


class OpenAIHttpServer:
    """Serves the OpenAI API on ``host:port`` from a `RouterCore`; start and stop on the core's loop."""

    def __init__(self, core: RouterCore, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 auth_token: str | None = None, timeout_s: float = 600.0, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None) -> None:
        self._core = core
        self.model_name = model_name
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._token = BearerToken(auth_token) if auth_token else None
        self._tls = (tls_cert_file, tls_key_file) if tls_cert_file and tls_key_file else None
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None

    # ----- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind and serve; return the bound port (OSError when it cannot bind)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat_completions),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
        ])
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self._ssl_context())
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        scheme = "https" if self._tls else "http"
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1 (model %s)", scheme, self.host, self.port,
                 self.model_name)
        return self.port

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self._tls is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*self._tls)
        return context

    async def stop(self) -> None:
        """Stop serving; open generations are cancelled (their KV is freed). Idempotent."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ----- endpoints ------------------------------------------------------------------------------
    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._token is None or not request.path.startswith("/v1/"):
            return await handler(request)
        if self._token.accepts(request.headers.get("Authorization")):
            return await handler(request)
        return _error_response(OpenAIError(401, "missing or wrong bearer token (header 'Authorization')"))

    async def _models(self, _request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "pdserve"}
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, _request: web.Request) -> web.Response:
        status = self._core.status()
        serving = [w for w in status.workers if w.healthy and w.role in SERVING_ROLES]
        body = {"status": "ok" if serving else "unavailable", "healthy_workers": len(serving),
                "queued_requests": status.queued_requests}
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
        responses = self._core.generate(parsed.grpc_request, self.timeout_s)
        try:
            if parsed.stream:
                return await self._stream(request, parsed, responses)
            return await self._collect(parsed, responses)
        except RouterError as exc:
            return _router_error(exc, request_id)
        except OpenAIError as exc:
            return _error_response(exc, request_id)
        finally:
            await responses.aclose()  # frees the workers when the client left early

    # ----- relaying -------------------------------------------------------------------------------
    async def _collect(self, parsed: ParsedRequest,
                       responses: AsyncIterator[router_pb2.GenerateResponse]) -> web.Response:
        texts: list[str] = []
        entries: list[common_pb2.TokenLogprob] = []
        prompt_entries: list[common_pb2.TokenLogprob] = []
        async for response in responses:
            texts.append(response.text)
            entries.extend(response.logprobs)
            prompt_entries.extend(response.prompt_logprobs)
            reason = finish_reason(response)
            if reason is not None:
                usage_ = usage(response)
                text = "".join(texts)
                if parsed.drop_output:  # `max_tokens: 0`: the one generated token is not part of the answer
                    text, entries = "", []
                    usage_.update(completion_tokens=0, total_tokens=usage_["prompt_tokens"])
                if parsed.echo:
                    prompt = parsed.grpc_request.prompt or "".join(e.token for e in prompt_entries)
                    text = prompt + text
                    entries = prompt_entries + entries
                logprobs = answer_logprobs(parsed.kind, entries) if parsed.logprobs else None
                answer = full_answer(parsed.kind, parsed.grpc_request.request_id, self.model_name, text,
                                     reason, usage_, logprobs)
                return web.json_response(answer, headers={"X-Request-Id": parsed.grpc_request.request_id})
        raise OpenAIError(500, "the generation ended without a finish reason")

    async def _stream(self, request: web.Request, parsed: ParsedRequest,
                      responses: AsyncIterator[router_pb2.GenerateResponse]) -> web.StreamResponse:
        first = await anext(responses, None)  # errors before the first token still get a plain error answer
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
            offset = 0  # characters streamed so far (completions' text_offset)
            while response is not None:
                reason = finish_reason(response)
                if response.text or reason is not None or response.logprobs:
                    logprobs = answer_logprobs(kind, list(response.logprobs), offset) if parsed.logprobs else None
                    offset += len(response.text)
                    await send.data(chunk(kind, request_id, self.model_name, created,
                                          response.text if response.text or kind != CHAT else None, reason,
                                          logprobs=logprobs))
                if reason is not None:
                    if parsed.include_usage:
                        await send.data(usage_chunk(kind, request_id, self.model_name, created, usage(response)))
                    break
                response = await anext(responses, None)
            else:
                raise OpenAIError(500, "the generation ended without a finish reason")
        except RouterError as exc:
            await send.data(error_from_grpc(exc.code, exc.details).body())
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
