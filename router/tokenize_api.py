"""vLLM's tokenizer endpoints on the HTTP API, ``POST /tokenize`` and ``POST /detokenize``: their
request and answer shapes, and the worker that answers them.

Shapes (vLLM's):
- tokenize ``{"model", "prompt", "add_special_tokens": true}`` or ``{"model", "messages",
  "add_generation_prompt": true, "add_special_tokens": false, "tools"}`` -> ``{"tokens": [...],
  "count": N, "max_model_len": M}``. The ids are those a generation of the same prompt or chat is
  given (the worker tokenizes with Generate's own functions), so ``count`` of a chat equals its
  ``usage.prompt_tokens``.
- detokenize ``{"model", "tokens"}`` -> ``{"prompt": "..."}`` (special tokens written out).

The router has no tokenizer: `TokenizerRelay` asks a healthy serving (decode or colocated) worker,
the one with the fewest requests in flight, and the next one when that one is unavailable. Input is
checked here as a generation's is (the same size limits, roles and message shapes); every other
field is refused by name, as on the other endpoints.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from pdserve.router.core import RouterError
from pdserve.router.openai_protocol import OpenAIError, chat_messages, check_model
from pdserve.router.policies import COLOCATED, DECODE
from pdserve.router.tools import ToolError, parse_tools
from pdserve.router.validation import MAX_PROMPT_TOKEN_IDS, InvalidRequest, validate_generate_request
from pdserve.router.worker_pool import WorkerPool
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

TOKENIZE, DETOKENIZE = "tokenize", "detokenize"
CALL_TIMEOUT_S = 60.0
_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
MAX_INT32 = 2**31 - 1
Answer = TypeVar("Answer")


def _check_fields(body: object, known: frozenset[str], model_name: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    check_model(body.get("model"), model_name)
    for name in sorted(set(body) - known):
        raise OpenAIError(400, f"{name}: unknown or unsupported parameter", param=name)
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise OpenAIError(400, f"{name}: must be a boolean, got {value!r}", param=name)
    return value


def parse_tokenize(body: object, model_name: str, _request_id: str = "") -> worker_pb2.TokenizeRequest:
    """A /tokenize body as a TokenizeRequest; OpenAIError names the first bad field."""
    body = _check_fields(body, _TOKENIZE_FIELDS, model_name)
    if ("prompt" in body) == ("messages" in body):
        raise OpenAIError(400, "prompt: give either prompt or messages", param="prompt")
    check = router_pb2.GenerateRequest()  # checked as a generation of the same input would be
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise OpenAIError(400, "prompt: must be a string", param="prompt")
        for name in ("add_generation_prompt", "tools"):
            if name in body:
                raise OpenAIError(400, f"{name}: only with messages", param=name)
        check.prompt = body["prompt"]
        request = worker_pb2.TokenizeRequest(
            prompt=check.prompt, add_special_tokens=_flag(body, "add_special_tokens", True)
        )
    else:
        check.messages.CopyFrom(chat_messages(body["messages"]))
        try:
            parse_tools({"tools": body.get("tools")}, check.messages, common_pb2.SamplingParams())
        except ToolError as exc:
            raise OpenAIError(400, f"{exc.param}: {exc}", param=exc.param) from None
        request = worker_pb2.TokenizeRequest(
            messages=check.messages,
            add_special_tokens=_flag(body, "add_special_tokens", False),
            add_generation_prompt=_flag(body, "add_generation_prompt", True),
        )
    try:
        validate_generate_request(check)
    except InvalidRequest as exc:
        raise OpenAIError(400, str(exc), param=exc.field.split(".", 1)[0].split("[", 1)[0]) from None
    return request


def parse_detokenize(body: object, model_name: str, _request_id: str = "") -> worker_pb2.DetokenizeRequest:
    """A /detokenize body as a DetokenizeRequest; OpenAIError names the first bad field."""
    body = _check_fields(body, _DETOKENIZE_FIELDS, model_name)
    tokens = body.get("tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) > MAX_PROMPT_TOKEN_IDS
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32 for t in tokens)
    ):
        raise OpenAIError(
            400,
            f"tokens: must be a list of at most {MAX_PROMPT_TOKEN_IDS} token ids (integers in [0, {MAX_INT32}])",
            param="tokens",
        )
    return worker_pb2.DetokenizeRequest(tokens=tokens)


def tokenize_answer(answer: worker_pb2.TokenizeResponse) -> dict[str, Any]:
    return {"tokens": list(answer.tokens), "count": len(answer.tokens), "max_model_len": answer.max_model_len}


def detokenize_answer(answer: worker_pb2.DetokenizeResponse) -> dict[str, Any]:
    return {"prompt": answer.prompt}


class TokenizerRelay:
    """Sends Tokenize and Detokenize to a serving worker. `stub_of` gives the router's (cached)
    DecodeWorker stub of an address; `metadata` is the internal credential."""

    def __init__(
        self,
        pool: WorkerPool,
        stub_of: Callable[[str], worker_pb2_grpc.DecodeWorkerStub],
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self._pool = pool
        self._stub_of = stub_of
        self._metadata = metadata
        self._timeout_s = timeout_s

    async def tokenize(self, request: worker_pb2.TokenizeRequest) -> worker_pb2.TokenizeResponse:
        return await self._ask(lambda stub: stub.Tokenize(request, timeout=self._timeout_s, metadata=self._metadata))

    async def detokenize(self, request: worker_pb2.DetokenizeRequest) -> worker_pb2.DetokenizeResponse:
        return await self._ask(lambda stub: stub.Detokenize(request, timeout=self._timeout_s, metadata=self._metadata))

    async def _ask(self, call: Callable[[worker_pb2_grpc.DecodeWorkerStub], Awaitable[Answer]]) -> Answer:
        """The answer of the least busy healthy serving worker; the next one when it is unavailable.
        RouterError with the worker's status otherwise (UNAVAILABLE when no worker serves)."""
        workers = sorted(
            (c for c in self._pool.candidates((DECODE, COLOCATED)) if c.healthy), key=lambda c: c.in_flight
        )
        last = RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy decode or colocated worker to tokenize with")
        for worker in workers:
            try:
                return await call(self._stub_of(worker.address))
            except grpc.aio.AioRpcError as exc:
                last = RouterError(exc.code(), exc.details() or exc.code().name)
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    break
        raise last
