"""A decode engine with prefix caching keeps the blocks of prompts it received; a later prompt with
the same prefix reserves them again and needs only the remaining blocks shipped."""

from __future__ import annotations

import torch

from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.model_runner import StepInput
from pdserve.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _prefill(engine, prompt: list[int]) -> tuple[torch.Tensor, int]:  # noqa: ANN001
    """What a prefill worker ships: the prompt's K/V blocks and its greedy first token."""
    blocks = engine.pool.allocate(blocks_for_tokens(len(prompt), engine.pool.block_size))
    try:
        logits = engine.runner.forward([StepInput(prompt, 0, blocks)])
        return engine.kv_cache.gather(blocks), int(logits[0].argmax())
    finally:
        engine.pool.free(blocks)


def _run(engine, outputs: dict[str, list[int]]) -> None:  # noqa: ANN001
    while engine.has_work:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out.token_id)


def test_shared_prefix_blocks_are_reused_and_outputs_match(tiny_model, make_engine) -> None:  # noqa: ANN001
    prefix = list(range(10, 50))  # 40 tokens: 2 full blocks of 16 and part of a third
    prompts = {"a": prefix + [7, 8, 9], "b": prefix + [60, 61], "c": [5, 6] + prefix}
    expected = make_engine(tiny_model).generate(list(prompts.values()), PARAMS)

    source = make_engine(tiny_model)
    decode = make_engine(tiny_model, prefix_caching=True)
    outputs: dict[str, list[int]] = {}

    def commit(seq, kv: torch.Tensor, first: int) -> None:  # noqa: ANN001
        out = decode.commit_prefilled(seq, kv, first)
        outputs.setdefault(out.request_id, []).append(out.token_id)

    seq_a = decode.reserve("a", prompts["a"], PARAMS)
    assert seq_a is not None and seq_a.num_reused_blocks == 0
    commit(seq_a, *_prefill(source, prompts["a"]))
    for out in decode.step():  # "a" is decoding (its blocks in use) when "b" arrives
        outputs["a"].append(out.token_id)

    seq_b = decode.reserve("b", prompts["b"], PARAMS)
    assert seq_b is not None and seq_b.num_reused_blocks == 2
    assert seq_b.block_table[:2] == seq_a.block_table[:2]
    assert decode.pool.ref_count(seq_a.block_table[0]) == 2
    kv, first = _prefill(source, prompts["b"])
    commit(seq_b, kv[:, :, 2:], first)  # only the blocks it lacks

    seq_c = decode.reserve("c", prompts["c"], PARAMS)  # the same tokens at other positions: no reuse
    assert seq_c is not None and seq_c.num_reused_blocks == 0
    commit(seq_c, *_prefill(source, prompts["c"]))
    _run(decode, outputs)
    assert [outputs[k] for k in prompts] == expected
    assert decode.pool.cache_hits == 2


def test_a_reservation_that_does_not_fit_returns_its_shared_blocks(tiny_model, make_engine) -> None:  # noqa: ANN001
    source = make_engine(tiny_model)
    decode = make_engine(tiny_model, prefix_caching=True, num_blocks=8)
    prompt = list(range(100, 148))  # 3 full blocks
    seq = decode.reserve("a", prompt, PARAMS)
    assert seq is not None
    kv, first = _prefill(source, prompt)
    decode.commit_prefilled(seq, kv, first)
    decode.abort("a")  # its 3 full blocks stay cached, evictable
    assert decode.pool.num_cached == 3 and decode.pool.num_used == 0

    too_long = prompt + list(range(200, 300))  # shares 3 blocks but needs 10 in all: 8 exist
    assert decode.reserve("b", too_long, PARAMS) is None
    assert decode.pool.num_used == 0 and "b" not in decode.sequences
    again = decode.reserve("c", prompt + [1], PARAMS)
    assert again is not None and again.num_reused_blocks == 3
    decode.abort("c")


def test_without_prefix_caching_nothing_is_reused(tiny_model, make_engine) -> None:  # noqa: ANN001
    source = make_engine(tiny_model)
    decode = make_engine(tiny_model)
    prompt = list(range(100, 148))
    for rid in ("a", "b"):
        seq = decode.reserve(rid, prompt, PARAMS)
        assert seq is not None and seq.num_reused_blocks == 0
        kv, first = _prefill(source, prompt)
        decode.commit_prefilled(seq, kv, first)
        decode.abort(rid)
    assert decode.pool.num_cached == 0
