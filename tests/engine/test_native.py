"""pdserve's native CPU kernels (engine/native.py, engine/native.cpp) against torch's arithmetic.

They build wherever the CPU is x86-64 with AVX2 (every machine this suite runs on so far): there a
failed build fails these tests instead of skipping them."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import native
from pdserve.engine.attention import AttentionBatch, _decode_attention
from pdserve.engine.kv_cache import KVCache

CPU = torch.device("cpu")
HAS_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX2",
    "AVX512",
)
pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="the native kernels need an x86-64 CPU with AVX2")


@pytest.fixture(autouse=True)
def _built() -> None:
    assert native.native_unavailable(torch.float32, CPU) is None  # builds once per machine


@pytest.mark.parametrize(("k", "n"), [(576, 960), (13, 7), (20, 9), (1536, 64)])
def test_linear_is_x_w_plus_bias_plus_residual(k: int, n: int) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(n, k), torch.randn(n)
    for rows in (1, 2, 3, 5):
        x, residual = torch.randn(rows, k), torch.randn(rows, n)
        torch.testing.assert_close(native.native_linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(
            native.native_linear(x, weight, bias, residual), residual + F.linear(x, weight, bias), atol=1e-4, rtol=1e-5
        )
    strided = torch.randn(3, 2 * k)[:, :k]  # rows of a wider tensor, as a view of fused outputs is
    torch.testing.assert_close(native.native_linear(strided, weight), F.linear(strided, weight), atol=1e-4, rtol=1e-5)


def test_bf16_linear_sums_in_float32_and_rounds_as_torch_does() -> None:
    torch.manual_seed(3)
    weight, bias = torch.randn(70, 96).bfloat16(), torch.randn(70).bfloat16()
    for rows in (1, 2, 5):
        x, residual = torch.randn(rows, 96).bfloat16(), torch.randn(rows, 70).bfloat16()
        exact = F.linear(x.float(), weight.float(), bias.float())  # float32 sums of the bf16 values
        got = native.native_linear(x, weight, bias)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, exact.bfloat16(), atol=0, rtol=2**-7)  # within one bf16 rounding
        with_residual = native.native_linear(x, weight, bias, residual)
        torch.testing.assert_close(with_residual, (residual.float() + got.float()).bfloat16(), atol=0, rtol=0)


def test_linear_gives_a_row_the_same_bits_in_any_batch_and_at_any_thread_count() -> None:
    torch.manual_seed(1)
    weight, x = torch.randn(300, 576), torch.randn(7, 576)
    batch = native.native_linear(x, weight)
    for m in range(7):
        assert torch.equal(native.native_linear(x[m : m + 1], weight)[0], batch[m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native.native_linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, batch)


def test_bad_inputs_are_refused_with_a_clear_error() -> None:
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        native.native_linear(torch.randn(2, 16, dtype=torch.bfloat16), weight)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        native.native_linear(torch.randn(2, 16).half(), weight.half())
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\]"):
        native.native_linear(torch.randn(2, 15), weight)
    with pytest.raises(RuntimeError, match="row-major"):
        native.native_linear(torch.randn(2, 16), weight.t().contiguous().t())
    with pytest.raises(RuntimeError, match="residual"):
        native.native_linear(torch.randn(2, 16), weight, None, torch.randn(3, 8))
    torch.testing.assert_close(native.native_linear(torch.ones(1, 16), weight), weight.sum(1, keepdim=True).t())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rms_norm_matches_the_models_module(family: str) -> None:
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, f"{family.capitalize()}RMSNorm")(576, eps=1e-6)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
        for rows in (1, 9):
            x = torch.randn(rows, 2 * 576)[:, 576:] * 3  # strided rows
            torch.testing.assert_close(native.native_rms_norm(x, norm.weight, 1e-6), norm(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        native.native_rms_norm(torch.randn(2, 576), torch.randn(575), 1e-6)


def test_bf16_rms_norm_rounds_where_the_module_rounds() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(576, eps=1e-5).bfloat16()
    torch.manual_seed(5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
        x = (torch.randn(9, 576) * 3).bfloat16()
        got, want = native.native_rms_norm(x, norm.weight, 1e-5), norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)  # at most one bf16 rounding apart
    assert (got == want).float().mean() > 0.95  # and nearly always the same bits


def _paged_batch(cache: KVCache, contexts: list[int], block_size: int) -> AttentionBatch:
    """Decoding sequences with ragged contexts over shuffled, interleaved blocks of `cache`."""
    order = torch.randperm(cache.num_blocks).tolist()
    tables, taken = [], 0
    for length in contexts:
        blocks = -(-length // block_size)
        tables.append(order[taken : taken + blocks])
        taken += blocks
    width = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), width, dtype=torch.long)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = torch.tensor(table)
    return AttentionBatch(
        kv_cache=cache,
        slot_mapping=torch.zeros(len(contexts), dtype=torch.long),
        query_lens=[1] * len(contexts),
        context_lens=contexts,
        block_tables=padded,
        num_decode=len(contexts),
    )


@pytest.mark.parametrize("contexts", [[1], [37], [5, 64, 17, 33]])
@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_decode_attention_reads_the_pages_in_place_as_the_gather_path_computes(
    contexts: list[int], query_dtype: torch.dtype, cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.engine.kv_cache import KVCacheShape

    torch.manual_seed(2)
    shape = KVCacheShape(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=cache_dtype)
    cache = KVCache(shape, 24)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    batch = _paged_batch(cache, contexts, 16)
    query = torch.randn(len(contexts), 9, 64).to(query_dtype)  # 9 query heads over 3 kv heads
    got = _decode_attention(batch, 1, query, 0.125)
    assert got.dtype == query_dtype
    monkeypatch.setattr("pdserve.engine.attention._native_attention", lambda device: False)
    want = _decode_attention(batch, 1, query, 0.125)  # the gather + batched matmul path
    # in bf16 the gather path rounds its scores and probabilities to bf16 where the native kernel keeps float32
    tolerance = 1e-5 if query_dtype == cache_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_decode_attention_softmax_holds_for_peaked_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scores spread over hundreds (a large scale): the vectorized exp underflows to 0 where the
    float would be subnormal and stays within float32 rounding of torch's softmax elsewhere."""
    from pdserve.engine.kv_cache import KVCacheShape

    torch.manual_seed(3)
    shape = KVCacheShape(num_layers=1, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    cache = KVCache(shape, 24)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    batch = _paged_batch(cache, [3, 29, 70], 16)
    query = torch.randn(3, 9, 64)
    got = _decode_attention(batch, 0, query, 6.0)
    monkeypatch.setattr("pdserve.engine.attention._native_attention", lambda device: False)
    want = _decode_attention(batch, 0, query, 6.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_attention_refuses_block_ids_and_lengths_outside_the_cache() -> None:
    kc = torch.zeros(4, 16, 2, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        native.native_decode_attention(q, kc, kc, torch.tensor([[7]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        native.native_decode_attention(q, kc, kc, torch.tensor([[0]]), torch.tensor([17]), 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        native.native_decode_attention(q, kc, kc, torch.tensor([[0]]), torch.tensor([0]), 1.0)


def test_turned_off_or_unbuildable_kernels_leave_torch_kernels_in_charge(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.engine.fast_forward import LinearFactory

    assert native.native_unavailable(torch.float16, CPU) == "dtype torch.float16 (float32 and bfloat16 only)"
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.native_unavailable(torch.float32, CPU) == "PDSERVE_NATIVE=0"
    factory = LinearFactory(torch.float32, CPU, mode="auto")
    assert "native" not in factory.kernels and factory.column_major
    monkeypatch.delenv(native.NATIVE_ENV)

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension\ng++: command not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    reason = native._load.__wrapped__()  # what a machine without g++ gets (the cached load is untouched)
    assert reason == "building it failed (RuntimeError: g++: command not found)"
