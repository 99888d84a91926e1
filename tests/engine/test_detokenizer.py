from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.detokenizer import IncrementalDetokenizer


def _stream(tokenizer, ids: list[int]) -> list[str]:  # noqa: ANN001
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in ids]
    return deltas + [detok.flush()]


def test_chinese_characters_never_split(default_model) -> None:  # noqa: ANN001
    tok = default_model.tokenizer
    text = "济南的冬天是响晴的。🙂 Winter in Jinan."
    ids = tok(text, add_special_tokens=False).input_ids
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(deltas)
    assert any(d == "" for d in deltas[:-1])  # some tokens carried only part of a character


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 40))
def test_random_streams_concatenate_to_full_decode(default_model, seed: int, length: int) -> None:  # noqa: ANN001
    tok = default_model.tokenizer
    rng = random.Random(seed)
    vocab = len(tok)
    ids = [rng.randrange(vocab) for _ in range(length)]
    deltas = _stream(tok, ids)
    for delta in deltas:
        delta.encode("utf-8")  # valid UTF-8: no lone surrogates
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
