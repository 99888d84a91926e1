"""OpenAI-compatible request/response shapes <-> pdserve.v1 messages (pure functions, no I/O).

Supported: ``/v1/completions`` (prompt: a string, one-string list, token ids or one list of token ids)
and ``/v1/chat/completions`` (text messages), with ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop`` (string or list), ``stream``,
``stream_options.include_usage``, ``n`` (1-128 choices, the prompt prefilled once), ``logprobs``
(completions: 0-20; chat: true plus
``top_logprobs``), ``echo`` (completions, also with ``max_tokens: 0``; not streamed),
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, and the vLLM-style extras ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``, ``min_p``, ``min_tokens``,
``allowed_token_ids``, ``bad_words``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
``include_stop_str_in_output`` and ``cache_salt``; pdserve's scheduling fields ``priority``,
``slo_ttft_ms`` and ``best_effort`` (the gRPC request's fields of those names); structured outputs: ``response_format``
(``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``) and ``guided_json|regex|choice|grammar``; tools on chat completions: ``tools``,
``tool_choice`` (``none``, ``auto``, ``required``, a named function), ``parallel_tool_calls``, and
assistant ``tool_calls`` / ``tool`` messages in the conversation (router/tools.py). The schema is
strict: every other field (``functions``, ``best_of>1``, ``suffix``, unknown keys, unknown
``stream_options`` keys ...) is refused with 400 whose ``param`` names the field, rather than
silently ignored (docs/api.md lists them with the reason). Harmless labels (``user``,
``metadata``) are accepted. The official ``openai`` client sends only the fields its caller passes.

Errors are OpenAIError: HTTP status plus OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.limits import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_N
from pdserve.router.tools import ToolError, ToolMode, parse_tools
from pdserve.router.validation import MAX_PRIORITY
from pdserve.v1 import common_pb2, router_pb2

COMPLETION = "text_completion"
CHAT = "chat.completion"
FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "abort",
}
# Strict schema: every top-level field is either implemented, harmless, or refused with 400 naming it.
# Fields pdserve does not implement are accepted only with their "off" value (what a client that does not
# use the feature may send); any other value is refused rather than silently ignored.
_UNSUPPORTED_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "store": (None, False),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "web_search_options": (None,),
}
# Harmless: accepted and without effect on the answer. ``user`` and ``metadata`` are opaque labels.
# ``stream_options`` is implemented (``include_usage``; other keys are refused).
_IGNORED = frozenset({"model", "user", "stream", "stream_options", "metadata"})
_KNOWN = (
    frozenset(
        {
            "prompt",
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "top_k",
            "ignore_eos",
            "stop_token_ids",
            "logprobs",
            "top_logprobs",
            "echo",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_p",
            "min_tokens",
            "logit_bias",
            "allowed_token_ids",
            "bad_words",
            "skip_special_tokens",
            "cache_salt",
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "n",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "include_stop_str_in_output",
            "spaces_between_special_tokens",
            "priority",
            "slo_ttft_ms",
            "best_effort",
        }
    )
    | _IGNORED
    | frozenset(_UNSUPPORTED_OFF_VALUES)
)
_STREAM_OPTIONS = frozenset({"include_usage"})
MAX_INT32 = 2**31 - 1
MAX_USER_CHARS = 256
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # as OpenAI's API
MAX_LOGPROBS = 20
MAX_SLO_TTFT_MS = 3_600_000  # an hour: beyond it an objective means nothing


class OpenAIError(Exception):
    """An error answer: HTTP ``status`` and OpenAI's error object."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type_: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _ERROR_TYPES.get(status, "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
}
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
}


def error_from_grpc(code: grpc.StatusCode, details: str) -> OpenAIError:
    """Map the router's status to HTTP; a ``params.<field>: ...`` detail names the OpenAI field."""
    status = _GRPC_TO_HTTP.get(code, 500)
    param = None
    if status == 400 and ":" in details:
        field = details.split(":", 1)[0].strip()
        param = field.removeprefix("params.").split("[", 1)[0] or None
    return OpenAIError(status, details or code.name, param=param, code=code.name.lower())


