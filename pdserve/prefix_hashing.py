"""Prefix block hashes: the keys of the prefix cache on every worker, and of the router's KV index.

Torch-free, so the router computes the same keys as the workers from the same token ids. Hash i of
a prompt covers its tokens [0, (i + 1) * block_size); the chain means equal hash i implies equal
blocks 0..i (sha256: a collision cannot be built, unlike Python's 64-bit `hash()`).
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

#: The chain's start value: a version tag, so a change of the scheme never matches old keys.
_HASH_SEED = hashlib.sha256(b"pdserve.block_hash.v1").digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """Chained sha256 of each FULL block: hash i covers tokens [0, (i + 1) * block_size), as
    sha256(hash i-1 || block_size || the block's token ids as little-endian int64). A `salt` (the
    request's cache_salt) changes the chain's start, so salted blocks match only the same salt."""
    return chain_hashes(packed_blocks(token_ids, block_size), block_size, chain_start(salt))


def chain_start(salt: str = "") -> bytes:
    """The value before block 0's hash (`block_hashes`)."""
    if salt:
        return hashlib.sha256(_HASH_SEED + b"cache_salt" + salt.encode("utf-8")).digest()
    return _HASH_SEED


def packed_blocks(token_ids: Sequence[int], block_size: int) -> bytes:
    """The full blocks' token ids as little-endian int64, the bytes `block_hashes` hashes."""
    full = len(token_ids) // block_size * block_size
    packed = array.array("q", token_ids[:full])  # one conversion, not one per block (router: per request)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def chain_hashes(data: bytes, block_size: int, previous: bytes) -> list[bytes]:
    """The chained hashes of the blocks in `data` (`packed_blocks`), after `previous`: the chain's
    start, or the hash of the block just before `data` (to go on hashing a prompt's later blocks)."""
    hashes, size, step = [], block_size.to_bytes(8, "little"), 8 * block_size
    sha256 = hashlib.sha256
    for start in range(0, len(data), step):
        previous = sha256(previous + size + data[start : start + step]).digest()
        hashes.append(previous)
    return hashes
