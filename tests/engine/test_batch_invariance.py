"""Batch-invariant mode (EngineConfig.deterministic) in one process: the logits at a token have the
same bits whether its prompt runs alone, in chunks, beside other prompts in one pass, or as a decode
row beside other decodes and a prefill, in float32 and bfloat16, for the Llama and Qwen2 families.
Bits, not tokens: a changed summation order anywhere in the pass shows here even where the argmax
does not move."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_loader import load_model
from pdserve.engine.model_runner import ModelRunner, StepInput

BLOCK = 16


def _runner(model_dir: Path, dtype: torch.dtype) -> ModelRunner:
    loaded = load_model(model_dir, dtype)
    return ModelRunner(loaded, KVCache(loaded.kv_shape(BLOCK), 64), deterministic=True)


def _blocks(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BLOCK)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_logits_do_not_depend_on_its_batch_or_chunking(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    runner = _runner(tiny_model_dir, dtype)
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    target = torch.randint(5, vocab, (45,), generator=gen).tolist()
    others = [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (7, 33, 70)]
    table = _blocks(0, 46)

    alone = runner.forward([StepInput(target, 0, table)])[0]
    # in three chunks of another size, each pass after the first reading the cached prefix
    runner.forward([StepInput(target[:10], 0, table)])
    runner.forward([StepInput(target[10:31], 10, table)])
    chunked = runner.forward([StepInput(target[31:], 31, table)])[0]
    # in one pass beside three other prompts, in the middle of the pack
    items = [
        StepInput(others[0], 0, _blocks(10, 7)),
        StepInput(target, 0, table),
        StepInput(others[1], 0, _blocks(20, 33)),
        StepInput(others[2], 0, _blocks(30, 70)),
    ]
    beside = runner.forward(items)[1]
    assert torch.equal(chunked, alone) and torch.equal(beside, alone)

    # the next token as a decode row: alone, then beside the other sequences' decodes and a new prompt
    nxt = int(alone.argmax())
    decode_alone = runner.forward([StepInput([nxt], 45, table)])[0]
    mixed = [
        StepInput([11], 7, _blocks(10, 8)),
        StepInput([nxt], 45, table),
        StepInput([12], 33, _blocks(20, 34)),
        StepInput(others[2][:50], 0, _blocks(40, 50)),
    ]
    decode_beside = runner.forward(mixed)[1]
    assert torch.equal(decode_beside, decode_alone)
    # and the decode row's K/V equal what a prefill of the same 46 tokens writes
    reprefill = runner.forward([StepInput(target + [nxt], 0, _blocks(50, 46))])[0]
    assert torch.equal(reprefill, decode_alone)


def test_deterministic_mode_refuses_what_it_cannot_hold(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir)
    with pytest.raises(ValueError, match="deterministic mode runs the fast forward"):
        ModelRunner(loaded, KVCache(loaded.kv_shape(BLOCK), 8), forward="hf", deterministic=True)
