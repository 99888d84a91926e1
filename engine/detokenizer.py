"""Incremental detokenization whose deltas are whole characters.

Byte-level BPE can split one character (a Chinese one, an emoji) over several tokens. Each call
decodes only a short window of recent tokens and holds text back while the window ends in an
incomplete character (U+FFFD), so the concatenated deltas equal `tokenizer.decode(all_ids)`.

The window is seeded with the last `PROMPT_CONTEXT_TOKENS` prompt tokens (as vLLM and TGI do), and
only the text after the prompt's is emitted. Without that context a SentencePiece (Metaspace)
tokenizer decodes the first output token ``▁Paris`` as ``Paris`` (a decoder strips the leading
space of the first token it sees); with it the deltas equal
``decode(prompt + output)[len(decode(prompt)):]`` for every tokenizer family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 8  # prompt tokens decoded before the first output token (vLLM uses 5)


class IncrementalDetokenizer:
    """Feed token ids one by one; get text deltas. `flush()` releases what is held at the end."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
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
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        self.waiting = full_text.endswith(_REPLACEMENT)
        if self.waiting or len(full_text) <= len(prefix_text):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Return the held-back text (incomplete characters become U+FFFD, as in a full decode)."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]
