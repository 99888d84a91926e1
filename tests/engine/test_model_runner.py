"""The paged runner against transformers' own forward on tiny Llama and Qwen2 models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.model_runner import ModelRunner, StepInput


@pytest.fixture(scope="module")
def reference(tiny_model: LoadedModel) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model.path, attn_implementation="sdpa").eval()


def _ref_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_packed_prefill_then_decode_matches_reference(tiny_model, reference) -> None:  # noqa: ANN001
    runner = ModelRunner(tiny_model, KVCache(tiny_model.kv_shape(4), 64))
    seqs = [list(range(5, 18)), list(range(100, 107)), [42]]
    tables = [[0, 1, 2, 3, 4, 5], [10, 11, 12, 13], [20, 21, 22]]
    logits = runner.forward([StepInput(s, 0, t) for s, t in zip(seqs, tables, strict=True)])
    for step in range(6):
        for i, seq in enumerate(seqs):
            torch.testing.assert_close(logits[i], _ref_logits(reference, seq), atol=1e-4, rtol=1e-4)
        nxt = [int(row.argmax()) for row in logits]
        logits = runner.forward([StepInput([n], len(s), t) for s, n, t in zip(seqs, nxt, tables, strict=True)])
        seqs = [s + [n] for s, n in zip(seqs, nxt, strict=True)]
        del step


def test_prefill_in_chunks_reads_cached_prefix(tiny_model, reference) -> None:  # noqa: ANN001
    runner = ModelRunner(tiny_model, KVCache(tiny_model.kv_shape(4), 16))
    prompt = list(range(200, 223))
    table = [3, 1, 4, 0, 5, 9]  # deliberately out of order
    runner.forward([StepInput(prompt[:9], 0, table)])
    logits = runner.forward([StepInput(prompt[9:], 9, table)])
    torch.testing.assert_close(logits[0], _ref_logits(reference, prompt), atol=1e-4, rtol=1e-4)


def test_forward_rejects_short_block_table(tiny_model) -> None:  # noqa: ANN001
    runner = ModelRunner(tiny_model, KVCache(tiny_model.kv_shape(4), 8))
    with pytest.raises(ValueError, match="block table too short"):
        runner.forward([StepInput(list(range(9)), 0, [0, 1])])
    with pytest.raises(ValueError, match="at least one new token"):
        runner.forward([StepInput([], 0, [0])])
