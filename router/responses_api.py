"""The OpenAI Responses API (``POST /v1/responses``) over the chat completions path (pure functions
and a stream builder, no I/O).

A request becomes a chat completions body that `openai_protocol.parse_request` parses, so sampling,
structured outputs, tools, limits and their errors are chat completions' own; an error that names a
chat field names the Responses field instead (``messages`` -> ``input``, ``max_completion_tokens``
-> ``max_output_tokens``, ``response_format`` -> ``text``).

Request fields:
- ``input``: a string (one user turn) or a list of items: messages (``{"role", "content"}``, with or
  without ``"type": "message"``; roles user, system, developer, assistant; content a string or
  ``input_text`` / ``output_text`` parts), ``function_call`` items (the model's earlier calls, joined
  to the assistant turn before them) and ``function_call_output`` items (a tool turn each).
- ``instructions``: a system turn before everything (not carried into a continued conversation, as
  OpenAI); ``max_output_tokens``, ``temperature``, ``top_p``, ``metadata``, ``user``, and pdserve's
  and vLLM's sampling and scheduling extras (``seed``, ``stop``, ``top_k`` ...: `SAMPLING_EXTRAS`).
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``, ``strict``).
- ``tools`` of type ``function`` (``name``, ``description``, ``parameters``, ``strict``), ``tool_choice``
  (``none``, ``auto``, ``required``, ``{"type": "function", "name"}``), ``parallel_tool_calls``.
- ``stream``, ``store`` (default true) and ``previous_response_id`` (router/response_store.py).
- Refused with 400 naming the field unless it has its "off" value (`_OFF_VALUES`): ``background``,
  ``include``, ``reasoning``, ``truncation: auto``, ``conversation``, ``prompt``, ``max_tool_calls``,
  ``top_logprobs``, ``stream_options``, service tiers, and every unknown field; built-in tool types
  (web search, file search ...) and non-text input parts are refused too.

Answers: the response object (``output`` holds a ``message`` item with one ``output_text`` part,
and a ``function_call`` item per call), ``status`` ``completed``, or ``incomplete`` with
``incomplete_details.reason: max_output_tokens`` when the output was cut; ``usage`` in the
Responses shape. Streamed, `ResponseStream` numbers the events the SDK's helper consumes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.router import tools
from pdserve.router.core import RouterError
from pdserve.router.openai_protocol import (
    CHAT,
    OpenAIError,
    ParsedRequest,
    check_model,
    error_from_grpc,
    finish_reason,
    parse_request,
    usage,
)
from pdserve.v1 import common_pb2, router_pb2

RESPONSE = "response"
#: Body fields passed to the chat completions parser as they are (its extras and scheduling fields).
SAMPLING_EXTRAS = frozenset(
    {
        "seed",
        "stop",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
        "min_tokens",
        "stop_token_ids",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "cache_salt",
        "priority",
        "slo_ttft_ms",
        "best_effort",
    }
)
_PASSED = frozenset({"temperature", "top_p", "parallel_tool_calls", "stream", "metadata", "user"}) | SAMPLING_EXTRAS
_IMPLEMENTED = (
    frozenset(
        {
            "model",
            "input",
            "instructions",
            "max_output_tokens",
            "text",
            "tools",
            "tool_choice",
            "store",
            "previous_response_id",
        }
    )
    | _PASSED
)
#: Accepted only with an "off" value; anything else is a 400 naming the field.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "stream_options": (None, {}),
    "conversation": (None,),
    "prompt": (None,),
    "context_management": (None, []),
    "moderation": (None,),
    "prompt_cache_retention": (None,),
    "prompt_cache_options": (None,),
    "background_options": (None,),
    "access_programs": (None,),
    "image": (None,),
}
#: Opaque labels: accepted (strings of at most MAX_LABEL_CHARS) and without effect.
_LABELS = frozenset({"safety_identifier", "prompt_cache_key"})
MAX_LABEL_CHARS = 256
MAX_ID_CHARS = 256
_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TOOL_FIELDS = frozenset({"type", "name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class ResponseOptions:
    """What a Responses request asks beyond its generation."""

    response_id: str
    previous_response_id: str | None
    store: bool
    has_instructions: bool  # the chat's first message is the instructions
    echo: dict[str, Any]  # the request's fields the answer repeats


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ParsedRequest  # the generation, as a chat completion
    options: ResponseOptions

    def pack(self) -> tuple[Any, ...]:
        """Bytes and small values (what crosses back from the parser process)."""
        return self.chat.pack(), self.options

    @classmethod
    def unpack(cls, packed: tuple[Any, ...]) -> ResponsesRequest:
        return cls(ParsedRequest.unpack(CHAT, packed[0]), packed[1])


def renamed(error: OpenAIError) -> OpenAIError:
    """A chat completions error naming the Responses field instead."""
    name = _RENAMED.get(error.param or "")
    if name is None:
        return error
    message = error.message
    for old, new in _RENAMED.items():
        if message.startswith(old):
            message = new + message[len(old) :]
    return OpenAIError(error.status, message, param=name, type_=error.type, code=error.code)


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


# ----- requests -------------------------------------------------------------------------------
def parse_responses(body: object, model_name: str, request_id: str) -> ResponsesRequest:
    """Validate a Responses body; OpenAIError (400/404) names the first bad field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    check_model(body.get("model"), model_name)
    _check_supported(body)
    chat = {name: body[name] for name in _PASSED if name in body}
    chat["model"] = body["model"]
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    text_format = _text_format(body.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    try:
        parsed = parse_request(CHAT, chat, model_name, request_id)
    except OpenAIError as exc:
        raise renamed(exc) from None
    store, previous = body.get("store"), body.get("previous_response_id")
    if store is not None and not isinstance(store, bool):
        raise _bad("store", f"store: must be a boolean, got {store!r}")
    if previous is not None and (not isinstance(previous, str) or not 0 < len(previous) <= MAX_ID_CHARS):
        raise _bad(
            "previous_response_id",
            f"previous_response_id: must be a response id (a string of at most {MAX_ID_CHARS} characters)",
        )
    options = ResponseOptions(
        f"resp_{uuid.uuid4().hex}",
        previous,
        store is not False,
        body.get("instructions") is not None,
        _echo(body, store is not False),
    )
    return ResponsesRequest(parsed, options)


def _check_supported(body: dict[str, Any]) -> None:
    for name, off_values in _OFF_VALUES.items():
        if name in body and body[name] not in off_values:
            raise _bad(name, f"{name}: not supported by this server")
    reasoning = body.get("reasoning")
    if reasoning is not None and not (isinstance(reasoning, dict) and all(v is None for v in reasoning.values())):
        raise _bad("reasoning", "reasoning: not supported by this server (it serves no reasoning model)")
    for name in sorted(_LABELS & set(body)):
        value = body[name]
        if value is not None and (not isinstance(value, str) or len(value) > MAX_LABEL_CHARS):
            raise _bad(name, f"{name}: must be a string of at most {MAX_LABEL_CHARS} characters")
    unknown = sorted(set(body) - _IMPLEMENTED - set(_OFF_VALUES) - _LABELS - {"reasoning"})
    if unknown:
        raise _bad(unknown[0], f"{unknown[0]}: unknown or unsupported parameter")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat: the instructions' system turn, then the input's turns."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "instructions: must be a string")
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "input: must be a string or a non-empty list of items")
    for i, item in enumerate(value):
        _add_item(messages, item, f"input[{i}]")
    return messages


