"""A fixed pool of KV-cache blocks with reference counts.

Blocks are integers in [0, num_blocks). A block is free when its reference count is 0. Reference
counts above 1 let several sequences share a block (prefix sharing); `free` drops one reference and
returns the block to the free list when the count reaches 0. The pool holds no tensors: `KVCache`
owns the memory, the pool owns the bookkeeping.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    """Free list plus reference counts over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (reference count 1 each), all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks that are already in use (sharing)."""
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise ValueError(f"block {block} is free; only used blocks can be shared")
            self._ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 go back to the free list."""
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise ValueError(f"double free of KV block {block}")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def assert_all_free(self) -> None:
        """Raise AssertionError naming the leaked blocks unless every block is free (use when idle)."""
        leaked = [b for b, count in enumerate(self._ref_counts) if count != 0]
        if leaked or len(self._free) != self.num_blocks:
            raise AssertionError(f"{len(leaked)} KV blocks leaked: {leaked[:16]}")
