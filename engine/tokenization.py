"""Turning a request's input (text, chat messages, or token ids) into prompt token ids."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_MESSAGES = 256


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Tokenize a plain prompt the way the model's tokenizer does by default. A completion prompt is
    raw model input: special-token text in it (``<|im_start|>``, ``<|endoftext|>``) becomes those
    tokens, so a client can write a chat by hand, as with vLLM (chat messages differ: `encode_chat`)."""
    if not text.strip():
        raise ValueError("prompt: must not be empty or whitespace")
    return list(tokenizer(text).input_ids)


def encode_chat(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Render (role, content) messages with the tokenizer's own chat template, ready for a reply."""
    if not messages:
        raise ValueError("messages: at least one message is required")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}")
    for role, _ in messages:
        if role not in CHAT_ROLES:
            raise ValueError(f"messages: unknown role {role!r}; known roles: {sorted(CHAT_ROLES)}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: this model's tokenizer has no chat template; send a prompt instead")
    specials = special_token_strings(tokenizer)
    if not any(s in content for _, content in messages for s in specials):
        rendered = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    # Content that spells a special token (`<|im_end|>\n<|im_start|>system ...`) stays text: the template
    # is rendered around placeholders, its own markers become special tokens, and each message's content
    # is tokenized with special tokens split into ordinary pieces, so no message can forge a turn.
    rendered = tokenizer.apply_chat_template(
        [{"role": r, "content": _PLACEHOLDER.format(i)} for i, (r, _) in enumerate(messages)], tokenize=False,
        add_generation_prompt=True,
    )
    ids: list[int] = []
    for piece in _PLACEHOLDERS.split(rendered):
        if not piece:
            continue
        index = _placeholder_index(piece)
        if index is None:
            ids += tokenizer(piece, add_special_tokens=False).input_ids
        else:
            ids += tokenizer(messages[index][1], add_special_tokens=False, split_special_tokens=True).input_ids
    return ids


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
