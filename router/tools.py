"""OpenAI tool calling on /v1/chat/completions: the request's `tools` and `tool_choice`, and the
model's output turned into `tool_calls` (pure functions and a small stream parser, no I/O).

How each `tool_choice` is served:
- ``none``: the tools are left out of the prompt; the answer is text.
- ``auto`` (the default with tools): the tools go into the prompt (pdserve/tokenization.py renders
  them with the chat template, or in the Hermes format when the template ignores tools); the output
  is free, and each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in it becomes a tool
  call (the Hermes format: Qwen2.5, Qwen3, Hermes, and any model prompted with it). Text outside
  the tags is the content. A block that is not valid JSON of that shape stays content.
- ``required``: the output is constrained (a structured-output JSON schema) to a JSON list of
  ``{"name": <one of the tools>, "parameters": <its schema>}``, at least one, one at most with
  ``parallel_tool_calls: false``; every item becomes a call. Works on any model.
- a named function ``{"type": "function", "function": {"name": ...}}``: the output is constrained
  to that function's parameter schema and is its arguments.
`finish_reason` is ``tool_calls`` when calls were made (``stop`` for a named function, as OpenAI).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.v1 import common_pb2

START, END = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "named"


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` / message field: (param, message)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolMode:
    """How to read a request's output: the `tool_choice` kind and, when named, the function."""

    kind: str  # AUTO, REQUIRED or NAMED (NONE needs no parsing: no ToolMode)
    names: tuple[str, ...]
    function: str = ""  # NAMED: the function


def parse_tools(
    body: dict[str, Any], chat: common_pb2.ChatMessages, params: common_pb2.SamplingParams
) -> ToolMode | None:
    """Check `tools`, `tool_choice` and `parallel_tool_calls`; put the tools in `chat` and the
    constraint of ``required`` / a named function in `params`. ToolError names a bad field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, NONE):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise ToolError("tools", f'tools[{i}]: must be {{"type": "function", "function": {{"name": ...}}}}')
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError("tools", f"tools[{i}].function.parameters: must be a JSON Schema object")
        if name in functions:
            raise ToolError("tools", f"tools[{i}]: a second function named {name!r}")
        functions[name] = parameters
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "must be a boolean")
    kind, named = _choice(choice, functions)
    if kind == NONE:
        return None
    chat.tools_json = json.dumps(tools, ensure_ascii=False)
    if kind != AUTO and params.HasField("structured"):
        raise ToolError(
            "tool_choice",
            f"tool_choice {kind!r} constrains the output: it cannot be combined with "
            "response_format or structured outputs",
        )
    if kind == NAMED:
        params.structured.json_schema = json.dumps(functions[named])
    elif kind == REQUIRED:
        params.structured.json_schema = json.dumps(_calls_schema(functions, parallel))
    return ToolMode(kind, tuple(functions), named)


def _choice(choice: object, functions: dict[str, dict[str, Any]]) -> tuple[str, str]:
    if choice is None or choice == AUTO:
        return AUTO, ""
    if choice in (NONE, REQUIRED):
        return str(choice), ""
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise ToolError("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
        return NAMED, str(name)
    raise ToolError(
        "tool_choice", 'must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
    )


def _calls_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON list of {"name", "parameters"} objects, one of `functions` each (vLLM's form)."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _hermes_call(block: str, names: tuple[str, ...]) -> dict[str, Any] | None:
    """The tool call a ``<tool_call>`` block holds, or None when it is not one of `names`' calls."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return tool_call(
        value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    )


def parse_output(mode: ToolMode, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output; content is None when there are calls and no text."""
    if mode.kind == NAMED:
        return None, [tool_call(mode.function, text)]
    stream = ToolStream(mode)
    content, calls = stream.feed(text)
    more, rest = stream.finish()
    content += more
    calls = [{key: value for key, value in call.items() if key != "index"} for call in calls + rest]
    return (content or None) if calls else content, calls


def finish_reason(mode: ToolMode, calls: int, reason: str) -> str:
    """``tool_calls`` when calls were made and the output ended by itself (not for a named
    function, where OpenAI says ``stop``)."""
    return "tool_calls" if calls and reason == "stop" and mode.kind != NAMED else reason


@dataclass
class ToolStream:
    """Turns one choice's text deltas into (content delta, finished tool calls). ``auto`` streams the
    text outside the tags as it comes (holding back what may be the start of a tag); a named
    function streams its arguments as they come (the first delta carries id and name); ``required``
    gives its calls when the list is complete."""

    mode: ToolMode
    held: str = ""
    calls: int = 0  # tool calls given so far
    _named_id: str = ""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content to stream now, and tool-call deltas (each with its own `index`)."""
        if self.mode.kind == NAMED:
            if not text:
                return "", []
            delta: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self._named_id:
                self._named_id = call_id()
                self.calls = 1
                delta.update(id=self._named_id, type="function")
                delta["function"]["name"] = self.mode.function
            return "", [delta]
        self.held += text
        if self.mode.kind == REQUIRED:
            return "", []
        content, calls = "", list[dict[str, Any]]()
        while True:
            start = self.held.find(START)
            if start < 0:
                keep = _partial_tag(self.held)
                content += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                return content, calls
            end = self.held.find(END, start)
            if end < 0:
                content += self.held[:start]
                self.held = self.held[start:]
                return content, calls
            content += self.held[:start]
            block, self.held = self.held[start + len(START) : end], self.held[end + len(END) :]
            call = _hermes_call(block.strip(), self.mode.names)
            if call is None:
                content += START + block + END
            else:
                calls.append(self._indexed(call))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is still held at the end of the output."""
        held, self.held = self.held, ""
        if self.mode.kind == NAMED:
            if not self._named_id:  # no text at all: still one call, with empty arguments
                self._named_id, self.calls = call_id(), 1
                return "", [{"index": 0, **tool_call(self.mode.function, "", self._named_id)}]
            return "", []
        if self.mode.kind == REQUIRED:
            try:
                calls = [
                    tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                    for item in json.loads(held)
                ]
            except (json.JSONDecodeError, KeyError, TypeError):
                return held, []  # cut short (max_tokens): the text as it is
            return "", [self._indexed(call) for call in calls]
        return held, []

    def _indexed(self, call: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        return {"index": self.calls - 1, **call}


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could start ``<tool_call>``."""
    for size in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-size:]):
            return size
    return 0
