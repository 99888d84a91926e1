"""A fixed pool of KV-cache blocks with reference counts and an optional prefix cache.

Blocks are integers in [0, num_blocks). A block is free when its reference count is 0. Reference
counts above 1 let several sequences share a block (prefix sharing); `free` drops one reference and
returns the block to the free list when the count reaches 0. The pool holds no tensors: `KVCache`
owns the memory, the pool owns the bookkeeping.

Prefix cache: a full block whose K/V were computed can be registered under the hash of every token
up to its end (`cache_block`). When its last reference goes, it is kept, evictable, in LRU order
instead of being freed; `lookup` hands cached blocks of a prompt's longest cached prefix out again.
Allocation evicts least recently used cached blocks when the free list runs short, so cached
blocks never reduce what can be allocated (`num_free` counts them).

Block hashes are sha256, chained block by block (`block_hashes`). Python's `hash()` of token tuples
is 64 bits and unsalted, so colliding prompts can be built and one request would be served another's
K/V; a sha256 collision cannot be built.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from pdserve.engine.kv_events import KvEventLog
from pdserve.prefix_hashing import block_hashes

__all__ = ["BlockPool", "NoFreeBlocksError", "block_hashes", "blocks_for_tokens"]


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
        self._hash_of: dict[int, bytes] = {}  # cached block -> prefix hash
        self._block_of: dict[bytes, int] = {}  # prefix hash -> cached block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first
        self.cache_hits = 0  # blocks handed out again by lookup
        self.events: KvEventLog | None = None  # told every block cached and evicted (KV-aware routing)

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, or cached and evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (reference count 1 each), all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(f"asked for {num_blocks} KV blocks, {self.num_free} free")
        while len(self._free) < num_blocks:
            self._evict_one()
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
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # ----- prefix cache -----------------------------------------------------------------------
    def cache_block(self, block: int, prefix_hash: bytes) -> None:
        """Register a used, fully computed block under its prefix hash (first registration wins)."""
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free; only computed blocks in use can be cached")
        if prefix_hash in self._block_of or block in self._hash_of:
            return
        self._block_of[prefix_hash] = block
        self._hash_of[block] = prefix_hash
        if self.events is not None:
            self.events.stored(prefix_hash)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Take a reference on the cached blocks of the longest cached prefix of `hashes`."""
        hits = []
        for prefix_hash in hashes:
            block = self._block_of.get(prefix_hash)
            if block is None:
                break
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
            hits.append(block)
        self.cache_hits += len(hits)
        return hits

    def _evict_one(self) -> None:
        block, _ = self._evictable.popitem(last=False)
        prefix_hash = self._hash_of.pop(block)
        del self._block_of[prefix_hash]
        self._free.append(block)
        if self.events is not None:
            self.events.removed(prefix_hash)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def assert_all_free(self) -> None:
        """Raise AssertionError naming the leaked blocks unless every block is free (use when idle)."""
        leaked = [b for b, count in enumerate(self._ref_counts) if count != 0]
        if leaked or self.num_free != self.num_blocks:
            raise AssertionError(f"{len(leaked)} KV blocks leaked: {leaked[:16]}")
