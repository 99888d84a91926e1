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
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pdserve.failures import RequestInvalid

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_MESSAGES = 256


def encode_text(tokenizer: Any, text: str, pieces: PieceCache | None = None) -> list[int]:
    """Tokenize a plain prompt the way the model's tokenizer does by default. A completion prompt is
    raw model input: special-token text in it (``<|im_start|>``, ``<|endoftext|>``) becomes those
    tokens, so a client can write a chat by hand, as with vLLM (chat messages differ: `encode_chat`).
    `pieces` (of this tokenizer) gives the same ids, reusing those of pieces seen before."""
    if not text.strip():
        raise RequestInvalid("prompt: must not be empty or whitespace")
    if pieces is not None:
        return pieces.encode(text, add_special_tokens=True)
    return list(tokenizer(text).input_ids)


Message = dict[str, Any]  # {"role", "content"} plus "tool_calls" / "tool_call_id" / "name"


def encode_chat(
    tokenizer: Any,
    pairs_or_dicts: Sequence[tuple[str, str] | Message],
    tools: list[dict[str, Any]] | None = None,
    pieces: PieceCache | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render messages ((role, content) pairs or OpenAI-style dicts) and `tools` with the
    tokenizer's own chat template, ready for a reply (without the assistant's opening when
    `add_generation_prompt` is false: /tokenize's option). `pieces` (of this tokenizer) gives the same
    ids, reusing those of the turns seen before (a follow-up turn of a chat re-sends them all)."""
    messages = [{"role": m[0], "content": m[1]} if isinstance(m, tuple) else m for m in pairs_or_dicts]
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
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
        if pieces is not None:
            return pieces.encode(rendered, add_special_tokens=False)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    # Content that spells a special token (`<|im_end|>\n<|im_start|>system ...`) stays text: the template
    # is rendered around placeholders, its own markers become special tokens, and each message's content
    # is tokenized with special tokens split into ordinary pieces, so no message can forge a turn.
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **extra,
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


#: PieceCache's default bound: characters of text whose ids it keeps (with their ids, ~25 MB at most).
PIECE_CACHE_CHARS = 2_000_000
#: Pre-tokenizers that cut each piece of text between added tokens on its own, the same wherever the
#: piece stands (Metaspace is not one: it may mark only the text's first piece).
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "Sequence"}
)


class PieceCache:
    """The tokenizer's ids for a text, reusing the ids of the pieces between its added tokens.

    Why it is exact: a fast (Rust) tokenizer first cuts the text at its added tokens (special tokens
    such as ``<|im_start|>``, leftmost-longest) and then tokenizes each piece in between on its own;
    the pieces never merge. So the ids of a text are its pieces' ids and the added tokens' ids in
    order, and a piece's ids can be remembered. That holds only when no added token strips the
    whitespace beside it or matches whole words only, there is no normalizer (it could change what
    matches), the pre-tokenizer treats every piece alike and the post-processor adds nothing (for
    `add_special_tokens=True`); `exact` says whether this tokenizer qualifies, and when it does not,
    `encode` tokenizes the whole text as before. A chat's rendered prompt is cut at the turn markers,
    so a follow-up turn tokenizes only its new messages.

    Bounded: pieces totalling at most `max_chars` characters are kept, least recently used evicted.
    Thread-safe (the router tokenizes large prompts in threads).
    """

    def __init__(self, tokenizer: Any, max_chars: int = PIECE_CACHE_CHARS) -> None:  # noqa: ANN401
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self.hits = 0
        self.misses = 0
        self._added, self._cut = _added_token_cutter(tokenizer)
        self.exact = self._cut is not None
        self._plain_adds_nothing = self.exact and (
            list(tokenizer("a b").input_ids) == list(tokenizer("a b", add_special_tokens=False).input_ids)
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`tokenizer(text, add_special_tokens=...).input_ids`, the same ids."""
        if self._cut is None or (add_special_tokens and not self._plain_adds_nothing):
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        ids: list[int] = []
        for piece in self._cut.split(text):
            if not piece:
                continue
            added = self._added.get(piece)
            if added is not None:
                ids.append(added)
            else:
                ids += self._piece(piece)
        return ids

    def _piece(self, piece: str) -> tuple[int, ...]:
        with self._lock:
            ids = self._ids.get(piece)
            if ids is not None:
                self._ids.move_to_end(piece)
                self.hits += 1
                return ids
        # the Rust tokenizer itself: the same ids without the Python wrapper's per-call work
        ids = tuple(self.tokenizer.backend_tokenizer.encode(piece, add_special_tokens=False).ids)
        with self._lock:
            self.misses += 1
            if len(piece) <= self.max_chars and piece not in self._ids:
                self._ids[piece] = ids
                self._chars += len(piece)
                while self._chars > self.max_chars:
                    old, _ = self._ids.popitem(last=False)
                    self._chars -= len(old)
        return ids


def _added_token_cutter(tokenizer: Any) -> tuple[dict[str, int], re.Pattern[str] | None]:  # noqa: ANN401
    """(added token text -> id, a regex whose split keeps them as pieces) for a tokenizer whose
    pieces between added tokens tokenize alone exactly as in place; (…, None) for any other."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {}, None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a backend that cannot describe itself is not checked: no cache
        return {}, None
    pre = spec.get("pre_tokenizer") or {}
    pre_types = {p.get("type") for p in pre.get("pretokenizers", [])} | {pre.get("type")}
    pre_types.discard(None)
    added = spec.get("added_tokens") or []
    if (
        spec.get("normalizer") is not None
        or not pre_types <= _PIECEWISE_PRE_TOKENIZERS
        or any(p.get("add_prefix_space") for p in [pre, *pre.get("pretokenizers", [])])
        or any(a.get("lstrip") or a.get("rstrip") or a.get("single_word") for a in added)
        or not added
    ):
        return {}, None
    by_text = {a["content"]: a["id"] for a in added}
    # longest first: at one position the longest added token wins, as the tokenizer's matcher does
    alternatives = "|".join(re.escape(t) for t in sorted(by_text, key=len, reverse=True))
    return by_text, re.compile(f"({alternatives})")


_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "pdserve_probe_tool", "description": "", "parameters": {"type": "object", "properties": {}}},
}


def _template_renders_tools(tokenizer: Any) -> bool:  # noqa: ANN401
    """Whether the chat template writes tools into the prompt (cached on the tokenizer)."""
    cached = getattr(tokenizer, "_pdserve_renders_tools", None)
    if cached is None:
        probe = [{"role": "user", "content": "hi"}]
        try:
            with_tool = tokenizer.apply_chat_template(
                probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
            )
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
    'XML tags as follows:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def _hermes_messages(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    """`messages` for a template that ignores tools: the tools described in the system turn, tool
    calls and tool results written as text in the Hermes format."""
    described = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[Message] = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
                )
                + "\n</tool_call>"
                for c in message["tool_calls"]
            )
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
        return int(piece[len("\x00pdserve-content-") : -1])
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


_MAX_CHARS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def max_chars_per_token(tokenizer: Any) -> int:  # noqa: ANN401
    """The most characters of text one token of `tokenizer` can stand for: its vocabulary's longest
    entry (a byte-level entry spells one character per byte, a SentencePiece entry its characters
    and "\u2581" for a space, a byte-fallback entry six characters for one byte), twice that where
    a normalizer may fold several characters into one. Computed once per tokenizer."""
    try:
        return _MAX_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(backend, "normalizer", None) is not None:
        longest *= 2
    try:
        _MAX_CHARS[tokenizer] = longest
    except TypeError:  # not weakly referenceable: computed each time
        pass
    return longest


def check_input_fits(tokenizer: Any, request: Any, max_model_len: int) -> None:  # noqa: ANN401
    """Refuse (RequestInvalid), before any template is rendered or any text tokenized, a prompt or
    chat whose text alone needs more tokens than the model's context holds: every token stands for
    at most `max_chars_per_token` characters, so N characters of content need at least
    N / that many tokens. Bounds the tokenizer's and the template's work per request (a chat of
    256 messages near the size limit otherwise took a quarter of a second of both)."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        chars, what = len(request.prompt), "prompt"
    elif kind == "messages":
        chars, what = sum(len(m.content) for m in request.messages.messages), "messages"
    else:
        return
    per_token = max_chars_per_token(tokenizer)
    if chars > max_model_len * per_token:
        raise RequestInvalid(
            f"{what}: {chars} characters need at least {-(-chars // per_token)} tokens (a token of this "
            f"model stands for at most {per_token} characters); the model's context is {max_model_len}"
        )
