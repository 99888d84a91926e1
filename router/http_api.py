"""The router's OpenAI-compatible HTTP front end (aiohttp, on the router's own event loop).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``: server-sent
events ``data: {chunk}`` then ``data: [DONE]``), ``POST /v1/responses`` (router/responses_api.py; with
``stream``: named events ``event: <type>`` / ``data: {event}``), ``GET`` and ``DELETE
/v1/responses/{id}`` (stored responses, router/response_store.py), ``GET /v1/models``, vLLM's ``POST
/tokenize`` and ``POST /detokenize`` (router/tokenize_api.py: a serving worker's tokenizer), ``GET /health``.

Invariants:
- Every generation calls the router's own `RouterCore.generate` directly (no loopback gRPC hop), so
  validation, admission queueing, worker selection, relaying, metrics and failover are the gRPC path's.
- One client request id per request: the ``X-Request-Id`` header when given, else a new one; it is
  the ``request_id`` label (logged beside the router's internal id), the suffix of the answer's ``id``
  (not of a Responses id: those key the response store, so they are random) and the ``X-Request-Id``
  response header.
- With a token configured every endpoint but ``/health`` needs ``Authorization: Bearer <token>`` (401
  otherwise). A stored response belongs to its caller's tenant. With a certificate configured the API
  is served over HTTPS.
- When the HTTP client goes away (or the handler ends for any reason) the generation is closed, so the
  workers free the request's KV blocks.
- A refusal by the admission queue is 429 with a ``Retry-After`` header.
- Errors are OpenAI's error object with the HTTP status mapped from the gRPC status (see
  ``router.openai_protocol.error_from_grpc``).
- Bounded connections (values of uvicorn, which vLLM's server runs on, where it has them): a
  connection that has not sent a complete request within ``KEEPALIVE_S`` (5 s, uvicorn's
  ``timeout_keep_alive``) of opening or of its previous answer is closed, which covers idle and
  half-sent requests; a body must arrive within ``BODY_TIMEOUT_S`` (408 otherwise); at most
  ``max_connections`` are open at once (default: half the process's file-descriptor limit, so the
  gRPC side and the worker channels keep theirs); one more is answered 503 and closed.
- Bodies are UTF-8 JSON whatever ``charset`` says (RFC 8259). A body larger than
  ``INLINE_PARSE_BYTES`` is parsed and checked off the event loop; malformed JSON, nesting too deep, a lone UTF-16
  surrogate, or an ``X-Request-Id`` that is not printable ASCII is a 400, never a 500. What aiohttp's
  HTTP parser refuses (a control byte in a header, a bad request line) is the same JSON 400, logged
  as one INFO line without a traceback.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import logging
import multiprocessing
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from functools import partial
from typing import Any, NamedTuple

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError

from pdserve.constants import REQUEST_TIMEOUT_S
from pdserve.limits import RECEIVE_LIMIT_BYTES, fd_share
from pdserve.router import responses_api, tools
from pdserve.router.auth import BearerToken
from pdserve.router.core import RouterCore, RouterError
from pdserve.router.openai_protocol import (
    CHAT,
    COMPLETION,
    OpenAIError,
    ParsedRequest,
    answer_choice,
    answer_logprobs,
    chunk,
    error_from_grpc,
    finish_reason,
    full_answer,
    parse_request,
    total_usage,
    usage,
    usage_chunk,
)
from pdserve.router.response_store import ResponseStore
from pdserve.router.responses_api import RESPONSE, ResponsesRequest, parse_responses
from pdserve.router.tokenize_api import (
    DETOKENIZE,
    TOKENIZE,
    TokenizerRelay,
    detokenize_answer,
    parse_detokenize,
    parse_tokenize,
    tokenize_answer,
)
from pdserve.router.validation import MAX_REQUEST_ID_CHARS, is_printable_ascii
from pdserve.telemetry.memory import trim as trim_heap
from pdserve.v1 import common_pb2, router_pb2, worker_pb2

log = logging.getLogger(__name__)

MAX_BODY_BYTES = RECEIVE_LIMIT_BYTES  # twice the request-size limit: larger prompts get 400 naming it
# the caller's tenant ("" for a token naming none); a typed key where aiohttp has them (3.12+)
TENANT_KEY: Any = web.RequestKey("pdserve.tenant", str) if hasattr(web, "RequestKey") else "pdserve.tenant"
KEEPALIVE_S = 5.0  # uvicorn's timeout_keep_alive (vLLM's default too); aiohttp's own is 3,630 s
BODY_TIMEOUT_S = 30.0  # the whole body, once the headers are in
INLINE_PARSE_BYTES = 64 * 1024  # larger bodies are parsed in a thread, off the event loop
_REFUSED_BODY = json.dumps(
    {"error": {"message": "too many open connections", "type": "server_error", "param": None, "code": None}}
).encode()
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY)
)


def default_max_connections() -> int:
    """Half the soft file-descriptor limit (at least 64): the rest stays for gRPC and worker channels."""
    return fd_share(0.5)


class _Refusal(asyncio.Protocol):
    """A connection over the cap: a 503 answer, then closed (nothing read, nothing kept)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_REFUSED)  # type: ignore[attr-defined]  # a stream transport (uvloop's is no subclass)
        transport.close()