@dataclass(frozen=True)
class ParsedRequest:
    """A validated OpenAI request: the gRPC request to send and how to shape the answer."""

    kind: str  # COMPLETION or CHAT
    grpc_request: router_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: bool = False  # answer with log-probabilities (completions: `logprobs` set; chat: `logprobs: true`)
    echo: bool = False  # completions: the prompt (and its tokens' log-probabilities) before the output
    drop_output: bool = False  # `max_tokens: 0` with echo: one token is generated and not returned
    tools: ToolMode | None = None  # chat with tools: how to read tool calls out of the output

    @property
    def n(self) -> int:
        return max(1, self.grpc_request.params.n)

    def pack(self) -> tuple[bytes, dict[str, Any]]:
        """Bytes and small values (what crosses back from the parser process); `unpack` reverses it."""
        options = {
            "stream": self.stream,
            "include_usage": self.include_usage,
            "logprobs": self.logprobs,
            "echo": self.echo,
            "drop_output": self.drop_output,
            "tools": self.tools,
        }
        return self.grpc_request.SerializeToString(), options

    @classmethod
    def unpack(cls, kind: str, packed: tuple[bytes, dict[str, Any]]) -> ParsedRequest:
        request = router_pb2.GenerateRequest()
        request.ParseFromString(packed[0])
        return cls(kind=kind, grpc_request=request, **packed[1])


def parse_request(kind: str, body: object, model_name: str, request_id: str) -> ParsedRequest:
    """Validate an OpenAI request body; OpenAIError(400/404) names the first bad field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    check_model(body.get("model"), model_name)
    _check_supported(body)
    request = router_pb2.GenerateRequest(request_id=request_id, params=_sampling_params(body))
    _scheduling(body, request)
    tools = None
    if kind == CHAT:
        request.messages.CopyFrom(chat_messages(body.get("messages")))
        try:
            tools = parse_tools(body, request.messages, request.params)
        except ToolError as exc:
            raise OpenAIError(400, f"{exc.param}: {exc}", param=exc.param) from None
    else:
        for name, off in (("tools", (None, [])), ("tool_choice", (None, "none"))):
            if body.get(name) not in off:
                raise OpenAIError(400, f"{name}: tools are a chat completions feature", param=name)
        _set_prompt(request, body.get("prompt"))
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise OpenAIError(400, "stream_options must be an object", param="stream_options")
    for key in sorted(set(options or {}) - _STREAM_OPTIONS):
        raise OpenAIError(400, f"stream_options.{key}: not supported by this server", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    if include_usage and not stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    logprobs, echo, drop_output = _logprob_options(kind, body, request.params, stream)
    return ParsedRequest(kind, request, stream, include_usage, logprobs, echo, drop_output, tools)


def _scheduling(body: dict[str, Any], request: router_pb2.GenerateRequest) -> None:
    """pdserve's scheduling fields, as on gRPC: ``priority`` (admission order), ``slo_ttft_ms`` (this
    request's TTFT objective; 0 or absent: the deployment's) and ``best_effort`` (never refused by
    SLO admission)."""
    priority = _integer(body, "priority", -MAX_PRIORITY, MAX_PRIORITY)
    if priority is not None:
        request.priority = priority
    slo = _integer(body, "slo_ttft_ms", 0, MAX_SLO_TTFT_MS)
    if slo is not None:
        request.slo_ttft_ms = slo
    request.best_effort = _optional_bool(body, "best_effort")


def _logprob_options(
    kind: str, body: dict[str, Any], params: common_pb2.SamplingParams, stream: bool
) -> tuple[bool, bool, bool]:
    """OpenAI's logprobs fields -> SamplingParams.logprobs / prompt_logprobs; (logprobs, echo, drop_output)."""
    if params.HasField("max_tokens") and params.max_tokens == 0 and not (kind == COMPLETION and body.get("echo")):
        raise OpenAIError(400, "max_tokens: 0 is only allowed with echo=true", param="max_tokens")
    if kind == CHAT:
        if body.get("echo") is not None and body.get("echo") is not False:
            raise OpenAIError(400, "echo: not supported on chat completions", param="echo")
        wanted = _optional_bool(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not wanted:
            raise OpenAIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
        if wanted:
            params.logprobs = top or 0
        return wanted, False, False
    if body.get("top_logprobs") is not None:
        raise OpenAIError(400, "top_logprobs: a chat completions field; use logprobs=<int> here", param="top_logprobs")
    num = _integer(body, "logprobs", 0, MAX_LOGPROBS) if body.get("logprobs") is not False else None
    echo = _optional_bool(body, "echo")
    if num is not None:
        params.logprobs = num
    drop_output = False
    if echo:
        if stream:
            raise OpenAIError(400, "echo: not supported with stream=true", param="echo")
        params.prompt_logprobs = num or 0
        drop_output = params.max_tokens == 0
        if drop_output:
            params.max_tokens = 1  # the engine generates at least one token; it is not returned
    return num is not None, echo, drop_output


def check_model(model: object, model_name: str) -> None:
    """400 without a model name, 404 for a model this server does not serve."""
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model: a model name is required", param="model")
    if model != model_name:
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist; this server serves `{model_name}`",
            param="model",
            code="model_not_found",
        )


