"""Step trace of one request (opt-in): what the engine did for it, pass by pass.

A sequence created with `trace=True` collects one event per forward pass over its prompt (one per
chunk with chunked prefill), one per decode step, and one per detokenization hold (a token whose
bytes do not end a character yet, so no text is streamed for it). The engine hands the events
out with the request's next TokenOutput; a prefill worker's connector reads them at hand-off.
Untraced sequences (`trace is None`) pay one `is None` check per token.

KV lengths count the tokens of the request whose K/V are in this engine's cache: a prefill pass
over a P-token prompt goes 0 -> P and samples the first token (its K/V are not cached yet); each
decode step appends the previous token's K/V, so the length grows by one per step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class PrefillPassEvent:
    """One forward pass over prompt tokens of the request."""

    num_tokens: int  # prompt tokens whose K/V this pass computed
    kv_len_before: int
    kv_len_after: int
    time_s: float  # wall time of the pass and its sampling (a mixed batch includes other sequences)
    first_token_id: int | None  # the token it sampled, if it completed the prompt


@dataclass(frozen=True)
class DecodeStepEvent:
    """One decode step: the previous token's K/V appended, `token_id` sampled."""

    token_id: int
    kv_len: int  # tokens in the cache after the step
    itl_s: float  # time since the request's previous token on this worker


@dataclass(frozen=True)
class DetokenizeHoldEvent:
    """No text streamed for `token_id`: the held tokens end inside a multi-byte character."""

    token_id: int
    held_ids: tuple[int, ...]  # tokens held back so far, this one included


TraceEvent = PrefillPassEvent | DecodeStepEvent | DetokenizeHoldEvent

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the character each byte is written as -> the byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def piece_bytes(token: str) -> bytes | None:
    """The bytes of a vocabulary entry when its spelling says them exactly: a SentencePiece byte token
    (``<0xE9>``; checked first, since its characters are byte-level ones too) or byte-level BPE
    characters; None otherwise."""
    if match := _BYTE_TOKEN.match(token):
        return bytes([int(match.group(1), 16)])
    decoder = _byte_decoder()
    if token and all(ch in decoder for ch in token):
        return bytes(decoder[ch] for ch in token)
    return None


def token_bytes(tokenizer: Any, token_ids: list[int] | tuple[int, ...]) -> list[bytes]:
    """The bytes each token stands for: exact for byte-level BPE and SentencePiece byte tokens,
    else the token's own decoded text (special tokens: their name)."""
    pieces = []
    for token_id, token in zip(token_ids, tokenizer.convert_ids_to_tokens(list(token_ids)), strict=True):
        exact = piece_bytes(token or "")
        pieces.append(
            exact if exact is not None else tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode()
        )
    return pieces
