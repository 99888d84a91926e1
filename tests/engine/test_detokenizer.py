from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.detokenizer import IncrementalDetokenizer


def _stream(tokenizer, ids: list[int]) -> list[str]:  # noqa: ANN001
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in ids]
    return deltas + [detok.flush()]


def test_chinese_characters_never_split(default_tokenizer) -> None:  # noqa: ANN001
    tok = default_tokenizer
    text = "济南的冬天是响晴的。🙂 Winter in Jinan."
    ids = tok(text, add_special_tokens=False).input_ids
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(deltas)
    assert any(d == "" for d in deltas[:-1])  # some tokens carried only part of a character


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 40))
def test_random_streams_concatenate_to_full_decode(default_tokenizer, seed: int, length: int) -> None:  # noqa: ANN001
    tok = default_tokenizer
    rng = random.Random(seed)
    vocab = len(tok)
    ids = [rng.randrange(vocab) for _ in range(length)]
    deltas = _stream(tok, ids)
    for delta in deltas:
        delta.encode("utf-8")  # valid UTF-8: no lone surrogates
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_a_generated_replacement_character_streams_when_generated(default_tokenizer) -> None:  # noqa: ANN001
    """U+FFFD the model really writes is not an incomplete character: it streams with its token, not
    at the end (700 such tokens used to arrive as one chunk at the finish)."""
    tok = default_tokenizer
    ids = tok("\ufffd", add_special_tokens=False).input_ids * 50  # nothing but U+FFFD, as in the report
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(t) for t in ids]
    tail = detok.flush()
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(deltas) == "\ufffd" * 50 and tail == ""
    assert "".join(deltas[: len(ids) // 2]) == "\ufffd" * 25  # each arrived with its own tokens


def test_utf8_tail_check() -> None:
    from pdserve.engine.detokenizer import ends_inside_a_character
    from pdserve.engine.trace import piece_bytes

    assert ends_inside_a_character("é".encode()[:1])
    assert ends_inside_a_character("济".encode()[:2])
    assert ends_inside_a_character("🙂".encode()[:3])
    assert not ends_inside_a_character("é".encode())
    assert not ends_inside_a_character("\ufffd".encode())  # the character itself, complete
    assert not ends_inside_a_character(b"abc")
    assert piece_bytes("<0xE9>") == b"\xe9"  # SentencePiece byte fallback, not the text "<0xE9>"
    assert piece_bytes("Ġhello") == b" hello"  # byte-level BPE: Ġ is the space
    assert piece_bytes("\u2581Paris") is None  # SentencePiece text: the tokenizer decodes it
