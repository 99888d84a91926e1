"""Runs the model over a packed batch that reads and writes the paged KV cache.

One forward pass serves any mix of sequences: each brings its new tokens, how many of its tokens
are already cached, and its block table. Prefill is "all prompt tokens new, none cached"; a decode
step is "one new token, the rest cached". We drive transformers' own modules layer by layer (so
any Llama-layout model works) and compute logits only where a token will be sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionBatch, attention_batch
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_loader import LoadedModel


@dataclass(frozen=True)
class StepInput:
    """One sequence's part of a forward pass."""

    token_ids: list[int]  # the new tokens, whose K/V this pass writes
    num_cached: int  # tokens of this sequence already in the cache (positions 0..num_cached-1)
    block_table: list[int]  # must cover num_cached + len(token_ids) tokens


LayerCallback = Callable[[int], None]


def _check_same_place(loaded: LoadedModel, kv_cache: KVCache) -> None:
    """Weights and K/V must share one device and one dtype (ValueError naming both otherwise)."""
    weight = next(loaded.model.parameters())
    if weight.device != kv_cache.kv.device:
        raise ValueError(f"device: weights are on {weight.device}, the KV cache on {kv_cache.kv.device}")
    if weight.dtype != kv_cache.kv.dtype:
        raise ValueError(f"dtype: weights are {weight.dtype}, the KV cache {kv_cache.kv.dtype}")


class ModelRunner:
    """Owns no scheduling state: callers decide what runs; this computes it."""

    def __init__(self, loaded: LoadedModel, kv_cache: KVCache) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape.block_size
        self.device = kv_cache.kv.device  # weights, K/V and every index tensor of a pass live here
        _check_same_place(loaded, kv_cache)
        self.num_forward_passes = 0
        self.full_logits: dict[int, torch.Tensor] = {}  # the last pass's `full_rows` logits
        self.num_prefill_tokens = 0  # new tokens of sequences that were not decoding (prompts, recomputes)

    def _slots(self, item: StepInput) -> torch.Tensor:
        table = torch.tensor(item.block_table, dtype=torch.long)
        pos = torch.arange(item.num_cached, item.num_cached + len(item.token_ids))
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _batch(self, items: list[StepInput]) -> AttentionBatch:
        width = max(len(i.block_table) for i in items)
        tables = torch.zeros(len(items), width, dtype=torch.long)
        for row, item in enumerate(items):
            tables[row, : len(item.block_table)] = torch.tensor(item.block_table, dtype=torch.long)
        return AttentionBatch(
            kv_cache=self.kv_cache,
            slot_mapping=torch.cat([self._slots(i) for i in items]).to(self.device),
            query_lens=[len(i.token_ids) for i in items],
            context_lens=[i.num_cached + len(i.token_ids) for i in items],
            block_tables=tables.to(self.device),
            num_decode=next((n for n, i in enumerate(items) if len(i.token_ids) != 1 or i.num_cached == 0),
                            len(items)),
        )

    @torch.inference_mode()
    def forward(self, items: list[StepInput], on_layer_done: LayerCallback | None = None,
                full_rows: Collection[int] = ()) -> torch.Tensor:
        """Run one pass; return float32 logits [len(items), vocab] at each sequence's last new token.
        For the items in `full_rows` (prompt log-probabilities), the logits at every new token are
        left in `self.full_logits` (row -> [len(token_ids), vocab] float32); it is empty otherwise."""
        if not items or any(not i.token_ids for i in items):
            raise ValueError("every sequence in a forward pass needs at least one new token")
        for item in items:
            if len(item.block_table) * self.block_size < item.num_cached + len(item.token_ids):
                raise ValueError("block table too short for the tokens of this pass")
        batch = self._batch(items)
        device = self.device
        input_ids = torch.tensor([[t for i in items for t in i.token_ids]], device=device)  # [1, T]
        positions = torch.cat(
            [torch.arange(i.num_cached, i.num_cached + len(i.token_ids)) for i in items]
        ).unsqueeze(0).to(device)  # [1, T]
        last = torch.tensor(batch.query_lens).cumsum(0) - 1  # [N] index of each last new token
        inner = self.model.model
        with attention_batch(batch):
            hidden = inner.embed_tokens(input_ids)  # [1, T, E]
            rotary = inner.rotary_emb(hidden, position_ids=positions)
            for index, layer in enumerate(inner.layers):
                hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
                if on_layer_done is not None:
                    on_layer_done(index)
        self.full_logits = {}
        starts = (last + 1 - torch.tensor(batch.query_lens)).tolist()
        for row in full_rows:
            rows = hidden[0, starts[row] : starts[row] + batch.query_lens[row]]
            self.full_logits[row] = self.model.lm_head(inner.norm(rows)).float()  # [Q, V]
        hidden = inner.norm(hidden[0, last.to(device)])  # [N, E]
        self.num_forward_passes += 1
        self.num_prefill_tokens += sum(batch.query_lens[batch.num_decode :])
        return self.model.lm_head(hidden).float()  # [N, V]
