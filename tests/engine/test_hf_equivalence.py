"""Our prefill + batched paged decode against Hugging Face on the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.model_runner import StepInput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_chat, encode_text

PARAGRAPH = (
    "The river ran quietly past the old mill, carrying leaves and the last light of the evening. "
    "Children who had played on its banks all afternoon went home one by one, and the miller, "
    "an old man with flour in his beard, counted the sacks he would carry to market at dawn. "
)

PROMPTS = [
    ("text", "Hello"),
    ("text", "济南的冬天"),
    ("text", "The capital of France is"),
    ("chat", "What is the capital of France?"),
    ("chat", "Write a short poem about the sea."),
    ("text", "def fibonacci(n):\n    "),
    ("text", PARAGRAPH * 9 + "Summarize the story above in one sentence:"),
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def _encode(loaded: LoadedModel, kind: str, text: str) -> list[int]:
    if kind == "chat":
        return encode_chat(loaded.tokenizer, [("user", text)])
    return encode_text(loaded.tokenizer, text)


def test_prompt_set_covers_the_acceptance_cases(default_model: LoadedModel) -> None:
    lengths = [len(_encode(default_model, k, t)) for k, t in PROMPTS]
    assert len(set(lengths)) == len(PROMPTS) and max(lengths) > 500


def test_batched_greedy_matches_hf_generate(default_model, hf_model, make_engine) -> None:  # noqa: ANN001
    prompts = [_encode(default_model, k, t) for k, t in PROMPTS]
    engine = make_engine(default_model)
    ours = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert engine.runner.num_forward_passes < len(prompts) * MAX_TOKENS  # decoded together, not one by one
    eos = sorted(default_model.eos_token_ids)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
        assert got == ref[0, len(prompt) :].tolist(), default_model.tokenizer.decode(prompt)[:60]


def test_prefill_kv_matches_transformers_cache(default_model, hf_model, make_engine) -> None:  # noqa: ANN001
    prompt = _encode(default_model, "text", PARAGRAPH)
    engine = make_engine(default_model)
    blocks = engine.pool.allocate(-(-len(prompt) // engine.config.block_size))
    try:
        engine.runner.forward([StepInput(prompt, 0, blocks)])
        with torch.no_grad():
            cache = hf_model(torch.tensor([prompt]), use_cache=True).past_key_values
        ours = engine.kv_cache.gather(blocks).flatten(2, 3)[:, :, : len(prompt)]  # [L, 2, T, H, D]
        for layer in range(default_model.config.num_hidden_layers):
            ref_k = cache.layers[layer].keys[0].transpose(0, 1)  # [T, H, D]
            ref_v = cache.layers[layer].values[0].transpose(0, 1)
            torch.testing.assert_close(ours[layer, 0], ref_k, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ours[layer, 1], ref_v, atol=1e-4, rtol=1e-4)
    finally:
        engine.pool.free(blocks)
