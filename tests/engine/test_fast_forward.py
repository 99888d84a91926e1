"""The fast forward (engine/fast_forward.py) against transformers, per supported family and per
linear kernel: the same logits as the transformers path, greedy tokens identical to `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.fast_forward import FastForward, Linear, LinearFactory, Rope, fast_forward_for
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.engine.model_runner import ModelRunner, StepInput
from tests.conftest import TINY

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _config(family: str, vocab: int) -> object:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    extra: dict[str, object] = {"head_dim": 16} if family == "qwen3" else {}
    if family == "mistral":
        extra["sliding_window"] = None
    return cls(vocab_size=vocab, eos_token_id=2, bos_token_id=1, **TINY, **extra)


def save_family_model(family: str, out: Path, tokenizer_dir: Path) -> Path:
    """A tiny random-weight model of `family` (fixed seed) with the tokenizer of `tokenizer_dir`,
    saved as a model folder in `out`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(4321)
    AutoModelForCausalLM.from_config(_config(family, len(tokenizer))).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Path:
    return save_family_model(request.param, tmp_path_factory.mktemp(f"fast-{request.param}"), default_model_dir)


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill every prompt in one packed pass, then decode them together; greedy tokens."""
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    logits = runner.forward([StepInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = [int(row.argmax()) for row in logits]
        for i, n in enumerate(nxt):
            out[i].append(n)
        logits = runner.forward([StepInput([n], len(s), t) for s, n, t in zip(seqs, nxt, tables, strict=True)])
        seqs = [s + [n] for s, n in zip(seqs, nxt, strict=True)]
    return out


PROMPTS = [list(range(5, 18)), list(range(300, 307)), [42], list(range(1000, 1040, 2))]


@pytest.mark.parametrize("linear", ["native", "plain", "packed"])
def test_fast_forward_greedy_matches_generate(family_dir: Path, linear: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_LINEAR", linear)
    loaded = load_model(family_dir)
    runner = ModelRunner(loaded, KVCache(loaded.kv_shape(4), 16 * len(PROMPTS)), forward="fast")
    assert runner.forward_name == "fast" and runner.fast is not None
    expected = linear if linear in runner.fast.factory.kernels else "plain"
    assert runner.fast.layers[0].qkv.bands == ((expected, 1),)
    assert (runner.fast.layers[0].qkv.packed is not None) == (expected == "packed")
    got = _greedy(runner, PROMPTS, steps=12)
    reference = AutoModelForCausalLM.from_pretrained(family_dir, attn_implementation="eager").eval()
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            want = reference.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert tokens == want


def test_fast_and_hf_forward_give_the_same_logits(family_dir: Path) -> None:
    loaded = load_model(family_dir)
    fast = ModelRunner(loaded, KVCache(loaded.kv_shape(4), 64), forward="fast")
    hf = ModelRunner(loaded, KVCache(loaded.kv_shape(4), 64), forward="hf")
    assert (fast.forward_name, hf.forward_name) == ("fast", "hf")
    items = [StepInput(list(range(7, 20)), 0, [0, 1, 2, 3]), StepInput([9, 8, 7], 0, [5, 6])]
    torch.testing.assert_close(
        fast.forward(items, full_rows=[0]), hf.forward(items, full_rows=[0]), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(fast.full_logits[0], hf.full_logits[0], atol=1e-5, rtol=1e-5)
    # a mixed pass: two decodes, then a prompt that reads a cached prefix (chunked prefill)
    mixed = [
        StepInput([3], 13, [0, 1, 2, 3]),
        StepInput([4], 3, [5, 6]),
        StepInput(list(range(50, 58)), 0, [8, 9]),
    ]
    torch.testing.assert_close(fast.forward(mixed), hf.forward(mixed), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.kv_cache.kv, hf.kv_cache.kv, atol=1e-5, rtol=1e-5)


def test_fused_weights_are_shared_with_the_transformers_modules(tiny_llama: LoadedModel) -> None:
    fast = fast_forward_for(tiny_llama.model)
    assert fast is not None
    attn = tiny_llama.model.model.layers[0].self_attn
    qkv = fast.layers[0].qkv.weight
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()  # a row view, not a copy
    nq = attn.q_proj.weight.shape[0]
    assert attn.k_proj.weight.data_ptr() == qkv[nq:].data_ptr()
    assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), qkv)


@pytest.mark.parametrize("linear", ["plain", "native"])
def test_weights_are_stored_in_one_copy_in_the_kernels_layout(
    tiny_llama_dir: Path, linear: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_LINEAR", linear)
    loaded = load_model(tiny_llama_dir)
    fast = FastForward.build(loaded.model)
    assert fast is not None
    column_major = fast.factory.column_major
    assert column_major == (linear == "plain" or "native" not in fast.factory.kernels)
    layer, mlp = fast.layers[0], loaded.model.model.layers[0].mlp
    for linear_ in (layer.qkv, layer.o, layer.gate_up, layer.down, fast.lm_head):
        n, k = linear_.weight.shape
        # column-major: [N, K] viewed over [K, N] contiguous memory; else row-major as torch keeps it
        assert linear_.weight.stride() == ((1, n) if column_major else (k, 1))
    assert mlp.down_proj.weight.data_ptr() == layer.down.weight.data_ptr()  # re-pointed, not copied
    assert loaded.model.lm_head.weight.data_ptr() == fast.lm_head.weight.data_ptr()


def test_rope_is_transformers_rope_bit_for_bit() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    for tokens in (1, 9):
        cos, sin = torch.randn(tokens, 16), torch.randn(tokens, 16)
        q, k = torch.randn(tokens, 4, 16), torch.randn(tokens, 2, 16)
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        got = Rope(cos, sin)(torch.cat([q, k], dim=1)[:, :6])  # a view, as the layer passes it
        assert torch.equal(got[:, :4], want_q) and torch.equal(got[:, 4:], want_k)


@pytest.mark.parametrize("family", FAMILIES)
def test_rms_norm_is_the_modules_arithmetic_bit_for_bit(family: str) -> None:
    import importlib

    from pdserve.engine.fast_forward import _rms_norm

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, f"{family.capitalize()}RMSNorm")(576, eps=1e-6)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))  # not all ones: the weight must be applied
        for rows in (1, 9):
            x = torch.randn(rows, 576) * 3
            assert torch.equal(_rms_norm(norm, x), norm(x))


@pytest.mark.parametrize("mode", ["native", "plain", "packed"])
def test_linear_adds_the_residual(mode: str) -> None:
    factory = LinearFactory(torch.float32, torch.device("cpu"), mode=mode)
    torch.manual_seed(0)
    weight = torch.randn(48, 32)
    for bias in (None, torch.randn(48)):
        linear = factory(weight.t().contiguous().t() if factory.column_major else weight, bias)
        for rows in (1, 5):
            x, residual = torch.randn(rows, 32), torch.randn(rows, 48)
            want = torch.nn.functional.linear(x, weight, bias) + residual
            torch.testing.assert_close(linear(x, residual=residual), want, atol=1e-5, rtol=1e-5)


def test_a_model_outside_the_fast_path_runs_on_transformers_modules(tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_llama_dir)
    loaded.model.model.layers[0].mlp.down_proj = torch.nn.Identity()  # not a plain linear any more
    assert "down_proj" in str(FastForward.unsupported_reason(loaded.model))
    runner = ModelRunner(loaded, KVCache(loaded.kv_shape(4), 8), forward="auto")
    assert runner.forward_name == "hf" and runner.fast is None
    with pytest.raises(ValueError, match="down_proj"):
        ModelRunner(loaded, KVCache(loaded.kv_shape(4), 8), forward="fast")
    with pytest.raises(ValueError, match="expected one of"):
        ModelRunner(loaded, KVCache(loaded.kv_shape(4), 8), forward="turbo")


def test_linear_runs_each_kernel_from_its_row_count() -> None:
    factory = LinearFactory(torch.float32, torch.device("cpu"), mode="auto")
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    packed = LinearFactory._pack(weight) if factory.can_pack else None
    first = factory.kernels[0]  # native where it runs, else plain
    bands = ((first, 1), ("plain", 2)) if first != "plain" else (("plain", 1),)
    if packed is not None:
        bands += (("packed", 4),)
    linear = Linear(weight, bias, packed, bands)
    for rows, want in ((1, first), (3, "plain"), (4, bands[-1][0]), (9, bands[-1][0])):
        assert linear.kernel_for(rows) == want
        x = torch.randn(rows, 32)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="packed band"):
        Linear(weight, bias, None, (("packed", 1),))


def test_linear_mode_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_LINEAR", "fastest")
    with pytest.raises(ValueError, match="PDSERVE_LINEAR"):
        LinearFactory(torch.float32, torch.device("cpu"))


def test_bf16_on_a_cpu_without_a_bf16_kernel_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pdserve.engine import fast_forward, model_loader, native

    monkeypatch.setattr(fast_forward, "mkldnn_linear_available", lambda dtype: False)
    monkeypatch.setenv(native.NATIVE_ENV, "0")  # neither oneDNN's bf16 kernel nor pdserve's own
    with caplog.at_level("WARNING", logger="pdserve.engine.model_loader"):
        assert model_loader.warn_if_slow_bf16(torch.bfloat16, "cpu")
    assert "slower than float32" in caplog.text and model_loader.AVX2_BF16_SERVED_RATIO in caplog.text
    assert "PDSERVE_NATIVE=0" in caplog.text
    assert not model_loader.warn_if_slow_bf16(torch.float32, "cpu")
    monkeypatch.delenv(native.NATIVE_ENV)
    if native.native_unavailable(torch.bfloat16, torch.device("cpu")) is None:
        assert not model_loader.warn_if_slow_bf16(torch.bfloat16, "cpu")  # the native kernels serve bf16
    monkeypatch.setattr(fast_forward, "mkldnn_linear_available", lambda dtype: True)
    assert not model_loader.warn_if_slow_bf16(torch.bfloat16, "cpu")


def test_auto_kernel_choice_is_timed_once_per_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.engine import fast_forward

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    if not LinearFactory(torch.float32, torch.device("cpu"), mode="auto").can_pack:
        pytest.skip("no oneDNN linear in this torch build")  # nothing to choose between
    timed = []
    real = fast_forward._best_ms
    monkeypatch.setattr(
        fast_forward, "_best_ms", lambda runs, repeats=7: timed.append(len(runs)) or real(runs, repeats)
    )
    weight = torch.randn(40, 24)
    first = LinearFactory(torch.float32, torch.device("cpu"), mode="auto")
    runs = len(first.kernels) * len(fast_forward.PROBE_ROWS)  # every kernel at every probed row count
    first(weight)
    assert sum(timed) == runs
    assert (tmp_path / "linear-kernels.json").is_file()
    second = LinearFactory(torch.float32, torch.device("cpu"), mode="auto")
    second(weight)
    assert sum(timed) == runs  # read back, not timed again
    assert second.bands == first.bands and first.bands[(24, 40)][0][1] == 1
    assert {kernel for kernel, _ in first.bands[(24, 40)]} <= set(first.kernels)
    LinearFactory(torch.float32, torch.device("cpu"), mode="retime")(weight)
    assert sum(timed) == 2 * runs  # PDSERVE_LINEAR=retime times again
