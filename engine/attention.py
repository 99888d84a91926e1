"""Attention over the paged KV cache, plugged into transformers' attention-function registry.

The model runner packs a whole batch into one row: input [1, T] where T is the sum of the new
tokens of every sequence. Before a forward pass it sets an `AttentionBatch` as the current batch;
each attention layer then (1) writes the new keys/values into their cache slots and (2) attends
each sequence's queries to that sequence's cached keys/values.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.native import native_decode_attention, native_unavailable

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class AttentionBatch:
    """What attention needs to know about the packed batch.

    slot_mapping: [T] cache slot of every new token (on the KV cache's device, like block_tables).
    query_lens / context_lens: per sequence, new tokens and total tokens (cached + new).
    block_tables: [B, max_blocks] padded block ids (decode path and prefix-reading prefill).
    num_decode: the first `num_decode` sequences are decoding (one new token after a cached
    context); the rest are prefills (a mixed pass runs both). is_decode: all of them decode.
    """

    kv_cache: KVCache
    slot_mapping: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    num_decode: int

    @property
    def is_decode(self) -> bool:
        return self.num_decode == len(self.query_lens)

    @functools.cached_property
    def decode_padding(self) -> torch.Tensor | None:
        """[Bd, 1, 1, S] True where a key position lies past its decoding sequence's context, or None
        when every decoding sequence has the same context (batch 1 always): nothing to mask. Built
        once per pass, read by every layer."""
        context = self.context_lens[: self.num_decode]
        if min(context) == max(context):
            return None
        device = self.block_tables.device
        lengths = torch.tensor(context, dtype=torch.long, device=device)
        return (torch.arange(max(context), device=device).unsqueeze(0) >= lengths.unsqueeze(1))[:, None, None, :]

    @functools.cached_property
    def decode_context_lens(self) -> torch.Tensor:
        """[Bd] int64 context lengths of the decoding sequences, for the native kernel (once per pass)."""
        return torch.tensor(self.context_lens[: self.num_decode], dtype=torch.long)

    @functools.cached_property
    def row_block_tables(self) -> torch.Tensor:
        """[T, max_blocks]: each new token's sequence's block table (batch-invariant mode, once per pass)."""
        counts = torch.tensor(self.query_lens, device=self.block_tables.device)
        return self.block_tables.repeat_interleave(counts, dim=0)

    @functools.cached_property
    def row_context_lens(self) -> torch.Tensor:
        """[T] int64: the keys each new token attends to, itself and those before it (causal)."""
        lens = [
            ctx - q_len + j + 1
            for q_len, ctx in zip(self.query_lens, self.context_lens, strict=True)
            for j in range(q_len)
        ]
        return torch.tensor(lens, dtype=torch.long)

    @functools.cached_property
    def decode_kv_ids(self) -> torch.Tensor:
        """[2 * Bd * max_blocks] rows of a layer's K/V, viewed as [2 * num_blocks, block_size, H, D],
        that hold the decoding sequences' blocks: their keys', then their values' (once per pass)."""
        ids = self.block_tables[: self.num_decode].flatten()
        return torch.cat([ids, ids + self.kv_cache.num_blocks])


class _PassState(threading.local):
    """The batch of the forward pass running on this thread (several engines may share a process)."""

    batch: AttentionBatch | None = None


_current = _PassState()


@contextlib.contextmanager
def attention_batch(batch: AttentionBatch) -> Iterator[None]:
    """Make `batch` the one every attention layer sees during a forward pass on this thread."""
    previous, _current.batch = _current.batch, batch
    try:
        yield
    finally:
        _current.batch = previous


def _paged_context(
    kv_cache: KVCache, layer: int, block_tables: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of B sequences: ([B, H, length, D], [B, H, length, D]).

    `index_select` on the block axis of keys and values separately: on CPU it copies whole blocks
    and is about 4x faster than one advanced-indexing gather of both."""
    ids = block_tables.flatten()
    batch, heads, dim = block_tables.shape[0], kv_cache.shape.num_kv_heads, kv_cache.shape.head_dim
    k = kv_cache.kv[layer, 0].index_select(0, ids).view(batch, -1, heads, dim)[:, :length]
    v = kv_cache.kv[layer, 1].index_select(0, ids).view(batch, -1, heads, dim)[:, :length]
    return k.transpose(1, 2), v.transpose(1, 2)


def _decode_context(batch: AttentionBatch, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the decoding sequences, contiguous: ([Bd*Hkv, S, D], [Bd*Hkv, S, D]).

    One `index_select` of whole blocks for keys and values together (on CPU about 4x faster than an
    advanced-indexing gather), then one copy into the [B, H, S, D] layout the batched matmuls read."""
    cache = batch.kv_cache
    nd, heads, dim = batch.num_decode, cache.shape.num_kv_heads, cache.shape.head_dim
    rows = cache.kv[layer].view(2 * cache.num_blocks, cache.shape.block_size, heads, dim)
    kv = rows.index_select(0, batch.decode_kv_ids).view(2, nd, -1, heads, dim)[:, :, :length]
    kv = kv.transpose(2, 3).contiguous()  # [2, Bd, Hkv, S, D]
    return kv[0].view(nd * heads, length, dim), kv[1].view(nd * heads, length, dim)


#: (query, cache) dtypes the native decode attention takes.
_NATIVE_DTYPES = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)}


def _native_attention(device: torch.device) -> bool:
    return native_unavailable(torch.float32, device) is None


