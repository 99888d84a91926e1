"""An optional `torch.compile`d decoder layer for the fast forward's decode passes.

A batch-1 decode step of the fast forward is about 25 small eager ops per layer around its four
GEMVs (norms, RoPE, the K/V writes, the gather, the attention's matmuls and softmax, SiLU and the
product), each paying the dispatcher's per-op cost. Compiled with inductor, a decode layer is one
call per layer: the elementwise and reduction ops fuse into a few C++ loops, and the GEMMs and the
attention's batched matmuls stay extern kernels (the same MKL / oneDNN calls the eager layer makes:
the weights keep their column-major layout, and `Linear`'s kernel choice is made the same way).

Only pure decode passes take it (prefill and mixed passes are GEMM-bound and run eagerly); the
context length, the block count and the batch size are dynamic after their first change
(dynamo's automatic dynamic shapes), so a growing context does not recompile every step.

Why it is off by default (`PDSERVE_COMPILE=1` or the `model.compile` setting, `--compile`, turns it on):
compiling takes seconds to tens of seconds per shape variant on a 2-core CPU, the first decode
passes wait for it, and it needs a C++ compiler, which a fresh machine may lack. When compiling
fails for any reason, the layer runs eagerly from then on and the log says why, once.

Exactness: inductor's fused reductions (RMSNorm's mean, the softmax) may sum in another order than
the eager kernels, so logits can differ in the last bits; greedy fp32 tokens are held identical to
transformers' `generate` by tests/engine/test_compiled_layer.py.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pdserve.engine.attention import AttentionBatch
    from pdserve.engine.fast_forward import FastForward, Rope, _Layer

log = logging.getLogger(__name__)

COMPILE_ENV = "PDSERVE_COMPILE"
#: dynamo's per-function graph limit, raised so that the shape variants of several models in one
#: process (the tests build a dozen) do not hit it and silently run eagerly.
RECOMPILE_LIMIT = 64
#: torch.compile's backend (tests replace it with one that fails, as a machine without g++ does).
BACKEND: Any = "inductor"


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`Linear`'s oneDNN kernel (x [T, K], weight reordered once -> [T, N]) as an opaque op inside
    a compiled graph: inductor's own lowering of `mkldnn._linear_pointwise` rejects a weight that
    was reordered outside the graph, so the graph calls the same kernel through this op instead."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def compile_requested(setting: bool = False) -> bool:
    """On when the setting (`model.compile`, `--compile`) or `PDSERVE_COMPILE` (1/true/yes/on) says so:
    the variable lets tests and benchmarks turn it on for engines they do not configure."""
    return setting or os.environ.get(COMPILE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    """A norm module's weight (torch types a module attribute as Tensor | Module)."""
    return cast(torch.Tensor, norm.weight)


