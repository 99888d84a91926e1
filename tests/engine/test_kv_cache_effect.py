"""benchmarks/kv_cache_effect.py: the no-cache path (a pass over the whole sequence every step, through the
engine's own forward) must produce exactly the tokens of the paged-KV-cache path."""

from __future__ import annotations

import pytest

from benchmarks.kv_cache_effect import PROMPT, measure


def test_no_cache_path_generates_the_same_tokens_tiny(tiny_model) -> None:  # noqa: ANN001
    prompt = tiny_model.tokenizer(PROMPT).input_ids
    result = measure(tiny_model, prompt, max_tokens=48, dense=40, positions=[44, 48], repeats=1)
    assert len(result.cached_tokens) == 48 and len(result.dense_tokens) == 40
    assert result.dense_tokens == result.cached_tokens[:40]
    assert result.sparse_match == {44: True, 48: True}
    assert result.identical
    assert all(s > 0 for s in result.cached_s + result.dense_s)
    assert set(result.sparse_s) == set(result.paired_cached_s) == {44, 48} and result.ratio(48) > 0


@pytest.mark.slow
def test_no_cache_path_generates_the_same_tokens_default_model(default_model) -> None:  # noqa: ANN001
    prompt = default_model.tokenizer(PROMPT).input_ids
    result = measure(default_model, prompt, max_tokens=12, dense=8, positions=[12], repeats=1)
    assert result.dense_tokens == result.cached_tokens[:8] and result.sparse_match == {12: True}
    assert result.ratio(12) > 0
