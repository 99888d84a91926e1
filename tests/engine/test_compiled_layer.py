"""The compiled decode layer (engine/compiled_layer.py): greedy fp32 tokens identical to
transformers' `generate` on tiny Llama, Qwen2 and Qwen3 models with compiling on, and a clean
eager fallback, with a log line, when compiling fails (as on a machine without a C++ compiler)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine import compiled_layer
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_loader import load_model
from pdserve.engine.model_runner import ModelRunner
from tests.engine.test_fast_forward import PROMPTS, _greedy, save_family_model

pytestmark = pytest.mark.slow  # compiling takes tens of seconds per model on a 2-core CPU

STEPS = 10


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Path:
    return save_family_model(request.param, tmp_path_factory.mktemp(f"compiled-{request.param}"), default_model_dir)


def _generate(model_dir: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    out = []
    for prompt in prompts:
        with torch.no_grad():
            out.append(
                reference.generate(
                    torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps, pad_token_id=0
                )[0, len(prompt) :].tolist()
            )
    return out


def _runner(model_dir: Path, prompts: list[list[int]], compile: bool) -> ModelRunner:  # noqa: A002
    loaded = load_model(model_dir)
    return ModelRunner(loaded, KVCache(loaded.kv_shape(4), 16 * len(prompts)), forward="fast", compile=compile)


def test_compiled_greedy_matches_generate(family_dir: Path) -> None:
    runner = _runner(family_dir, PROMPTS, compile=True)
    assert runner.fast is not None and runner.fast.compiled is not None
    got = _greedy(runner, PROMPTS, steps=STEPS)  # contexts of different lengths: the padded graph
    single = _greedy(_runner(family_dir, PROMPTS[:1], compile=True), PROMPTS[:1], steps=STEPS)  # batch 1
    compiled = runner.fast.compiled
    assert compiled.failed is None
    assert compiled.calls == STEPS * runner.loaded.config.num_hidden_layers  # every decode layer ran compiled
    want = _generate(family_dir, PROMPTS, STEPS)
    assert got == want
    assert single == want[:1]


def test_compile_is_off_unless_asked(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compiled_layer.COMPILE_ENV, raising=False)
    assert _runner(tiny_llama_dir, PROMPTS, compile=False).fast.compiled is None  # type: ignore[union-attr]
    assert compiled_layer.compile_requested(True) and not compiled_layer.compile_requested()
    monkeypatch.setenv(compiled_layer.COMPILE_ENV, "1")
    assert compiled_layer.compile_requested()


def test_failed_compile_falls_back_to_eager_with_a_log_line(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> None:
        raise RuntimeError("Compiler: c++ is not found")

    monkeypatch.setattr(compiled_layer, "BACKEND", no_compiler)
    runner = _runner(tiny_llama_dir, PROMPTS, compile=True)
    with caplog.at_level("WARNING", logger="pdserve.engine.compiled_layer"):
        got = _greedy(runner, PROMPTS, steps=6)
    compiled = runner.fast.compiled  # type: ignore[union-attr]
    assert compiled is not None and compiled.calls == 0
    assert compiled.failed is not None and "c++ is not found" in compiled.failed
    assert caplog.text.count("compiling the decode layer failed") == 1  # said once, not per layer
    assert "c++ is not found" in caplog.text
    assert got == _generate(tiny_llama_dir, PROMPTS, 6)
