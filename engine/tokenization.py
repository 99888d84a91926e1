"""Turning a request's input (text, chat messages, or token ids) into prompt token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_MESSAGES = 256


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Tokenize a plain prompt the way the model's tokenizer does by default."""
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
    rendered = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)
