"""Log-probabilities of output and prompt tokens equal Hugging Face's log_softmax of the fp32 logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams


def run(engine, prompt_ids: list[int], params: SamplingParams) -> list:  # noqa: ANN001
    engine.add_request("r", prompt_ids, params)
    outputs = []
    while engine.has_work:
        outputs += [o for o in engine.step() if o.token_id >= 0]
    return outputs


@pytest.mark.parametrize(("chunk", "temperature"), [(None, 0.0), (7, 0.8)])
def test_logprobs_match_hf(tiny_llama_dir, make_engine, chunk: int | None, temperature: float) -> None:  # noqa: ANN001
    loaded = load_model(tiny_llama_dir)
    overrides = {"max_num_batched_tokens": chunk} if chunk else {}
    engine = make_engine(loaded, prefix_caching=True, **overrides)
    prompt = loaded.tokenizer("The river ran past the old mill, and the children").input_ids
    run(engine, prompt, SamplingParams(max_tokens=2))  # fills the prefix cache: prompt logprobs must skip it
    params = SamplingParams(
        max_tokens=6, temperature=temperature, seed=1, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    outputs = run(engine, prompt, params)
    out_ids = [o.token_id for o in outputs]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out_ids])).logits[0].float(), dim=-1)
    got_prompt = outputs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    assert [e.token_id for e in got_prompt] == prompt and got_prompt[0].logprob is None
    for position in range(1, len(prompt)):
        entry, want = got_prompt[position], ref[position - 1]
        assert abs(entry.logprob - want[prompt[position]].item()) < 1e-4
        top = torch.topk(want, 2)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(entry.top, top.values.tolist(), strict=True)) < 1e-4
    for i, out in enumerate(outputs):
        want = ref[len(prompt) - 1 + i]
        assert out.logprob.token_id == out.token_id
        assert abs(out.logprob.logprob - want[out.token_id].item()) < 1e-4  # before temperature
        assert [t for t, _ in out.logprob.top] == torch.topk(want, 3).indices.tolist()


def test_no_logprobs_unless_asked(tiny_llama_dir, make_engine) -> None:  # noqa: ANN001
    loaded = load_model(tiny_llama_dir)
    outputs = run(make_engine(loaded), [1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(o.logprob is None and o.prompt_logprobs is None for o in outputs)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