class _JsonErrors(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering what its HTTP parser refuses (a control byte or a bad
    encoding in a header, a bad request line, a line over 8 KiB) with OpenAI's JSON error object like
    every other bad request, logged as one line: aiohttp's own answer is plain text, logged as an
    ERROR with a traceback for each such request (an unauthenticated client could fill the logs)."""

    __slots__ = ()  # the layout of aiohttp's class: a connection's handler becomes one by `__class__`

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        reason = (getattr(exc, "message", "") or str(exc) or "malformed HTTP request").strip().splitlines()[0]
        reason = reason[:160].rstrip(":")
        log.info("malformed HTTP request from %s: %s", request.remote, reason)
        if request.writer.output_size > 0:  # what aiohttp does: the answer was under way, the connection is lost
            raise ConnectionError("a response was under way; cannot send the error")
        answer = _error_response(OpenAIError(status, f"malformed HTTP request: {reason}"))
        answer.force_close()
        return answer


class _CappedSite(web.TCPSite):
    """`web.TCPSite` that refuses connections beyond `max_connections` (aiohttp has no such option)."""

    def __init__(
        self, runner: web.AppRunner, host: str, port: int, ssl_context: ssl.SSLContext | None, max_connections: int
    ) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self._max_connections = max_connections
        self.refused = 0

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (what TCPSite.start does first)
        server = self._runner.server
        assert server is not None

        def protocol() -> asyncio.Protocol:
            if len(server.connections) >= self._max_connections:
                self.refused += 1
                return _Refusal()
            handler = server()
            handler.__class__ = _JsonErrors
            return handler

        self._server = await asyncio.get_running_loop().create_server(
            protocol, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog
        )


def _load_json(raw: bytes) -> Any:  # noqa: ANN401 - any JSON value
    """The body as JSON (UTF-8); OpenAIError 400 for anything the API cannot take as it is."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None
    try:  # JSON's \ud800 escapes decode to lone surrogates, which no later step can encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError(400, "request body contains a lone UTF-16 surrogate (\\ud800-\\udfff)") from None
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None
    return body


SERVING_ROLES = (common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_COLOCATED)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(
    error: OpenAIError, request_id: str | None = None, retry_after_s: float | None = None
) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(int(retry_after_s))
    return web.json_response(error.body(), status=error.status, headers=headers or None)


def _router_error(exc: RouterError, request_id: str | None = None) -> web.Response:
    return _error_response(error_from_grpc(exc.code, exc.details), request_id, exc.retry_after_s)


class _Body(NamedTuple):
    """How one endpoint's body is read: `parse` (JSON value, model name, request id) -> the parsed
    request (OpenAIError names a bad field); `pack` / `unpack` carry it as bytes and small values."""

    parse: Callable[[object, str, str], Any]
    pack: Callable[[Any], Any]
    unpack: Callable[[Any], Any]


BODIES: dict[str, _Body] = {
    COMPLETION: _Body(
        partial(parse_request, COMPLETION), ParsedRequest.pack, partial(ParsedRequest.unpack, COMPLETION)
    ),
    CHAT: _Body(partial(parse_request, CHAT), ParsedRequest.pack, partial(ParsedRequest.unpack, CHAT)),
    RESPONSE: _Body(parse_responses, ResponsesRequest.pack, ResponsesRequest.unpack),
    TOKENIZE: _Body(parse_tokenize, lambda m: m.SerializeToString(), worker_pb2.TokenizeRequest.FromString),
    DETOKENIZE: _Body(parse_detokenize, lambda m: m.SerializeToString(), worker_pb2.DetokenizeRequest.FromString),
}


def parse_body(kind: str, raw: bytes, model_name: str, request_id: str) -> tuple[Any, ...]:
    """The parse of a raw body of endpoint `kind` (`BODIES`), in the parser process: ("ok", packed
    request) or ("error", status, message, param). Only bytes and small values cross back."""
    body = BODIES[kind]
    try:
        parsed = body.parse(_load_json(raw), model_name, request_id)
    except OpenAIError as exc:
        return ("error", exc.status, exc.message, exc.param)
    return ("ok", body.pack(parsed))


_parser: concurrent.futures.ProcessPoolExecutor | None = None


async def _parse_elsewhere(kind: str, raw: bytes, model_name: str, request_id: str) -> Any:  # noqa: ANN401
    """`parse_body` of a large body in a parser process (started on first use, one for the router)."""
    global _parser
    if _parser is None:
        _parser = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_parser.shutdown, wait=False)  # before interpreter teardown, not during it
    try:
        answer = await asyncio.wrap_future(_parser.submit(parse_body, kind, raw, model_name, request_id))
    except concurrent.futures.process.BrokenProcessPool:
        _parser = None  # it died (out of memory, killed): the next large body starts another
        raise OpenAIError(503, "the request parser process stopped; try again") from None
    if answer[0] == "error":
        raise OpenAIError(answer[1], answer[2], param=answer[3])
    return BODIES[kind].unpack(answer[1])