def _decode_attention(batch: AttentionBatch, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """The decoding sequences: query [Bd, Hq, D] -> output [Bd, Hq, D].

    One query row per sequence, so attention is tiny GEMMs: each kv head's group of query heads
    against its sequence's keys ([B*Hkv, G, D] x [B*Hkv, D, S]), masked past each context,
    softmaxed in float32 and multiplied by the values. The gathered keys and values are made
    contiguous first: a batched matmul over the strided view is 3-4x slower on a CPU than the copy
    plus the matmul, and SDPA's flash kernel, tiled for many query rows, slower still.

    Where pdserve's native kernels run (float32 or bfloat16 on an AVX2 CPU, engine/native.py), one
    call reads every key and value in place from the pages instead: no gather, no copy, no mask."""
    nd = batch.num_decode
    cache = batch.kv_cache
    if (query.dtype, cache.kv.dtype) in _NATIVE_DTYPES and _native_attention(cache.kv.device):
        return native_decode_attention(
            query, cache.kv[layer, 0], cache.kv[layer, 1], batch.block_tables[:nd], batch.decode_context_lens, scaling
        )
    max_len = max(batch.context_lens[:nd])
    k, v = _decode_context(batch, layer, max_len)  # [B*Hkv, S, D] each, the cache's dtype
    if k.dtype != query.dtype:
        k, v = k.to(query.dtype), v.to(query.dtype)
    heads_kv, dim = batch.kv_cache.shape.num_kv_heads, query.shape[-1]
    q = query.reshape(nd * heads_kv, -1, dim)  # [B*Hkv, G, D]: query head h reads kv head h // G
    scores = torch.bmm(q, k.transpose(1, 2)).float().mul_(scaling)  # [B*Hkv, G, S]
    if batch.decode_padding is not None:
        scores = scores.view(nd, heads_kv, -1, max_len).masked_fill_(batch.decode_padding, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype).view(nd * heads_kv, -1, max_len)
    return torch.bmm(probs, v).view(nd, -1, dim)


def _prefill_attention(
    batch: AttentionBatch,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """The prefilling sequences (those after the first `num_decode`): query [T, Hq, D], key/value
    [T, Hkv, D] of their tokens -> output [T, Hq, D]."""
    outputs, start = [], 0
    query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)  # [H, T, D]
    for i in range(batch.num_decode, len(batch.query_lens)):
        q_len, ctx_len = batch.query_lens[i], batch.context_lens[i]
        q = query[:, start : start + q_len].unsqueeze(0)
        if q_len == ctx_len:  # no cached prefix: attend to the fresh keys, causally
            k, v = key[:, start : start + q_len].unsqueeze(0), value[:, start : start + q_len].unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:  # cached prefix (chunked prefill, prefix cache): read it from the pages
            k, v = _paged_context(batch.kv_cache, layer, batch.block_tables[i : i + 1], ctx_len)
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= q_pos  # [q_len, ctx_len]
            out = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling, enable_gqa=True
            )
        outputs.append(out[0])
        start += q_len
    return torch.cat(outputs, dim=1).transpose(0, 1)  # [T, Hq, D]


def _per_row_attention(batch: AttentionBatch, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Batch-invariant attention: every new token, prompt or decode, is one query row of the native
    decode kernel over its own causal context read from the pages (after this pass's K/V were
    written), so a token's output has the same bits whatever else is in the pass, however its prompt
    was chunked, and on a prefill worker as on a decode worker. query [T, Hq, D] -> [T, Hq, D]."""
    cache = batch.kv_cache
    if (query.dtype, cache.kv.dtype) not in _NATIVE_DTYPES or not _native_attention(cache.kv.device):
        raise RuntimeError(
            "deterministic attention needs pdserve's native kernels for "
            f"{query.dtype} queries over a {cache.kv.dtype} cache"
        )
    return native_decode_attention(
        query.contiguous(),
        cache.kv[layer, 0],
        cache.kv[layer, 1],
        batch.row_block_tables,
        batch.row_context_lens,
        scale,
    )


def paged_attention(
    batch: AttentionBatch,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    per_row: bool = False,
) -> torch.Tensor:
    """Write the pass's new K/V into their cache slots, then attend every sequence's queries to
    its own cached context. query [T, Hq, D], key/value [T, Hkv, D] -> output [T, Hq * D]
    (decoding sequences first, as the batch is packed). `per_row`: batch-invariant mode
    (`_per_row_attention`)."""
    k_slots, v_slots = batch.kv_cache.layer_slots(layer)
    k_slots.index_copy_(0, batch.slot_mapping, key.to(k_slots.dtype))  # [T, Hkv, D]
    v_slots.index_copy_(0, batch.slot_mapping, value.to(v_slots.dtype))
    nd = batch.num_decode
    if per_row:
        out = _per_row_attention(batch, layer, query, scale)
    elif batch.is_decode:
        out = _decode_attention(batch, layer, query.contiguous(), scale)
    elif nd == 0:
        out = _prefill_attention(batch, layer, query, key, value, scale)
    else:  # mixed pass: decodes come first
        decoded = _decode_attention(batch, layer, query[:nd].contiguous(), scale)
        prefilled = _prefill_attention(batch, layer, query[nd:], key[nd:], value[nd:], scale)
        out = torch.cat([decoded, prefilled], dim=0)
    return out.reshape(out.shape[0], -1)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The registered attention function (transformers' signature): q [1, Hq, T, D] -> [1, T, Hq, D]."""
    batch = _current.batch
    if batch is None:
        raise RuntimeError("paged attention called outside a pdserve forward pass")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(
        batch, layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scale
    )
    return out.view(1, out.shape[0], query.shape[1], query.shape[-1]), None


def _no_mask(*args: object, **kwargs: object) -> None:
    return None


def register() -> None:
    """Register the attention function (idempotent). transformers' registries are imported here, not
    at module level: they pull in its modeling code (about 2 s of a worker's start-up), which only a
    process that loads a real model needs (load_model calls this); a sim-engine worker never does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
