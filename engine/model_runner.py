"""Runs the model over a packed batch that reads and writes the paged KV cache.

One forward pass serves any mix of sequences: each brings its new tokens, how many of its tokens
are already cached, and its block table. Prefill is "all prompt tokens new, none cached"; a decode
step is "one new token, the rest cached". Logits are computed only where a token will be sampled.

Two forwards compute the same thing from the same weights:
- "fast" (`engine.fast_forward`): fused q/k/v and gate/up GEMMs with a kernel chosen per weight at
  load, for the Llama, Mistral, Qwen2 and Qwen3 families; the default where the model allows it;
- "hf": transformers' own modules driven layer by layer, so any Llama-layout model works.
`PDSERVE_FORWARD=hf|fast|auto` (or the `forward` argument) picks one; "auto" is fast where supported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention import AttentionBatch, attention_batch
from pdserve.engine.compiled_layer import compile_requested
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_loader import LoadedModel

if TYPE_CHECKING:  # imported where a runner is built: it pulls in transformers' modeling code (about
    # 2 s of a process's start-up), which a sim-engine worker (no weights, no forward) never needs
    from pdserve.engine.fast_forward import FastForward


@dataclass(frozen=True)
class StepInput:
    """One sequence's part of a forward pass."""

    token_ids: list[int]  # the new tokens, whose K/V this pass writes
    num_cached: int  # tokens of this sequence already in the cache (positions 0..num_cached-1)
    block_table: list[int]  # must cover num_cached + len(token_ids) tokens


LayerCallback = Callable[[int], None]
FORWARD_ENV = "PDSERVE_FORWARD"
FORWARDS = ("auto", "fast", "hf")


def _choose_forward(
    model: object, forward: str | None, deterministic: bool = False, kernel_table: str | None = None
) -> FastForward | None:
    """The FastForward to run, or None for transformers' modules (ValueError on an unknown name,
    on "fast" for a model the fast path does not cover, and on deterministic mode where the fast
    path with its native kernels cannot run)."""
    forward = (forward or os.environ.get(FORWARD_ENV) or "auto").lower()
    if forward not in FORWARDS:
        raise ValueError(f"forward {forward!r}: expected one of {', '.join(FORWARDS)}")
    if forward == "hf":
        if deterministic:
            raise ValueError("deterministic mode runs the fast forward; forward 'hf' was requested")
        return None
    from pdserve.engine.fast_forward import FastForward, fast_forward_for
    from pdserve.engine.kernel_table import KernelTable

    table = KernelTable.load(kernel_table) if kernel_table else None
    fast = fast_forward_for(model, table=table, deterministic=deterministic)
    if fast is None and forward == "fast":
        raise ValueError(f"forward 'fast' requested, but {FastForward.unsupported_reason(model)}")
    return fast


def _check_same_place(loaded: LoadedModel, kv_cache: KVCache) -> None:
    """Weights and K/V must share one device and one dtype (ValueError naming both otherwise)."""
    weight = next(loaded.model.parameters())
    if weight.device != kv_cache.kv.device:
        raise ValueError(f"device: weights are on {weight.device}, the KV cache on {kv_cache.kv.device}")
    if weight.dtype != kv_cache.kv.dtype:
        raise ValueError(f"dtype: weights are {weight.dtype}, the KV cache {kv_cache.kv.dtype}")


class ModelRunner:
    """Owns no scheduling state: callers decide what runs; this computes it."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: KVCache,
        forward: str | None = None,
        compile: bool = False,
        deterministic: bool = False,  # noqa: A002
        kernel_table: str | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape.block_size
        self.device = kv_cache.kv.device  # weights, K/V and every index tensor of a pass live here
        _check_same_place(loaded, kv_cache)
        self.fast = _choose_forward(self.model, forward, deterministic, kernel_table)
        if self.fast is not None and compile_requested(compile):
            self.fast.enable_compile()
        self.forward_name = "fast" if self.fast is not None else "hf"
        self.deterministic = deterministic
        #: how the kernels were chosen (WorkerInfo.kernels, `pdserve status`)
        self.kernels = self.fast.kernels if self.fast is not None else "transformers' modules"
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
            num_decode=next((n for n, i in enumerate(items) if len(i.token_ids) != 1 or i.num_cached == 0), len(items)),
        )

    @torch.inference_mode()
    def forward(
        self, items: list[StepInput], on_layer_done: LayerCallback | None = None, full_rows: Collection[int] = ()
    ) -> torch.Tensor:
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
        positions = (
            torch.cat([torch.arange(i.num_cached, i.num_cached + len(i.token_ids)) for i in items])
            .unsqueeze(0)
            .to(device)
        )  # [1, T]
        last = torch.tensor(batch.query_lens).cumsum(0) - 1  # [N] index of each last new token
        if self.fast is not None:
            hidden = self._fast_layers(batch, input_ids[0], positions[0], on_layer_done)  # [T, E]
        else:
            hidden = self._hf_layers(batch, input_ids, positions, on_layer_done)[0]  # [T, E]
        self.full_logits = {}
        starts = (last + 1 - torch.tensor(batch.query_lens)).tolist()
        for row in full_rows:
            self.full_logits[row] = self._norm_logits(hidden[starts[row] : starts[row] + batch.query_lens[row]])
        logits = self._norm_logits(hidden[last.to(device)])  # [N, V]
        self.num_forward_passes += 1
        self.num_prefill_tokens += sum(batch.query_lens[batch.num_decode :])
        return logits

    def _norm_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over hidden rows [N, E] -> float32 logits [N, V]."""
        if self.fast is not None:
            return self.fast.norm_logits(rows)
        return self.model.lm_head(self.model.model.norm(rows)).float()

    def _fast_layers(
        self,
        batch: AttentionBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        on_layer_done: LayerCallback | None,
    ) -> torch.Tensor:
        fast = self.fast
        assert fast is not None
        hidden = torch.nn.functional.embedding(input_ids, fast.embed)  # [T, E]
        rope = fast.rope(positions, hidden.dtype)
        for index in range(len(fast.layers)):
            hidden = fast.layer(index, hidden, batch, rope)
            if on_layer_done is not None:
                on_layer_done(index)
        return hidden

    def _hf_layers(
        self,
        batch: AttentionBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        on_layer_done: LayerCallback | None,
    ) -> torch.Tensor:
        inner = self.model.model
        with attention_batch(batch):
            hidden = inner.embed_tokens(input_ids)  # [1, T, E]
            rotary = inner.rotary_emb(hidden, position_ids=positions)
            for index, layer in enumerate(inner.layers):
                hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
                if on_layer_done is not None:
                    on_layer_done(index)
        return hidden