def _check_supported(body: dict[str, Any]) -> None:
    for name, off_values in _UNSUPPORTED_OFF_VALUES.items():
        if name in body and not any(_same(body[name], off) for off in off_values):
            raise OpenAIError(400, f"{name}: not supported by this server", param=name)
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise OpenAIError(400, f"{unknown[0]}: unknown or unsupported parameter", param=unknown[0])
    _check_labels(body)


def _check_labels(body: dict[str, Any]) -> None:
    """``metadata`` and ``user`` are ignored, so they must stay small (OpenAI's own metadata limits)."""
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise OpenAIError(400, f"user: must be a string of at most {MAX_USER_CHARS} characters", param="user")
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
        raise OpenAIError(400, f"metadata: must be an object of at most {MAX_METADATA_KEYS} keys", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise OpenAIError(
                400,
                f"metadata: keys of at most {MAX_METADATA_KEY_CHARS} characters, values strings "
                f"of at most {MAX_METADATA_VALUE_CHARS}",
                param="metadata",
            )


def _same(value: object, off: object) -> bool:
    """Equal and of the same JSON type (so ``logprobs: 0`` matches 0 but ``True`` does not match 1)."""
    return value == off and (isinstance(value, bool) == isinstance(off, bool))


def _number(body: dict[str, Any], name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OpenAIError(400, f"{name}: must be a number, got {value!r}", param=name)
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise OpenAIError(400, f"{name}: must be in {bracket}{low:g}, {high:g}], got {value!r}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OpenAIError(400, f"{name}: must be an integer in [{low}, {high}], got {value!r}", param=name)
    return value


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(400, f"{name}: must be a boolean, got {value!r}", param=name)
    return bool(value)


def _sampling_params(body: dict[str, Any]) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams()
    max_tokens = _integer(body, "max_completion_tokens", 1, MAX_INT32)
    max_tokens = max_tokens if max_tokens is not None else _integer(body, "max_tokens", 0, MAX_INT32)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        params.temperature = temperature
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    if top_p is not None:
        params.top_p = top_p
    seed = _integer(body, "seed", 0, 2**63 - 1)
    if seed is not None:
        params.seed = seed
    top_k = _integer(body, "top_k", -1, MAX_INT32)
    params.top_k = max(0, top_k or 0)  # vLLM uses -1 for "off"; pdserve uses 0
    params.ignore_eos = _optional_bool(body, "ignore_eos")
    n = _integer(body, "n", 1, MAX_N)
    if n is not None and n > 1:
        params.n = n
    params.include_stop_str_in_output = _optional_bool(body, "include_stop_str_in_output")
    if body.get("spaces_between_special_tokens") is not None:
        params.spaces_between_special_tokens = _optional_bool(body, "spaces_between_special_tokens")
    params.stop.extend(_stop(body.get("stop")))
    params.stop_token_ids.extend(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"))
    _penalties(body, params)
    return params


def _penalties(body: dict[str, Any], params: common_pb2.SamplingParams) -> None:
    """OpenAI's presence/frequency penalties and logit_bias, and vLLM's repetition_penalty, min_p and
    min_tokens (neutral values leave the field unset)."""
    for name, low, high, neutral in (
        ("presence_penalty", -2.0, 2.0, 0.0),
        ("frequency_penalty", -2.0, 2.0, 0.0),
        ("min_p", 0.0, 1.0, 0.0),
    ):
        value = _number(body, name, low, high)
        if value is not None and value != neutral:
            setattr(params, name, value)
    repetition = _number(body, "repetition_penalty", 0.0, 2.0, low_open=True)
    if repetition is not None and repetition != 1.0:
        params.repetition_penalty = repetition
    min_tokens = _integer(body, "min_tokens", 0, MAX_INT32)
    if min_tokens:
        params.min_tokens = min_tokens
    params.allowed_token_ids.extend(_token_ids(body.get("allowed_token_ids") or [], "allowed_token_ids"))
    bad_words = body.get("bad_words")
    if bad_words is not None and not (isinstance(bad_words, list) and all(isinstance(w, str) for w in bad_words)):
        raise OpenAIError(400, "bad_words: must be a list of strings", param="bad_words")
    params.bad_words.extend(bad_words or [])
    if body.get("skip_special_tokens") is not None:
        params.skip_special_tokens = _optional_bool(body, "skip_special_tokens")
    _structured(body, params)
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str):
            raise OpenAIError(400, "cache_salt: must be a string", param="cache_salt")
        params.cache_salt = salt
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise OpenAIError(
            400, f"logit_bias: must be an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids", param="logit_bias"
        )
    for key, value in bias.items():
        token = str(key)
        if not token.isdigit() or int(token) > MAX_INT32:
            raise OpenAIError(400, f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
        ):
            raise OpenAIError(
                400, f"logit_bias[{token}]: must be a number in [-100, 100], got {value!r}", param="logit_bias"
            )
        params.logit_bias[int(token)] = float(value)


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured(body: dict[str, Any], params: common_pb2.SamplingParams) -> None:
    """Structured outputs: OpenAI's `response_format` (json_object, json_schema), vLLM's
    `structured_outputs` {json, regex, choice, grammar} and its older `guided_*` fields; one at most."""
    given: list[tuple[str, str, object]] = []  # (field, kind, value)
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in (
            "text",
            "json_object",
            "json_schema",
        ):
            raise OpenAIError(
                400, "response_format: type must be text, json_object or json_schema", param="response_format"
            )
        if response_format["type"] == "json_object":
            given.append(("response_format", "json_object", True))
        elif response_format["type"] == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise OpenAIError(
                    400, "response_format.json_schema.schema: must be a JSON Schema object", param="response_format"
                )
            given.append(("response_format", "json", schema))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise OpenAIError(400, "structured_outputs: must be an object", param="structured_outputs")
        for key in sorted(set(outputs) - {"json", "regex", "choice", "grammar"}):
            raise OpenAIError(
                400, f"structured_outputs.{key}: not supported by this server", param="structured_outputs"
            )
        given += [("structured_outputs", kind, value) for kind, value in outputs.items() if value is not None]
    given += [(name, kind, body[name]) for name, kind in _GUIDED.items() if body.get(name) is not None]
    if not given:
        return
    if len(given) > 1:
        raise OpenAIError(400, f"{given[1][0]}: only one structured-output constraint per request", param=given[1][0])
    name, kind, value = given[0]
    target = params.structured
    if kind == "json_object":
        target.json_object = True
    elif kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise OpenAIError(400, f"{name}: the JSON schema is not valid JSON: {exc}", param=name) from None
        if not isinstance(value, dict):
            raise OpenAIError(400, f"{name}: must be a JSON Schema object", param=name)
        target.json_schema = json.dumps(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise OpenAIError(400, f"{name}: must be a non-empty list of non-empty strings", param=name)
        target.choice.choices.extend(value)
    else:
        if not isinstance(value, str) or not value:
            raise OpenAIError(400, f"{name}: must be a non-empty string", param=name)
        setattr(target, kind, value)


def _stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise OpenAIError(400, "stop: must be a string or a list of strings", param="stop")


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT32


def _token_ids(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
        raise OpenAIError(400, f"{name}: must be a list of token ids (integers in [0, {MAX_INT32}])", param=name)
    return list(value)


def _set_prompt(request: router_pb2.GenerateRequest, prompt: object) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(_is_token_id(t) for t in prompt):
            raise OpenAIError(400, f"prompt: token ids must be integers in [0, {MAX_INT32}]", param="prompt")
        request.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise OpenAIError(
            400, "prompt: batches of several prompts are not supported; send one per request", param="prompt"
        )
    else:
        raise OpenAIError(400, "prompt: must be a string or a list of token ids", param="prompt")


def chat_messages(messages: object) -> common_pb2.ChatMessages:
    """A chat completions' ``messages`` list as ChatMessages (developer turns become system turns)."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages: must be a non-empty list", param="messages")
    chat = common_pb2.ChatMessages()
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OpenAIError(400, f"messages[{i}]: must be an object with a role", param="messages")
        role = "system" if message["role"] == "developer" else message["role"]
        turn = chat.messages.add(role=role, content=_content(message.get("content"), i))
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list) or not all(_is_call(c) for c in calls):
                raise OpenAIError(
                    400,
                    f"messages[{i}].tool_calls: an assistant turn's list of "
                    '{"id", "type": "function", "function": {"name", "arguments"}}',
                    param="messages",
                )
            turn.tool_calls_json = json.dumps(calls, ensure_ascii=False)
        for name in ("tool_call_id", "name"):
            value = message.get(name)
            if value is not None:
                if not isinstance(value, str) or len(value) > 256:
                    raise OpenAIError(
                        400, f"messages[{i}].{name}: must be a string of at most 256 characters", param="messages"
                    )
                setattr(turn, name, value)
    return chat


def _is_call(call: object) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments", ""), (str, dict))
    )


def _content(content: object, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(400, f"messages[{i}].content: must be a string or a list of text parts", param="messages")


# ----- answers --------------------------------------------------------------------------------
def finish_reason(response: router_pb2.GenerateResponse) -> str | None:
    """OpenAI's finish_reason of a final response; raises OpenAIError(500) for a worker-side error."""
    if response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    if response.finish_reason == common_pb2.FINISH_REASON_ERROR:
        raise OpenAIError(500, response.error or "generation failed", code="generation_error")
    return FINISH_REASONS.get(response.finish_reason, "stop")


def usage(response: router_pb2.GenerateResponse) -> dict[str, Any]:
    prompt, completion = response.usage.prompt_tokens, response.usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": response.usage.cached_tokens},
    }


def response_id(kind: str, request_id: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{request_id}"


def completion_logprobs(entries: list[common_pb2.TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """/v1/completions' ``logprobs`` object; ``offset``: characters of text before the first entry.
    ``top_logprobs`` maps each alternative's text to its logprob, the chosen token included (as vLLM)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        tokens.append(entry.token)
        offsets.append(offset)
        offset += len(entry.token)
        if entry.HasField("logprob"):
            values.append(entry.logprob)
            top = {t.token: t.logprob for t in entry.top}
            top.setdefault(entry.token, entry.logprob)
            tops.append(top)
        else:  # the first prompt token: nothing predicts it
            values.append(None)
            tops.append(None)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
    """/v1/chat/completions' ``logprobs`` object."""

    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = [{**item(e.token, e.logprob), "top_logprobs": [item(t.token, t.logprob) for t in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def answer_logprobs(kind: str, entries: list[common_pb2.TokenLogprob], offset: int = 0) -> dict[str, Any]:
    return chat_logprobs(entries) if kind == CHAT else completion_logprobs(entries, offset)


def answer_choice(
    kind: str,
    index: int,
    text: str | None,
    reason: str | None,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One choice of a non-streaming answer (chat: `text` None with tool calls)."""
    if kind == CHAT:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def full_answer(
    kind: str, request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, int]
) -> dict[str, Any]:
    """The non-streaming answer object."""
    return {
        "id": response_id(kind, request_id),
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def total_usage(usages: list[dict[str, int]]) -> dict[str, int]:
    """The usage of n choices: the prompt once, every choice's completion tokens."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    return {**first, "completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion}


def chunk(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    text: str | None,
    reason: str | None,
    role: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed chunk (``text`` None with ``role`` True: the chat opening chunk)."""
    if kind == CHAT:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        obj = COMPLETION
    return {"id": response_id(kind, request_id), "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, request_id: str, model: str, created: int, usage_: dict[str, int]) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == CHAT else COMPLETION
    return {
        "id": response_id(kind, request_id),
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }
