"""The KV cache commits its host memory at start-up: RSS does not creep up by the cache's size as
blocks are first written under load (which read as a leak in the soak)."""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache import KVCache, KVCacheShape


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _cache_mb(shared: bool) -> tuple[float, KVCache]:
    shape = KVCacheShape(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    num_blocks = shape.blocks_for_budget(96 * 2**20)
    before = _rss_mb()
    cache = KVCache(shape, num_blocks, shared=shared)
    return _rss_mb() - before, cache


def test_private_cache_is_resident_at_start() -> None:
    grown, cache = _cache_mb(shared=False)
    assert cache.kv.numel() * 4 >= 95 * 2**20
    assert grown >= 90, f"RSS grew only {grown:.0f} MB for a 96 MB cache"
    assert int(cache.kv.count_nonzero()) == 0


def test_shared_cache_is_resident_at_start() -> None:
    grown, cache = _cache_mb(shared=True)
    assert cache.shm_name is not None  # really in a shared-memory segment
    assert grown >= 90, f"RSS grew only {grown:.0f} MB for a 96 MB shared cache"
