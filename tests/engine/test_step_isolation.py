"""A pass that fails because of one sequence fails that sequence only: the engine retries the
pass without it (bisecting), and every other sequence's tokens equal an undisturbed run."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import StepInput
from pdserve.engine.sampling_params import SamplingParams

PROMPTS = {
    "a": list(range(10, 30)),
    "b": list(range(40, 47)),
    "poison": list(range(60, 75)),
    "c": list(range(80, 113)),
    "d": [5, 6, 7],
}
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def _run(engine: LLMEngine) -> dict[str, list]:  # noqa: ANN001
    """Add every prompt, step to the end; return each request's outputs (token ids, or the error)."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, PARAMS)
    got: dict[str, list] = {rid: [] for rid in PROMPTS}
    while engine.has_work:
        for out in engine.step():
            got[out.request_id].append(out.error if out.error is not None else out.token_id)
    return got


def _fail_with(engine: LLMEngine, request_id: str, after_outputs: int) -> list[int]:
    """Make every pass that includes `request_id` raise once it has `after_outputs` tokens
    (a fault keyed on one request). Returns a list that records the size of every pass."""
    forward = engine.runner.forward
    victim = engine.sequences.get  # looked up at call time: the sequence exists only once added
    passes: list[int] = []

    def faulty(items: list[StepInput], on_layer_done=None) -> torch.Tensor:  # noqa: ANN001
        passes.append(len(items))
        seq = victim(request_id)
        if (
            seq is not None
            and len(seq.output_ids) >= after_outputs
            and any(item.block_table is seq.block_table for item in items)
        ):
            raise RuntimeError(f"{request_id} broke the pass")
        return forward(items, on_layer_done=on_layer_done)

    engine.runner.forward = faulty  # type: ignore[method-assign]
    return passes


def test_a_decode_step_failing_because_of_one_sequence_fails_only_it(tiny_llama, make_engine) -> None:  # noqa: ANN001
    undisturbed = _run(make_engine(tiny_llama))
    engine = make_engine(tiny_llama)
    passes = _fail_with(engine, "poison", after_outputs=3)
    got = _run(engine)
    assert got["poison"] == undisturbed["poison"][:3] + ["poison broke the pass"]
    for rid in ("a", "b", "c", "d"):
        assert got[rid] == undisturbed[rid], rid
    assert max(passes) == len(PROMPTS)  # they really shared passes with it
    # the fixture checks that every block is back in the pool and no request is left


@pytest.mark.slow
def test_a_prefill_chunk_failing_fails_only_its_prompt(tiny_llama, make_engine) -> None:  # noqa: ANN001
    undisturbed = _run(make_engine(tiny_llama, prefill_chunk_tokens=8))
    engine = make_engine(tiny_llama, prefill_chunk_tokens=8)
    _fail_with(engine, "poison", after_outputs=0)  # its very first chunk breaks every pass
    got = _run(engine)
    assert got["poison"] == ["poison broke the pass"]
    for rid in ("a", "b", "c", "d"):
        assert got[rid] == undisturbed[rid], rid


def test_a_pass_that_always_fails_fails_every_sequence_alone_and_frees_everything(tiny_llama, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_llama)

    def broken(items: list[StepInput], on_layer_done=None) -> torch.Tensor:  # noqa: ANN001
        raise RuntimeError("device lost")

    engine.runner.forward = broken  # type: ignore[method-assign]
    got = _run(engine)
    assert got == {rid: ["device lost"] for rid in PROMPTS}
