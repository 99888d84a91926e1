"""Live migration at the engine level: a sequence suspended on one engine and committed on another
(with the K/V of every token but the last) decodes on with the tokens of an undisturbed run, and
the target computes no prompt token; blocks the target shares from its prefix cache are not written."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import SequenceStatus
from pdserve.tokenization import encode_text

PROMPT = "The old mill by the river, the market and the winter city " * 4


def _run(engine, request_id: str) -> list[int]:  # noqa: ANN001
    tokens = []
    while engine.has_work:
        tokens += [o.token_id for o in engine.step() if o.request_id == request_id and o.token_id >= 0]
    return tokens


def _move(source, target, request_id: str, new_id: str, block_offset: int = 0) -> None:  # noqa: ANN001
    seq = source.suspend(request_id)
    assert seq.status is SequenceStatus.HANDED_OFF and seq not in source.scheduler.running
    source.abort(request_id)  # what the source's ended stream does: a suspended sequence is left alone
    assert request_id in source.sequences
    num_tokens = seq.num_tokens - 1
    blocks = seq.block_table[block_offset : blocks_for_tokens(num_tokens, source.pool.block_size)]
    kv = source.kv_cache.gather(blocks)
    moved = target.reserve(new_id, seq.prompt_ids, seq.params, list(seq.output_ids))
    assert moved is not None
    target.commit_migrated(moved, kv, block_offset)
    source.release_handoff(seq)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, ignore_eos=True),
        SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, seed=5),
    ],
    ids=["greedy", "seeded"],
)
def test_suspended_sequence_decodes_on_elsewhere_identically(tiny_llama_dir, make_engine, params) -> None:  # noqa: ANN001
    loaded = load_model(tiny_llama_dir)
    ids = encode_text(loaded.tokenizer, PROMPT)
    expected = make_engine(loaded).generate([ids], params)[0]
    source, target = make_engine(loaded), make_engine(loaded)
    source.add_request("r", ids, params)
    got = []
    while len(got) < 13:
        got += [o.token_id for o in source.step() if o.token_id >= 0]
    _move(source, target, "r", "r2")
    assert not source.sequences and not source.has_work
    got += _run(target, "r2")
    assert got == expected
    assert target.runner.num_prefill_tokens == 0  # no prompt token computed on the target


def test_prefix_blocks_the_target_holds_are_shared_not_written(tiny_llama_dir, make_engine) -> None:  # noqa: ANN001
    loaded = load_model(tiny_llama_dir)
    ids = encode_text(loaded.tokenizer, PROMPT)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = make_engine(loaded).generate([ids], params)[0]
    source = make_engine(loaded)
    target = make_engine(loaded, prefix_caching=True)
    target.generate([ids], SamplingParams(max_tokens=1))  # the target caches the prompt's full blocks
    source.add_request("r", ids, params)
    got = []
    while len(got) < 5:
        got += [o.token_id for o in source.step() if o.token_id >= 0]
    seq = source.sequences["r"]
    reused = target.reserve("probe", seq.prompt_ids, seq.params, list(seq.output_ids))
    offset = reused.num_reused_blocks
    target.abort("probe")
    assert offset >= 1
    _move(source, target, "r", "r2", block_offset=offset)
    got += _run(target, "r2")
    assert got == expected