def norm_eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon."""
    return float(cast(float, norm.variance_epsilon))


def decode_layer(
    p: _Layer,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_ids: torch.Tensor,
    padding: torch.Tensor | None,
    length: int,
    dims: tuple[int, int, int, int, int],
    eps: tuple[float, float, float],
    scale: float,
    act: Any,
) -> torch.Tensor:  # noqa: ANN401
    """One decoder layer of a decode pass, the fast forward's arithmetic in compilable form:
    hidden [B, E] -> [B, E]. dims: (query heads, kv heads, head dim, intermediate, block size);
    eps: the input, post and q/k norms' epsilons. The K/V writes go straight into the cache slot
    views (`index_put_` on the graph inputs, done in place by inductor)."""
    hq, hkv, d, inter, block_size = dims
    t = hidden.shape[0]
    qkv = p.qkv(_rms(hidden, norm_weight(p.input_norm), eps[0])).view(t, hq + 2 * hkv, d)
    if p.q_norm is not None and p.k_norm is not None:  # Qwen3: per-head norms before RoPE
        q, k = (
            _rms(qkv[:, :hq], norm_weight(p.q_norm), eps[2]),
            _rms(qkv[:, hq : hq + hkv], norm_weight(p.k_norm), eps[2]),
        )
        q = q * cos + q.roll(d // 2, dims=-1) * signed_sin
        k = k * cos + k.roll(d // 2, dims=-1) * signed_sin
    else:
        qk = qkv[:, : hq + hkv]
        qk = qk * cos + qk.roll(d // 2, dims=-1) * signed_sin
        q, k = qk[:, :hq], qk[:, hq:]
    v = qkv[:, hq + hkv :]
    k_slots.index_put_((slot_mapping,), k.to(k_slots.dtype))
    v_slots.index_put_((slot_mapping,), v.to(v_slots.dtype))

    def context(slots: torch.Tensor) -> torch.Tensor:  # [B*Hkv, S, D] of every sequence's blocks
        rows = slots.view(-1, block_size, hkv, d).index_select(0, block_ids).view(t, -1, hkv, d)[:, :length]
        return rows.transpose(1, 2).reshape(t * hkv, length, d).to(q.dtype)

    scores = torch.bmm(q.reshape(t * hkv, -1, d), context(k_slots).transpose(1, 2)).float() * scale
    if padding is not None:
        scores = scores.view(t, hkv, -1, length).masked_fill(padding, float("-inf")).view(t * hkv, -1, length)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    attn = torch.bmm(probs, context(v_slots)).reshape(t, hq * d)
    hidden = p.o(attn, residual=hidden)
    gate_up = p.gate_up(_rms(hidden, norm_weight(p.post_norm), eps[1]))
    return p.down(act(gate_up[:, :inter]) * gate_up[:, inter:], residual=hidden)


def _reason(error: BaseException) -> str:
    """The root cause of a compile failure in one line (dynamo wraps the backend's own error)."""
    while (inner := error.__cause__ or getattr(error, "inner_exception", None)) is not None:
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"


class CompiledDecode:
    """The compiled `decode_layer` of one FastForward, or its eager fallback once compiling failed."""

    def __init__(self, fast: FastForward) -> None:
        self.fast = fast
        first = fast.layers[0]
        self.eps = (
            norm_eps(first.input_norm),
            norm_eps(first.post_norm),
            norm_eps(first.q_norm) if first.q_norm is not None else 0.0,
        )
        self.failed: str | None = None
        self.calls = 0  # decode layers run compiled
        self.compile_s = 0.0  # time spent in calls that compiled a new graph
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._fn = torch.compile(decode_layer, backend=BACKEND)

    @staticmethod
    def supported(fast: FastForward) -> str | None:
        """Why this model's layers cannot be compiled (None when they can)."""
        for norm in (fast.layers[0].input_norm, fast.layers[0].post_norm, fast.layers[0].q_norm):
            if norm is not None and getattr(norm, "variance_epsilon", None) is None:
                return f"a norm ({type(norm).__name__}) without variance_epsilon"
        return None

    def layer(self, index: int, hidden: torch.Tensor, batch: AttentionBatch, rope: Rope) -> torch.Tensor | None:
        """The layer's output, or None when the eager layer must run it (not a pure decode pass, or
        compiling failed)."""
        if self.failed is not None or not batch.is_decode:
            return None
        f, cache = self.fast, batch.kv_cache
        k_slots, v_slots = cache.layer_slots(index)
        dims = (f.num_heads, f.num_kv_heads, f.head_dim, f.intermediate, cache.shape.block_size)
        block_ids = batch.block_tables[: batch.num_decode].flatten()
        for dynamic in (hidden, block_ids, batch.slot_mapping):  # sizes that change: one graph for all
            torch._dynamo.maybe_mark_dynamic(dynamic, 0)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        try:
            out = self._fn(
                f.layers[index],
                hidden,
                rope.cos,
                rope.signed_sin,
                k_slots,
                v_slots,
                batch.slot_mapping,
                block_ids,
                batch.decode_padding,
                max(batch.context_lens),
                dims,
                self.eps,
                f.scale,
                f.act,
            )
        except Exception as e:  # noqa: BLE001 - no compiler, an unsupported op, ...: eager from here on
            self.failed = _reason(e)
            log.warning("model.compile: compiling the decode layer failed (%s); the layers run eagerly", self.failed)
            return None
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs:
            took = time.perf_counter() - start
            self.compile_s += took
            log.info(
                "model.compile: compiled a decode layer graph in %.1f s (batch %d, context %d)",
                took,
                hidden.shape[0],
                max(batch.context_lens),
            )
        self.calls += 1
        return out
