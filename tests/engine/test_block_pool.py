import pytest

from engine.block_pool import BlockPool, NoFreeBlocksError, blocks_for_tokens


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