def _request_id(request: web.Request) -> str:
    """The client's X-Request-Id (or a new one); OpenAIError 400 when it is not printable ASCII."""
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not is_printable_ascii(request_id):
        raise OpenAIError(400, f"X-Request-Id: must be printable ASCII of at most {MAX_REQUEST_ID_CHARS} characters")
    return request_id


async def _read_body(request: web.Request, kind: str, model_name: str, request_id: str) -> Any:  # noqa: ANN401
    """The request's body, parsed as endpoint `kind`'s (`BODIES`); OpenAIError for a bad one."""
    try:
        raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except (asyncio.TimeoutError, TimeoutError):
        raise OpenAIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s") from None
    if len(raw) <= INLINE_PARSE_BYTES:
        return BODIES[kind].parse(_load_json(raw), model_name, request_id)
    # JSON and its checks (a million token ids or keys) in another process: json.loads holds the GIL
    # throughout, so a thread would still freeze the loop that relays every stream
    return await _parse_elsewhere(kind, raw, model_name, request_id)


TRIM_DELAY_S = 0.2  # after a large body's answer: time for aiohttp to write it and drop the request
_trims: set[asyncio.Task] = set()


async def _handled(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`handler`'s answer; after a large body, the heap is trimmed once the answer is out: its raw
    bytes, text, parsed fields and request message (four copies of up to 16 MiB) are garbage then,
    and glibc otherwise keeps their pages (256 chat messages near the limit left the router 80 MB
    larger)."""
    try:
        return await handler(request)
    finally:
        if (request.content_length or 0) > INLINE_PARSE_BYTES:
            task = asyncio.get_running_loop().create_task(_trim_later())
            _trims.add(task)
            task.add_done_callback(_trims.discard)


async def _trim_later() -> None:
    await asyncio.sleep(TRIM_DELAY_S)
    await asyncio.to_thread(trim_heap)  # malloc_trim through ctypes: the GIL is released meanwhile


class OpenAIHttpServer:
    """Serves the OpenAI API on ``host:port`` from a `RouterCore`; start and stop on the core's loop."""

    def __init__(
        self,
        core: RouterCore,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        auth_token: str | Mapping[str, str | None] | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        max_connections: int | None = None,
    ) -> None:
        self._core = core
        self.model_name = model_name
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._token = BearerToken(auth_token) if auth_token else None
        self._tls = (tls_cert_file, tls_key_file) if tls_cert_file and tls_key_file else None
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self.max_connections = max_connections or default_max_connections()
        self.site: _CappedSite | None = None
        self.responses = ResponseStore()
        self._tokenizer = TokenizerRelay(core.pool, core.worker_stub, core.internal_metadata)

    # ----- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind and serve; return the bound port (OSError when it cannot bind)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat_completions),
                web.post("/v1/responses", self._create_response),
                web.get("/v1/responses/{response_id}", self._get_response),
                web.delete("/v1/responses/{response_id}", self._delete_response),
                web.get("/v1/models", self._models),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.get("/health", self._health),
            ]
        )
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=KEEPALIVE_S)
        await self._runner.setup()
        self.site = _CappedSite(self._runner, self.host, self.port, self._ssl_context(), self.max_connections)
        await self.site.start()
        self.port = int(self._runner.addresses[0][1])
        scheme = "https" if self._tls else "http"
        log.info(
            "OpenAI-compatible HTTP API on %s://%s:%d/v1 (model %s)", scheme, self.host, self.port, self.model_name
        )
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
        if self._token is None or request.path == "/health":
            return await _handled(request, handler)
        tenant = self._token.tenant_of(request.headers.get("Authorization"))
        if tenant is not None:
            request[TENANT_KEY] = tenant
            return await _handled(request, handler)
        return _error_response(OpenAIError(401, "missing or wrong bearer token (header 'Authorization')"))

    async def _models(self, _request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "pdserve"}
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, _request: web.Request) -> web.Response:
        status = self._core.status()
        serving = [w for w in status.workers if w.healthy and w.role in SERVING_ROLES]
        body = {
            "status": "ok" if serving else "unavailable",
            "healthy_workers": len(serving),
            "queued_requests": status.queued_requests,
        }
        return web.json_response(body, status=200 if serving else 503)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETION)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            request_id = _request_id(request)
        except OpenAIError as exc:
            return _error_response(exc)
        try:
            parsed: ParsedRequest = await _read_body(request, kind, self.model_name, request_id)
        except OpenAIError as exc:
            return _error_response(exc, request_id)
        responses = self._core.generate(parsed.grpc_request, self.timeout_s, request.get(TENANT_KEY) or None)
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

    # ----- the Responses API (router/responses_api.py) --------------------------------------------
    async def _create_response(self, request: web.Request) -> web.StreamResponse:
        try:
            request_id = _request_id(request)
        except OpenAIError as exc:
            return _error_response(exc)
        tenant = request.get(TENANT_KEY) or ""
        try:
            parsed: ResponsesRequest = await _read_body(request, RESPONSE, self.model_name, request_id)
            previous = self._previous_conversation(parsed, tenant)
        except OpenAIError as exc:
            return _error_response(exc, request_id)
        turn = responses_api.continue_conversation(parsed, previous)
        responses = self._core.generate(parsed.chat.grpc_request, self.timeout_s, tenant or None)
        try:
            if parsed.chat.stream:
                return await self._stream_response(request, parsed, responses, previous + turn, tenant)
            text, reason, usage_ = await responses_api.collect(responses)
            answer = responses_api.answer(parsed, self.model_name, text, reason, usage_)
            body = json.dumps(answer, ensure_ascii=False)
            self._keep(parsed, tenant, answer, len(body), previous + turn)
            return web.Response(text=body, content_type="application/json", headers={"X-Request-Id": request_id})
        except RouterError as exc:
            return _error_response(
                responses_api.renamed(error_from_grpc(exc.code, exc.details)), request_id, exc.retry_after_s
            )
        except OpenAIError as exc:
            return _error_response(exc, request_id)
        finally:
            await responses.aclose()  # frees the workers when the client left early

    def _previous_conversation(self, parsed: ResponsesRequest, tenant: str) -> tuple[common_pb2.ChatMessage, ...]:
        previous_id = parsed.options.previous_response_id
        if previous_id is None:
            return ()
        stored = self.responses.get(previous_id, tenant)
        if stored is None:
            raise OpenAIError(
                400,
                f"previous_response_id: no stored response {previous_id!r} (responses are kept "
                f"in the router's memory, the last {self.responses.max_responses} at most, and "
                "only with store=true)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return stored.conversation

    def _keep(
        self,
        parsed: ResponsesRequest,
        tenant: str,
        answer: dict[str, Any],
        answer_bytes: int,
        conversation: tuple[common_pb2.ChatMessage, ...],
    ) -> None:
        """Store a finished response (with `store`), its conversation continued by its output."""
        if parsed.options.store:
            turn = responses_api.output_turn(answer["output"])
            self.responses.put(answer["id"], tenant, answer, answer_bytes, (*conversation, turn))

    async def _stream_response(
        self,
        request: web.Request,
        parsed: ResponsesRequest,
        responses: AsyncIterator[router_pb2.GenerateResponse],
        conversation: tuple[common_pb2.ChatMessage, ...],
        tenant: str,
    ) -> web.StreamResponse:
        first = await anext(responses, None)  # errors before the first token still get a plain error answer
        out = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": parsed.chat.grpc_request.request_id,
            }
        )
        await out.prepare(request)
        stream = responses_api.ResponseStream(parsed, self.model_name)
        async with aclosing(stream.events(first, responses)) as events:
            async for event in events:
                data = json.dumps(event, ensure_ascii=False)
                await out.write(f"event: {event['type']}\ndata: {data}\n\n".encode())
        if stream.answer is not None:
            self._keep(parsed, tenant, stream.answer, len(json.dumps(stream.answer, ensure_ascii=False)), conversation)
        await out.write_eof()
        return out

    async def _get_response(self, request: web.Request) -> web.Response:
        stored = self.responses.get(request.match_info["response_id"], request.get(TENANT_KEY) or "")
        if stored is None:
            return _error_response(_no_stored_response(request.match_info["response_id"]))
        return web.json_response(stored.answer)

    async def _delete_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.responses.delete(response_id, request.get(TENANT_KEY) or ""):
            return _error_response(_no_stored_response(response_id))
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    # ----- vLLM's tokenizer endpoints (router/tokenize_api.py) --------------------------------------
    async def _tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_call(request, TOKENIZE, self._tokenizer.tokenize, tokenize_answer)

    async def _detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_call(request, DETOKENIZE, self._tokenizer.detokenize, detokenize_answer)

    async def _tokenizer_call(
        self,
        request: web.Request,
        kind: str,
        call: Callable[[Any], Awaitable[Any]],
        shape: Callable[[Any], dict[str, Any]],
    ) -> web.Response:
        try:
            request_id = _request_id(request)
        except OpenAIError as exc:
            return _error_response(exc)
        try:
            answer = await call(await _read_body(request, kind, self.model_name, request_id))
        except OpenAIError as exc:
            return _error_response(exc, request_id)
        except RouterError as exc:
            return _router_error(exc, request_id)
        return web.json_response(shape(answer), headers={"X-Request-Id": request_id})

    # ----- relaying -------------------------------------------------------------------------------
    async def _collect(
        self, parsed: ParsedRequest, responses: AsyncIterator[router_pb2.GenerateResponse]
    ) -> web.Response:
        n = parsed.n
        texts: list[list[str]] = [[] for _ in range(n)]
        entries: list[list[common_pb2.TokenLogprob]] = [[] for _ in range(n)]
        prompt_entries: list[common_pb2.TokenLogprob] = []
        reasons: list[str | None] = [None] * n
        usages: list[dict[str, int]] = [{}] * n
        left = n
        async for response in responses:
            i = response.index
            texts[i].append(response.text)
            entries[i].extend(response.logprobs)
            if response.prompt_logprobs and not prompt_entries:
                prompt_entries.extend(response.prompt_logprobs)
            reason = finish_reason(response)
            if reason is not None:
                reasons[i], usages[i] = reason, usage(response)
                left -= 1
                if not left:
                    break
        else:
            raise OpenAIError(500, "the generation ended without a finish reason")
        choices = []
        for i in range(n):
            text: str | None = "".join(texts[i])
            choice_entries, reason = entries[i], reasons[i]
            if parsed.drop_output:  # `max_tokens: 0`: the one generated token is not part of the answer
                text, choice_entries = "", []
                usages[i].update(completion_tokens=0, total_tokens=usages[i]["prompt_tokens"])
            if parsed.echo:
                prompt = parsed.grpc_request.prompt or "".join(e.token for e in prompt_entries)
                text = prompt + (text or "")
                choice_entries = prompt_entries + choice_entries
            calls: list[dict[str, Any]] = []
            if parsed.tools is not None:
                text, calls = tools.parse_output(parsed.tools, text or "")
                reason = tools.finish_reason(parsed.tools, len(calls), reason or "stop")
            logprobs = answer_logprobs(parsed.kind, choice_entries) if parsed.logprobs else None
            choices.append(answer_choice(parsed.kind, i, text, reason, logprobs, calls))
        answer = full_answer(parsed.kind, parsed.grpc_request.request_id, self.model_name, choices, total_usage(usages))
        return web.json_response(answer, headers={"X-Request-Id": parsed.grpc_request.request_id})

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, responses: AsyncIterator[router_pb2.GenerateResponse]
    ) -> web.StreamResponse:
        first = await anext(responses, None)  # errors before the first token still get a plain error answer
        request_id, kind, n = parsed.grpc_request.request_id, parsed.kind, parsed.n
        created = int(time.time())
        out = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": request_id}
        )
        await out.prepare(request)
        send = _EventWriter(out)

        def event(
            index: int,
            text: str | None,
            reason: str | None,
            logprobs: dict[str, Any] | None = None,
            calls: list[dict[str, Any]] | None = None,
            role: bool = False,
        ) -> dict[str, Any]:
            return chunk(
                kind,
                request_id,
                self.model_name,
                created,
                text,
                reason,
                role=role,
                logprobs=logprobs,
                index=index,
                tool_calls=calls,
            )

        parsers = [tools.ToolStream(parsed.tools) for _ in range(n)] if parsed.tools is not None else None
        try:
            if kind == CHAT:
                for i in range(n):
                    await send.data(event(i, "", None, role=True))
            response = first
            offsets = [0] * n  # characters streamed so far per choice (completions' text_offset)
            usages: list[dict[str, int]] = []
            while response is not None:
                i = response.index
                reason = finish_reason(response)
                text: str | None = response.text
                calls: list[dict[str, Any]] = []
                if parsers is not None:
                    text, calls = parsers[i].feed(response.text)
                    if reason is not None:
                        more, rest = parsers[i].finish()
                        text, calls = text + more, calls + rest
                        reason = tools.finish_reason(parsers[i].mode, parsers[i].calls, reason)
                if text or calls or reason is not None or response.logprobs:
                    logprobs = answer_logprobs(kind, list(response.logprobs), offsets[i]) if parsed.logprobs else None
                    offsets[i] += len(response.text)
                    await send.data(event(i, text if text or kind != CHAT else None, reason, logprobs, calls))
                if reason is not None:
                    usages.append(usage(response))
                    if len(usages) == n:
                        if parsed.include_usage:
                            await send.data(
                                usage_chunk(kind, request_id, self.model_name, created, total_usage(usages))
                            )
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


def _no_stored_response(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"no stored response {response_id!r}", param="response_id", code="response_not_found")


class _EventWriter:
    """Writes server-sent events ``data: <json>\\n\\n``; a vanished client raises ConnectionResetError."""

    def __init__(self, out: web.StreamResponse) -> None:
        self._out = out

    async def data(self, obj: dict[str, Any]) -> None:
        await self._out.write(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())

    async def done(self) -> None:
        await self._out.write(b"data: [DONE]\n\n")
        await self._out.write_eof()
