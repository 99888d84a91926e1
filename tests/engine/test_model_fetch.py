"""Tests for engine.model_fetch: the converted default model and the q/k un-permutation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.model_fetch import fetch_default_model, resolve_model, unpermute_qk


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's forward permutation of q/k rows."""
    out_features, in_features = w.shape
    return (
        w.reshape(n_head, 2, out_features // n_head // 2, in_features)
        .swapaxes(1, 2)
        .reshape(out_features, in_features)
    )


@pytest.mark.parametrize(("n_head", "head_dim", "in_features"), [(1, 2, 1), (3, 4, 5), (9, 64, 7)])
def test_unpermute_qk_inverts_llama_cpp_permute(n_head: int, head_dim: int, in_features: int) -> None:
    w = np.arange(n_head * head_dim * in_features, dtype=np.float32).reshape(n_head * head_dim, in_features)
    permuted = _llama_cpp_permute(w, n_head)
    if head_dim > 2:
        assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


def test_resolve_model_rejects_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="local Hugging Face model folder") as info:
        resolve_model(tmp_path / "does-not-exist")
    assert "not supported" in str(info.value)


def test_resolve_model_accepts_local_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return fetch_default_model(progress=lambda _s: None)


@pytest.mark.slow
def test_default_model_folder_contents(model_dir: Path) -> None:
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json", ".complete"):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["eos_token_id"] == 2 and config["tie_word_embeddings"] is True
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert resolve_model(None) == model_dir and resolve_model("default") == model_dir


@pytest.mark.slow
def test_default_model_greedy_says_paris(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    new_tokens = [tok.decode([t]) for t in out[0, inputs["input_ids"].shape[1] :].tolist()]
    assert " Paris" in new_tokens, new_tokens
