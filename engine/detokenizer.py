"""Incremental detokenization whose deltas are whole characters.

Byte-level BPE can split one character (a Chinese one, an emoji) over several tokens. Each call
decodes only a short window of recent tokens and holds text back while the window ends in an
incomplete character (U+FFFD, and the bytes of the last tokens end inside a UTF-8 sequence), so the
concatenated deltas equal `tokenizer.decode(all_ids)`. A U+FFFD the model really generated is
streamed when it is generated.

The window is seeded with the last `PROMPT_CONTEXT_TOKENS` prompt tokens (as vLLM and TGI do), and
only the text after the prompt's is emitted. Without that context a SentencePiece (Metaspace)
tokenizer decodes the first output token ``▁Paris`` as ``Paris`` (a decoder strips the leading
space of the first token it sees); with it the deltas equal
``decode(prompt + output)[len(decode(prompt)):]`` for every tokenizer family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.engine.trace import token_bytes

_REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 8  # prompt tokens decoded before the first output token (vLLM uses 5)


def ends_inside_a_character(tail: bytes) -> bool:
    """True when `tail` ends with the first bytes of a UTF-8 character whose other bytes are to come."""
    for back in range(1, min(3, len(tail)) + 1):
        byte = tail[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        if byte < 0xC0:  # ASCII ends a character
            return False
        needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
        return back < needed
    return False


class IncrementalDetokenizer:
    """Feed token ids one by one; get text deltas. `flush()` releases what is held at the end."""

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # slow (Python) tokenizers join special tokens with spaces unless told not to; fast ones never
        # do and ignore the flag, as in vLLM
        self._decode_kwargs = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        # the prompt's last tokens: context for the first output tokens, never emitted themselves
        self.token_ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0  # start of the decoding window
        self._read_offset = len(self.token_ids)  # tokens before this are already emitted as text (or prompt)
        self.waiting = False  # the latest add() held text back: the window ends inside a character

    @property
    def held_ids(self) -> list[int]:
        """Tokens whose text is not streamed yet."""
        return self.token_ids[self._read_offset :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False, **self._decode_kwargs
        )

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        # U+FFFD at the end: an incomplete character (hold it back) or one the model really wrote (stream
        # it); the bytes of the last tokens tell which (a character is at most 4 bytes, each token >= 1)
        self.waiting = full_text.endswith(_REPLACEMENT) and self._incomplete_tail()
        if self.waiting or len(full_text) <= len(prefix_text):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _incomplete_tail(self) -> bool:
        return ends_inside_a_character(b"".join(token_bytes(self._tokenizer, self.token_ids[-4:])))

    def flush(self) -> str:
        """Return the held-back text (incomplete characters become U+FFFD, as in a full decode)."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]
