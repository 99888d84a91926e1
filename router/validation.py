"""Validation of client GenerateRequests (the table is in docs/validation.md).

Invariants: side-effect free; the first violation found raises InvalidRequest whose message starts with
the offending field path (``params.top_p: must be in (0, 1], got 1.5``). Invalid UTF-8 never reaches
this code: protobuf refuses to parse a ``string`` field holding invalid UTF-8, so grpc fails such a call
before the servicer runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdserve.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_REQUEST_BYTES,
    MAX_STRUCTURED_CHARS,
)
from pdserve.v1 import common_pb2, router_pb2

MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
MAX_PRIORITY = 100  # |priority|: a small ladder of classes, not an open-ended queue jump
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 256
MAX_CONTENT_CHARS = 1_000_000
MAX_PROMPT_TOKEN_IDS = 1_000_000
ROLES = ("system", "user", "assistant", "tool")
MAX_TOKENS_LIMIT = 1_000_000
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
SEED_LIMIT = 2**63


class InvalidRequest(ValueError):
    """A request field violates the contract; ``str(error)`` is ``"<field>: <reason>"``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def validate_generate_request(request: router_pb2.GenerateRequest) -> None:
    """Raise InvalidRequest for the first invalid field of ``request``; return None when it is valid."""
    _check_size(request)
    _check_request_id(request.request_id)
    if not -MAX_PRIORITY <= request.priority <= MAX_PRIORITY:
        raise InvalidRequest("priority", f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {request.priority}")
    _check_input(request)
    if request.HasField("params"):
        check_params(request.params)


def _check_size(request: router_pb2.GenerateRequest) -> None:
    size = request.ByteSize()
    if size > MAX_REQUEST_BYTES:
        raise InvalidRequest(
            "request",
            f"at most {MAX_REQUEST_BYTES} bytes serialized (the request-size limit, "
            f"{MAX_REQUEST_BYTES // (1024 * 1024)} MiB), got {size}",
        )


def is_printable_ascii(text: str) -> bool:
    return all(0x20 <= ord(ch) <= 0x7E for ch in text)


def _check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    if not is_printable_ascii(request_id):
        raise InvalidRequest("request_id", "must be printable ASCII")


def _check_input(request: router_pb2.GenerateRequest) -> None:
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("input", "exactly one of prompt, messages, token_ids must be set")
    if kind == "prompt":
        _check_prompt(request.prompt)
    elif kind == "messages":
        _check_messages(request.messages)
    else:
        _check_token_ids(request.token_ids)


def _check_prompt(prompt: str) -> None:
    if not prompt.strip():
        raise InvalidRequest("prompt", "must not be empty or whitespace only")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequest("prompt", f"at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}")


def _check_messages(chat: common_pb2.ChatMessages) -> None:
    count = len(chat.messages)
    if not 1 <= count <= MAX_MESSAGES:
        raise InvalidRequest("messages", f"must hold 1..{MAX_MESSAGES} messages, got {count}")
    for i, message in enumerate(chat.messages):
        if message.role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {message.role!r}")
        if len(message.content) > MAX_CONTENT_CHARS:
            raise InvalidRequest(
                f"messages[{i}].content", f"at most {MAX_CONTENT_CHARS} characters, got {len(message.content)}"
            )


def _check_token_ids(token_ids: common_pb2.TokenIds) -> None:
    if not token_ids.ids:
        raise InvalidRequest("token_ids", "must not be empty")
    if len(token_ids.ids) > MAX_PROMPT_TOKEN_IDS:
        raise InvalidRequest("token_ids", f"at most {MAX_PROMPT_TOKEN_IDS} ids, got {len(token_ids.ids)}")
    _check_non_negative("token_ids", token_ids.ids)


def _check_non_negative(field: str, values: Sequence[int]) -> None:
    if not values or min(values) >= 0:  # one C-level pass: a million ids must not hold the event loop
        return
    i, value = next((i, v) for i, v in enumerate(values) if v < 0)
    raise InvalidRequest(f"{field}[{i}]", f"must be >= 0, got {value}")


MAX_CHOICES = 256


def _check_structured(structured: common_pb2.StructuredOutput) -> None:
    """Sizes only: whether a schema, regex or grammar compiles is the worker's (it has the tokenizer)."""
    kind = structured.WhichOneof("kind")
    if kind in ("json_schema", "regex", "grammar"):
        text = getattr(structured, kind)
        if not text or len(text) > MAX_STRUCTURED_CHARS:
            raise InvalidRequest(f"params.structured.{kind}", f"1..{MAX_STRUCTURED_CHARS} characters")
    elif kind == "choice":
        choices = structured.choice.choices
        if not 1 <= len(choices) <= MAX_CHOICES or any(not c or len(c) > 1024 for c in choices):
            raise InvalidRequest(
                "params.structured.choice", f"1..{MAX_CHOICES} non-empty strings of at most 1024 characters"
            )


def check_params(params: common_pb2.SamplingParams) -> None:
    """Raise InvalidRequest (field path ``params.<name>``) for the first invalid sampling parameter."""
    _check_scalars(params)
    _check_stop(params)
    _check_non_negative("params.stop_token_ids", list(params.stop_token_ids))


def _check_scalars(params: common_pb2.SamplingParams) -> None:
    if params.HasField("max_tokens") and not 1 <= params.max_tokens <= MAX_TOKENS_LIMIT:
        raise InvalidRequest("params.max_tokens", f"must be in [1, {MAX_TOKENS_LIMIT}], got {params.max_tokens}")
    if params.HasField("temperature") and not 0.0 <= params.temperature <= MAX_TEMPERATURE:
        raise InvalidRequest("params.temperature", f"must be in [0, 100], got {params.temperature}")
    if params.HasField("top_p") and not (0.0 < params.top_p <= 1.0 and math.isfinite(params.top_p)):
        raise InvalidRequest("params.top_p", f"must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise InvalidRequest("params.top_k", f"must be >= 0, got {params.top_k}")
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name) and not 0 <= getattr(params, name) <= 20:
            raise InvalidRequest(f"params.{name}", f"must be in [0, 20], got {getattr(params, name)}")
    if params.HasField("seed") and params.seed >= SEED_LIMIT:
        raise InvalidRequest("params.seed", f"must be < 2**63, got {params.seed}")
    if not 0 <= params.n <= MAX_N:
        raise InvalidRequest("params.n", f"must be in [1, {MAX_N}] (0: one), got {params.n}")
    if params.n > 1 and params.HasField("seed") and params.seed + params.n > SEED_LIMIT:
        raise InvalidRequest("params.seed", f"choice i uses seed + i: must be < 2**63 - n, got {params.seed}")
    _check_penalties(params)


def _check_penalties(params: common_pb2.SamplingParams) -> None:
    for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
        value = getattr(params, name)
        if params.HasField(name) and not (low <= value <= high and math.isfinite(value)):
            raise InvalidRequest(f"params.{name}", f"must be in [{low:g}, {high:g}], got {value}")
    if params.HasField("repetition_penalty") and not (0.0 < params.repetition_penalty <= 2.0):
        raise InvalidRequest("params.repetition_penalty", f"must be in (0, 2], got {params.repetition_penalty}")
    max_tokens = params.max_tokens if params.HasField("max_tokens") else 16
    if not 0 <= params.min_tokens <= max_tokens:
        raise InvalidRequest("params.min_tokens", f"must be in [0, max_tokens={max_tokens}], got {params.min_tokens}")
    if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(
            "params.logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(params.logit_bias)}"
        )
    for token, bias in params.logit_bias.items():
        if token < 0:
            raise InvalidRequest("params.logit_bias", f"token ids must be >= 0, got {token}")
        if not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS and math.isfinite(bias)):
            raise InvalidRequest("params.logit_bias", f"bias of token {token} must be in [-100, 100], got {bias}")
    if len(params.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidRequest(
            "params.allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(params.allowed_token_ids)}"
        )
    _check_non_negative("params.allowed_token_ids", list(params.allowed_token_ids))
    if len(params.cache_salt) > MAX_CACHE_SALT_CHARS or not is_printable_ascii(params.cache_salt):
        raise InvalidRequest("params.cache_salt", f"at most {MAX_CACHE_SALT_CHARS} printable ASCII characters")
    _check_structured(params.structured)
    if len(params.bad_words) > MAX_BAD_WORDS:
        raise InvalidRequest("params.bad_words", f"at most {MAX_BAD_WORDS} words, got {len(params.bad_words)}")
    for i, word in enumerate(params.bad_words):
        if not 1 <= len(word) <= MAX_BAD_WORD_CHARS:
            raise InvalidRequest(
                f"params.bad_words[{i}]", f"must be 1..{MAX_BAD_WORD_CHARS} characters, got {len(word)}"
            )


def _check_stop(params: common_pb2.SamplingParams) -> None:
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("params.stop", f"at most {MAX_STOP_STRINGS} strings, got {len(params.stop)}")
    for i, stop in enumerate(params.stop):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise InvalidRequest(f"params.stop[{i}]", f"must be 1..{MAX_STOP_CHARS} characters, got {len(stop)}")