def _add_item(messages: list[dict[str, Any]], item: object, where: str) -> None:
    if not isinstance(item, dict):
        raise _bad("input", f"{where}: must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise _bad("input", f"{where}.role: must be one of {', '.join(sorted(_ROLES))}, got {role!r}")
        messages.append({"role": role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        call = tools.tool_call(
            _string(item, "name", where), _string(item, "arguments", where, empty=True), _string(item, "call_id", where)
        )
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the turn's text and its calls: one turn
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append(
            {
                "role": "tool",
                "tool_call_id": _string(item, "call_id", where),
                "content": _text(item.get("output"), where, "output"),
            }
        )
    else:
        raise _bad(
            "input", f"{where}.type: {kind!r} items are not supported (message, function_call, function_call_output)"
        )


def _string(item: dict[str, Any], name: str, where: str, empty: bool = False) -> str:
    value = item.get(name)
    too_long = name != "arguments" and isinstance(value, str) and len(value) > MAX_ID_CHARS
    if not isinstance(value, str) or (not value and not empty) or too_long:
        raise _bad(
            "input",
            f"{where}.{name}: must be a {'' if empty else 'non-empty '}string"
            f"{'' if name == 'arguments' else f' of at most {MAX_ID_CHARS} characters'}",
        )
    return value


def _text(content: object, where: str, name: str = "content") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("input", f"{where}.{name}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):  # type: ignore[union-attr]
            raise _bad(
                "input", f"{where}.{name}[{j}]: only text parts are supported (input_text, output_text), got {kind!r}"
            )
        texts.append(part["text"])  # type: ignore[index]
    return "".join(texts)


def _text_format(text: object) -> dict[str, Any] | None:
    """``text.format`` as a chat completions ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", "text: must be an object")
    for key in sorted(set(text) - {"format", "verbosity"}):
        raise _bad("text", f"text.{key}: not supported by this server")
    if text.get("verbosity") not in (None, "medium"):
        raise _bad("text", "text.verbosity: not supported by this server")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise _bad("text", "text.format.type: must be text, json_object or json_schema")
    assert isinstance(spec, dict)
    if not isinstance(spec.get("schema"), dict):
        raise _bad("text", "text.format.schema: must be a JSON Schema object")
    inner = {key: spec[key] for key in ("name", "schema", "strict", "description") if spec.get(key) is not None}
    return {"type": "json_schema", "json_schema": inner}


def _tools(value: object) -> list[dict[str, Any]]:
    """Responses function tools (flat) as chat completions tools."""
    if not isinstance(value, list):
        raise _bad("tools", "tools: must be a list")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(
                "tools",
                f"tools[{i}].type: {kind!r} tools are not supported by this server (function tools "
                "only: it has no built-in tools)",
            )
        assert isinstance(tool, dict)
        for key in sorted(set(tool) - _TOOL_FIELDS):
            raise _bad("tools", f"tools[{i}].{key}: not supported by this server")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad("tools", f"tools[{i}].name: a function tool needs a name")
        function = {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None
        }
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object) -> object:
    if choice in (tools.NONE, tools.AUTO, tools.REQUIRED):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad(
        "tool_choice",
        "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", "
        '"name": ...} (this server has no built-in tools)',
    )


def _echo(body: dict[str, Any], store: bool) -> dict[str, Any]:
    """The request's settings as the answer repeats them."""
    text = body.get("text") or {}
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": store,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or tools.AUTO,
        "tools": body.get("tools") or [],
        "truncation": "disabled",
        "user": body.get("user"),
        "background": False,
        "service_tier": "default",
    }


def continue_conversation(
    request: ResponsesRequest, previous: Sequence[common_pb2.ChatMessage]
) -> tuple[common_pb2.ChatMessage, ...]:
    """Put a previous response's conversation between the instructions and this request's input, and
    return this request's own input turns (what a stored conversation adds for it)."""
    messages = request.chat.grpc_request.messages.messages
    head = 1 if request.options.has_instructions else 0
    turn = tuple(_copy(m) for m in messages[head:])
    if previous:
        del messages[head:]
        messages.extend(previous)
        messages.extend(turn)
    return turn


def _copy(message: common_pb2.ChatMessage) -> common_pb2.ChatMessage:
    copy = common_pb2.ChatMessage()
    copy.CopyFrom(message)
    return copy


def output_turn(output: list[dict[str, Any]]) -> common_pb2.ChatMessage:
    """A response's output as the assistant turn of its conversation (text and tool calls)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        tools.tool_call(item["name"], item["arguments"], item["call_id"])
        for item in output
        if item["type"] == "function_call"
    ]
    return common_pb2.ChatMessage(
        role="assistant", content=text, tool_calls_json=json.dumps(calls, ensure_ascii=False) if calls else ""
    )


# ----- answers --------------------------------------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": item_id or _item_id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def function_call_item(call: dict[str, Any], item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or _item_id("fc"),
        "type": "function_call",
        "status": "completed",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
    }


def response_usage(usage_: dict[str, Any]) -> dict[str, Any]:
    """Chat completions' usage in the Responses shape."""
    return {
        "input_tokens": usage_["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage_["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage_["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage_["total_tokens"],
    }


def response_object(
    options: ResponseOptions,
    model: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage_: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": options.response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "usage": usage_,
        **options.echo,
    }


def _status(reason: str) -> str:
    return "incomplete" if reason == "length" else "completed"


async def collect(responses: AsyncIterator[router_pb2.GenerateResponse]) -> tuple[str, str, dict[str, Any]]:
    """(text, finish reason, usage) of a whole generation."""
    texts = []
    async for response in responses:
        texts.append(response.text)
        reason = finish_reason(response)
        if reason is not None:
            return "".join(texts), reason, usage(response)
    raise OpenAIError(500, "the generation ended without a finish reason")


def answer(request: ResponsesRequest, model: str, text: str, reason: str, usage_: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer: a message item with the text (when there is text, or no call), then
    a function_call item per tool call."""
    calls: list[dict[str, Any]] = []
    if request.chat.tools is not None:
        content, calls = tools.parse_output(request.chat.tools, text)
        text = content or ""
    status = _status(reason)
    output = [message_item(text, status)] if text or not calls else []
    output += [function_call_item(call) for call in calls]
    return response_object(request.options, model, int(time.time()), status, output, response_usage(usage_))


class ResponseStream:
    """One generation as the Responses events: ``response.created`` and ``response.in_progress``;
    per output item ``response.output_item.added``, its content (a message's
    ``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
    ``response.content_part.done``; a function call's ``response.function_call_arguments.delta`` ...
    ``.done``) and ``response.output_item.done``; then ``response.completed`` (``response.incomplete``
    when the output was cut, ``response.failed`` on an error). Each event has its
    ``sequence_number``, from 0. One item is open at a time: text after a call opens a new message.
    `answer` is the final response object once it completed or was cut."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self._request = request
        self._model = model
        self._created_at = int(time.time())
        self._sequence = 0
        self._parser = tools.ToolStream(request.chat.tools) if request.chat.tools is not None else None
        self.output: list[dict[str, Any]] = []  # finished items
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._parts: list[str] = []  # its text or arguments so far
        self.answer: dict[str, Any] | None = None

    async def events(
        self, first: router_pb2.GenerateResponse | None, responses: AsyncIterator[router_pb2.GenerateResponse]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Every event, from the generation's first response (already read) and the rest."""
        yield self._lifecycle("response.created", "in_progress")
        yield self._lifecycle("response.in_progress", "in_progress")
        try:
            response = first
            while response is not None:
                reason = finish_reason(response)
                text, calls = response.text, list[dict[str, Any]]()
                if self._parser is not None:
                    text, calls = self._parser.feed(response.text)
                    if reason is not None:
                        more, rest = self._parser.finish()
                        text, calls = text + more, calls + rest
                for event in self._deltas(text, calls):
                    yield event
                if reason is not None:
                    for event in self._finish(reason, usage(response)):
                        yield event
                    return
                response = await anext(responses, None)
            raise OpenAIError(500, "the generation ended without a finish reason")
        except RouterError as exc:
            yield self._failed(renamed(error_from_grpc(exc.code, exc.details)))
        except OpenAIError as exc:
            yield self._failed(exc)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:  # noqa: ANN401 - JSON values
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _lifecycle(
        self, kind: str, status: str, usage_: dict[str, Any] | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        response = response_object(
            self._request.options, self._model, self._created_at, status, list(self.output), usage_, error
        )
        return self._event(kind, response=response)

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _deltas(self, text: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        if text:
            if self._open is None or self._open["type"] != "message":
                events += self._close("completed")
                events += self._open_message()
            events.append(
                self._event("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
            )
            self._parts.append(text)
        for call in calls:
            if "id" in call:  # a new call (a named function's later deltas carry only arguments)
                events += self._close("completed")
                self._open = {**function_call_item(call), "status": "in_progress", "arguments": ""}
                events.append(
                    self._event("response.output_item.added", output_index=len(self.output), item=dict(self._open))
                )
            arguments = call.get("function", {}).get("arguments", "")
            if arguments and self._open is not None:
                events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
                self._parts.append(arguments)
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self._open = {**message_item("", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=len(self.output), item=dict(self._open)),
            self._event("response.content_part.added", **self._where(), content_index=0, part=part),
        ]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's closing events (none when no item is open)."""
        if self._open is None:
            return []
        where, content = self._where(), "".join(self._parts)
        if self._open["type"] == "message":
            item = message_item(content, status, self._open["id"])
            events = [
                self._event("response.output_text.done", **where, content_index=0, text=content, logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=item["content"][0]),
            ]
        else:
            item = {**self._open, "arguments": content, "status": "completed"}
            events = [
                self._event("response.function_call_arguments.done", **where, name=item["name"], arguments=content)
            ]
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        self._open, self._parts = None, []
        return events

    def _finish(self, reason: str, usage_: dict[str, Any]) -> list[dict[str, Any]]:
        status = _status(reason)
        events = self._close(status)
        if not self.output:  # no text and no call: one empty message, as the non-streamed answer has
            events += self._open_message() + self._close(status)
        final = self._lifecycle(f"response.{status}", status, response_usage(usage_))
        self.answer = final["response"]
        return [*events, final]

    def _failed(self, error: OpenAIError) -> dict[str, Any]:
        return self._lifecycle(
            "response.failed", "failed", error={"code": error.code or error.type, "message": error.message}
        )
