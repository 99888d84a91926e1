import pytest

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError, blocks_for_tokens


def test_allocate_free_roundtrip() -> None:
    pool = BlockPool(8, 16)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(a)
    pool.free(b)
    pool.assert_all_free()


def test_all_or_nothing_allocation() -> None:
    pool = BlockPool(4, 16)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1


def test_reference_counts_keep_shared_blocks() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.free(blocks)
    assert pool.num_free == 2 and all(pool.ref_count(b) == 1 for b in blocks)
    pool.free(blocks)
    pool.assert_all_free()


def test_double_free_and_leak_are_reported() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.allocate(1)
    with pytest.raises(AssertionError, match="1 KV blocks leaked"):
        pool.assert_all_free()
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free(blocks)
    with pytest.raises(ValueError, match="free"):
        pool.incref(blocks)


def test_blocks_for_tokens() -> None:
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


@pytest.mark.parametrize("args", [(0, 16), (4, 0)])
def test_bad_sizes(args: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        BlockPool(*args)


def test_prefix_cache_keeps_freed_blocks_until_evicted() -> None:
    from pdserve.engine.block_pool import block_hashes

    pool = BlockPool(4, 2)
    prompt = [1, 2, 3, 4, 5]
    hashes = block_hashes(prompt, 2)
    assert len(hashes) == 2  # only full blocks
    blocks = pool.allocate(3)
    for block, h in zip(blocks, hashes, strict=False):
        pool.cache_block(block, h)
    pool.free(blocks)
    pool.assert_all_free()  # cached blocks hold no reference and count as free
    assert pool.num_cached == 2
    again = pool.lookup(block_hashes([1, 2, 3, 4, 9, 9], 2))
    assert again == blocks[:2] and pool.cache_hits == 2
    assert pool.lookup(block_hashes([7, 7], 2)) == []
    pool.free(again)
    pool.allocate(4)  # needs every block: the cached ones are evicted
    assert pool.num_cached == 0 and pool.lookup(hashes) == []


def test_shared_prefix_blocks_are_reference_counted() -> None:
    from pdserve.engine.block_pool import block_hashes

    pool = BlockPool(8, 2)
    hashes = block_hashes([1, 2, 3, 4], 2)
    first = pool.allocate(2)
    for block, h in zip(first, hashes, strict=True):
        pool.cache_block(block, h)
    second = pool.lookup(hashes)  # a second request shares them while the first still runs
    assert second == first and all(pool.ref_count(b) == 2 for b in first)
    pool.free(first)
    pool.allocate(6)  # all non-shared blocks: the shared ones must survive
    assert pool.lookup(hashes[:1]) == first[:1]


def _python_hash_chain(token_ids: list[int], block_size: int) -> list[int]:
    """The scheme block hashes replaced: Python's hash() of (previous, token tuple)."""
    hashes, previous = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start : start + block_size])))
        hashes.append(previous)
    return hashes


def test_a_python_hash_collision_no_longer_aliases_cached_blocks() -> None:
    """hash(-1) == hash(-2) in CPython, so token tuples holding them collide under hash(): a prompt
    built that way was handed another prompt's cached K/V. sha256 block hashes tell them apart."""
    from pdserve.engine.block_pool import block_hashes

    victim, attacker = [5, 6, -1, -1, 7, 8], [5, 6, -2, -2, 7, 8]
    assert hash(-1) == hash(-2)
    assert _python_hash_chain(victim, 2) == _python_hash_chain(attacker, 2)  # the old keys alias fully
    pool = BlockPool(8, 2)
    blocks = pool.allocate(3)
    for block, h in zip(blocks, block_hashes(victim, 2), strict=True):
        pool.cache_block(block, h)
    pool.free(blocks)
    hits = pool.lookup(block_hashes(attacker, 2))
    assert hits == blocks[:1]  # only the genuinely shared first block [5, 6]
    pool.free(hits)
    assert block_hashes(victim, 2)[1:] != block_hashes(attacker, 2)[1:]


def test_block_hashes_are_chained_sha256_over_the_whole_prefix() -> None:
    from pdserve.engine.block_pool import block_hashes

    a, b = block_hashes([1, 2, 3, 4], 2), block_hashes([9, 2, 3, 4], 2)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in a)
    assert a[1] != b[1]  # block 2 is equal, but its prefix is not
    assert block_hashes([1, 2, 3, 4], 2) == a  # deterministic (no per-process salt: prefill and decode agree)
    assert block_hashes([1, 2, 3, 4], 4)[0] not in a  # the block size is part of the key


@pytest.mark.parametrize("salt", ["", "tenant-7"])
def test_block_hashes_follow_their_documented_format(salt: str) -> None:
    """Hash i = sha256(hash i-1 || block_size as 8 bytes || the block's ids as little-endian int64),
    from a versioned seed (salted: a seed of its own); only full blocks. Workers and the router must
    agree on these bytes, so they are pinned here against a direct reading of the format."""
    import hashlib
    import random
    import struct

    from pdserve.engine.block_pool import block_hashes

    rng = random.Random(3)
    ids = [rng.randrange(0, 2**40) for _ in range(75)]
    previous = hashlib.sha256(b"pdserve.block_hash.v1").digest()
    if salt:
        previous = hashlib.sha256(previous + b"cache_salt" + salt.encode()).digest()
    expected = []
    for start in range(0, 64, 16):  # 4 full blocks of 16; the last 11 ids make no block
        block = struct.pack("<16q", *ids[start : start + 16])
        previous = hashlib.sha256(previous + struct.pack("<q", 16) + block).digest()
        expected.append(previous)
    assert block_hashes(ids, 16, salt) == expected
