"""The paged KV cache memory of one worker.

`kv` is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: index 0 of the
second axis holds keys, 1 values. Token t of a sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`. A request's K/V, as shipped between
workers, is `kv[:, :, block_ids]` -> [num_layers, 2, len(block_ids), block_size, heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for_budget(self, memory_bytes: int) -> int:
        return max(1, memory_bytes // self.bytes_per_block)


class KVCache:
    """Owns the K/V memory; knows nothing about which sequence uses which block."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, device: str = "cpu") -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        # [L, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv = torch.zeros(
            shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
            dtype=shape.dtype, device=device,
        )

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer as flat slot views: ([slots, heads, dim], [slots, heads, dim])."""
        s = self.shape
        flat = self.kv[layer].view(2, self.num_blocks * s.block_size, s.num_kv_heads, s.head_dim)
        return flat[0], flat[1]

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """A request's K/V: [L, 2, len(block_ids), block_size, heads, dim] (a copy)."""
        return self.kv[:, :, block_ids].contiguous()

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write shipped K/V (as returned by `gather`) into this cache's `block_ids`."""
        expected = (self.shape.num_layers, 2, len(block_ids), self.shape.block_size,
                    self.shape.num_kv_heads, self.shape.head_dim)
        if tuple(blocks.shape) != expected:
            raise ValueError(f"K/V shape {tuple(blocks.shape)} does not fit blocks of shape {expected}")
        self.kv[:, :, block_ids] = blocks.to(self.kv.dtype)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
