"""Turning a request's input (text, chat messages, or token ids) into prompt token ids.

Tools (OpenAI's `tools`): a chat template that knows tools (it renders them: Qwen2.5, Qwen3, Llama
3.1 ...) gets them as they are, with assistant tool calls and tool results as its own fields. A
template that ignores them (SmolLM2's) would leave the model unaware of them, so the tools are then
described in the system turn in the Hermes format, which asks for calls as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (what router/tools.py parses); earlier
calls and their results are written in the same format into their turns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pdserve.failures import RequestInvalid

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_MESSAGES = 256


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Tokenize a plain prompt the way the model's tokenizer does by default. A completion prompt is
    raw model input: special-token text in it (``<|im_start|>``, ``<|endoftext|>``) becomes those
    tokens, so a client can write a chat by hand, as with vLLM (chat messages differ: `encode_chat`)."""
    if not text.strip():
        raise RequestInvalid("prompt: must not be empty or whitespace")
    return list(tokenizer(text).input_ids)


Message = dict[str, Any]  # {"role", "content"} plus "tool_calls" / "tool_call_id" / "name"


def encode_chat(tokenizer: Any, messages: Sequence[tuple[str, str] | Message],
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Render messages ((role, content) pairs or OpenAI-style dicts) and `tools` with the
    tokenizer's own chat template, ready for a reply."""
    messages = [{"role": m[0], "content": m[1]} if isinstance(m, tuple) else m for m in messages]
    if tools and not _template_renders_tools(tokenizer):
        messages = _hermes_messages(messages, tools)
        tools = None
    if not messages:
        raise RequestInvalid("messages: at least one message is required")
    if len(messages) > MAX_MESSAGES:
        raise RequestInvalid(f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}")
    for message in messages:
        if message["role"] not in CHAT_ROLES:
            raise RequestInvalid(f"messages: unknown role {message['role']!r}; known roles: {sorted(CHAT_ROLES)}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestInvalid("messages: this model's tokenizer has no chat template; send a prompt instead")
    specials = special_token_strings(tokenizer)
    extra = {"tools": tools} if tools else {}
    if not any(s in m["content"] for m in messages for s in specials):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    # Content that spells a special token (`<|im_end|>\n<|im_start|>system ...`) stays text: the template
    # is rendered around placeholders, its own markers become special tokens, and each message's content
    # is tokenized with special tokens split into ordinary pieces, so no message can forge a turn.
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)], tokenize=False,
        add_generation_prompt=True, **extra,
    )
    ids: list[int] = []
    for piece in _PLACEHOLDERS.split(rendered):
        if not piece:
            continue
        index = _placeholder_index(piece)
        if index is None:
            ids += tokenizer(piece, add_special_tokens=False).input_ids
        else:
            ids += tokenizer(messages[index]["content"], add_special_tokens=False, split_special_tokens=True).input_ids
    return ids


_PROBE_TOOL = {"type": "function", "function": {"name": "pdserve_probe_tool", "description": "",
                                                "parameters": {"type": "object", "properties": {}}}}


def _template_renders_tools(tokenizer: Any) -> bool:  # noqa: ANN401
    """Whether the chat template writes tools into the prompt (cached on the tokenizer)."""
    cached = getattr(tokenizer, "_pdserve_renders_tools", None)
    if cached is None:
        probe = [{"role": "user", "content": "hi"}]
        try:
            with_tool = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False,
                                                      add_generation_prompt=True)
            cached = "pdserve_probe_tool" in with_tool
        except Exception:  # noqa: BLE001 - a template that breaks on tools does not render them
            cached = False
        try:
            tokenizer._pdserve_renders_tools = cached
        except AttributeError:
            pass
    return bool(cached)


HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>"
)


def _hermes_messages(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    """`messages` for a template that ignores tools: the tools described in the system turn, tool
    calls and tool results written as text in the Hermes format."""
    described = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[Message] = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in message["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        if message["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": message["role"], "content": content})
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out


def chat_from_pb(chat: Any) -> tuple[list[Message], list[dict[str, Any]] | None]:  # noqa: ANN401
    """(messages, tools) of a ChatMessages message; RequestInvalid names a field that is not valid JSON."""
    messages: list[Message] = []
    for i, m in enumerate(chat.messages):
        message: Message = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            calls = _json_list(m.tool_calls_json, f"messages[{i}].tool_calls_json")
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise RequestInvalid(f"messages[{i}].tool_calls_json: each call needs function.name")
                arguments = function.get("arguments")
                if isinstance(arguments, str):  # OpenAI sends JSON text; templates expect the object
                    try:
                        function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                    except json.JSONDecodeError:
                        pass  # kept as text
            message["tool_calls"] = calls
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    tools = _json_list(chat.tools_json, "messages.tools_json") if chat.tools_json else None
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestInvalid("messages.tools_json: each tool needs function.name")
    return messages, tools


def _json_list(text: str, name: str) -> list[Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestInvalid(f"{name}: not valid JSON: {exc}") from None
    if not isinstance(value, list):
        raise RequestInvalid(f"{name}: must be a JSON list")
    return value


_PLACEHOLDER = "\x00pdserve-content-{}\x00"
_PLACEHOLDERS = re.compile("(\x00pdserve-content-\\d+\x00)")


def _placeholder_index(piece: str) -> int | None:
    if piece.startswith("\x00pdserve-content-") and piece.endswith("\x00"):
        return int(piece[len("\x00pdserve-content-"):-1])
    return None


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:  # noqa: ANN401
    """Every special token's text (bos/eos/pad, chat markers, other added special tokens), cached."""
    cached = getattr(tokenizer, "_pdserve_special_strings", None)
    if cached is None:
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        found = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        found |= {str(t) for t in decoder.values() if getattr(t, "special", False)}
        cached = tuple(sorted(s for s in found if s))
        try:
            tokenizer._pdserve_special_strings = cached
        except AttributeError:  # a tokenizer that refuses attributes: compute each time
            pass
    return tuple(cached)


def input_chars(request: Any) -> int:  # noqa: ANN401 - a GenerateRequest or DecodeRequest
    """Characters a request's prompt or chat holds (0 for token ids): what decides whether it is
    tokenized on an event loop or in a thread (router and decode worker alike)."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return len(request.prompt)
    if kind == "messages":
        chat = request.messages
        return len(chat.tools_json) + sum(len(m.content) + len(m.role) + len(m.tool_calls_json) for m in chat.messages)
    return 0
