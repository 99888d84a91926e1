"""Continuous batching and preemption give the same tokens as decoding each request alone."""

from __future__ import annotations

import random

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_text

WORDS = "river mill evening children market flour dawn sea poem capital France story old light".split()


def _prompts(tokenizer, n: int, seed: int) -> list[list[int]]:  # noqa: ANN001
    rng = random.Random(seed)
    return [encode_text(tokenizer, " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))) for _ in range(n)]


def test_32_sequences_joining_and_leaving_match_solo_runs(default_model, make_engine) -> None:  # noqa: ANN001
    prompts = _prompts(default_model.tokenizer, 32, seed=7)
    rng = random.Random(3)
    # up to 8 tokens each (151 in all): up to 12 sequences share a step, and the 32 solo runs, one
    # pass of the default model per token, stay short
    params = [SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True) for _ in prompts]
    joins = [rng.randint(0, 10) for _ in prompts]  # the step at which each request arrives
    engine = make_engine(default_model, max_num_batched_tokens=64)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step, max_batch = 0, 0
    while step <= max(joins) or engine.has_work:
        for i in [i for i, j in enumerate(joins) if j == step]:
            engine.add_request(str(i), prompts[i], params[i])
        max_batch = max(max_batch, len(engine.scheduler.running))
        for out in engine.step():
            got[out.request_id].append(out.token_id)
        step += 1
    assert max_batch > 8  # sequences really shared decode steps
    solo = make_engine(default_model)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        assert got[str(i)] == solo.generate([prompt], p)[0], f"request {i}"


def test_preemption_recomputes_and_matches(tiny_llama_dir, make_engine) -> None:  # noqa: ANN001
    from pdserve.engine.model_loader import load_model

    loaded = load_model(tiny_llama_dir)
    prompts = _prompts(loaded.tokenizer, 6, seed=11)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    roomy = make_engine(loaded).generate(prompts, params)
    tight = make_engine(loaded, num_blocks=12, block_size=8)
    assert tight.generate(prompts, params) == roomy
    assert tight.scheduler.num_preemptions > 0


def test_request_too_long_for_the_pool_finishes_with_length(tiny_llama_dir, make_engine) -> None:  # noqa: ANN001
    from pdserve.engine.model_loader import load_model

    engine = make_engine(load_model(tiny_llama_dir), num_blocks=2, block_size=8)
    engine.add_request("r", list(range(10, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens < 50


def test_abort_frees_blocks(default_model, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(default_model)
    engine.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.pool.num_used > 0
    engine.abort("a")
    engine.abort("unknown")  # no-op
    assert not engine.has_work
