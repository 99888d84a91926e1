"""The paged KV cache memory of one worker.

`kv` is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: index 0 of the
second axis holds keys, 1 values. Token t of a sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`. A request's K/V, as shipped between
workers, is `kv[:, :, block_ids]` -> [num_layers, 2, len(block_ids), block_size, heads, head_dim].

Device: `kv` lives on the engine's device (CPU or one CUDA device). What crosses a process
boundary is always a host tensor: `gather` stages device blocks through pinned host memory (the
CUDA caching host allocator reuses those buffers) and `scatter` copies host blocks up to the
device. On a CPU cache both are the plain copies they always were. The dtype of shipped K/V must
equal the cache's: a mismatch is refused, never converted silently.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import secrets
import shutil
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

log = logging.getLogger(__name__)

#: Every pdserve shared-memory segment starts with this (KV caches and transfer staging segments).
SHM_PREFIX = "pdserve-kv-"
SHM_DIR = "/dev/shm"
_SEGMENT_PREFIX: tuple[int, str] | None = None  # (pid, prefix) of this process


def segment_prefix() -> str:
    """The prefix of every segment this process creates: `pdserve-kv-<pid>-<64 random bits>-`. A
    prefill worker reports it (GetInfo `kv_segment_prefix`), and a decode worker accepts a segment
    for a request only when its name starts with the prefix of the prefill worker it called. The
    random part keeps names unguessable to anyone who cannot list this host's /dev/shm."""
    global _SEGMENT_PREFIX
    pid = os.getpid()
    if _SEGMENT_PREFIX is None or _SEGMENT_PREFIX[0] != pid:  # a forked child gets its own
        _SEGMENT_PREFIX = (pid, f"{SHM_PREFIX}{pid}-{secrets.token_hex(8)}-")
    return _SEGMENT_PREFIX[1]


def untrack_segment(segment: shared_memory.SharedMemory) -> None:
    """Python's resource tracker would unlink segments it saw opened; ownership is ours."""
    try:
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - best effort
        pass


def unlink_segment(segment: shared_memory.SharedMemory) -> None:
    """Remove `segment`'s name (the memory goes once every mapping is closed), quietly if it is gone.
    Not `segment.unlink()`: that also unregisters the segment with Python's resource tracker, which
    `untrack_segment` already did, and the tracker then printed a KeyError traceback at every stop."""
    try:
        import _posixshmem  # CPython's POSIX shm module, which SharedMemory itself uses

        _posixshmem.shm_unlink(segment._name)  # type: ignore[attr-defined]
    except ImportError:  # not POSIX: no resource tracker for shared memory there either
        segment.unlink()
    except OSError:
        pass


def remove_stale_segments() -> int:
    """Unlink pdserve segments (`pdserve-kv-<pid>-*`, or the older `pdserve-kv-cache-<pid>-*`) whose
    creating process is gone (killed workers cannot unlink their own); returns how many were removed."""
    if not os.path.isdir(SHM_DIR):
        return 0
    removed = 0
    for name in os.listdir(SHM_DIR):
        if not name.startswith(SHM_PREFIX):
            continue
        pid_text = name[len(SHM_PREFIX) :].removeprefix("cache-").split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str] | None:
    """A zero tensor in a new shared-memory segment (unlinked at exit), or None when /dev/shm is
    missing or too small."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not os.path.isdir(SHM_DIR) or shutil.disk_usage(SHM_DIR).free < nbytes + 64 * 2**20:
        log.warning("KV cache stays in private memory: %s lacks %d MiB free", SHM_DIR, nbytes >> 20)
        return None
    remove_stale_segments()
    segment = shared_memory.SharedMemory(
        name=f"{segment_prefix()}cache-{uuid.uuid4().hex[:12]}", create=True, size=nbytes
    )
    untrack_segment(segment)
    atexit.register(unlink_segment, segment)
    tensor = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    return tensor, segment.name


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor for K/V on its way to or from a device: pinned (page-locked, so
    device copies run asynchronously at full speed) when CUDA is available, plain otherwise."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when on the CPU, else a copy in pinned host memory (waits for the copy)."""
    if tensor.device.type == "cpu":
        return tensor
    staged = host_empty(tuple(tensor.shape), tensor.dtype)
    staged.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return staged


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

    def __init__(self, shape: KVCacheShape, num_blocks: int, device: str = "cpu", shared: bool = False) -> None:
        """`shared`: put the memory in a named shared-memory segment (`shm_name`) so a decode worker on
        this host can copy blocks straight out of it (CPU only; falls back to private memory)."""
        self.shape = shape
        self.num_blocks = num_blocks
        self.shm_name: str | None = None
        dims = (shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        placed = _shared_zeros(dims, shape.dtype) if shared and device == "cpu" else None
        if placed is not None:
            self.kv, self.shm_name = placed
        else:  # [L, 2, num_blocks, block_size, kv_heads, head_dim]
            self.kv = torch.zeros(dims, dtype=shape.dtype, device=device)
        if self.kv.device.type == "cpu":
            # Fresh zero memory (calloc, a new shm segment) is mapped lazily: without this, RSS grows
            # by the whole cache over the first thousands of requests as blocks are first written,
            # which reads as a leak and hides real growth. Writing it now commits the cache at
            # start-up, where a host that lacks the memory fails at once, not under load.
            self.kv.view(-1).fill_(0)

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer as flat slot views: ([slots, heads, dim], [slots, heads, dim])."""
        s = self.shape
        flat = self.kv[layer].view(2, self.num_blocks * s.block_size, s.num_kv_heads, s.head_dim)
        return flat[0], flat[1]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def gather_on_device(self, block_ids: list[int]) -> torch.Tensor:
        """A request's K/V on the cache's device: [L, 2, len(block_ids), block_size, heads, dim] (a copy)."""
        return self.kv[:, :, block_ids].contiguous()

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """A request's K/V as a host tensor (a copy; staged through pinned memory from a device)."""
        return to_host(self.gather_on_device(block_ids))

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write shipped K/V (as returned by `gather`, on any device) into this cache's `block_ids`.
        ValueError when its shape or dtype differs from this cache's."""
        expected = (
            self.shape.num_layers,
            2,
            len(block_ids),
            self.shape.block_size,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        )
        if tuple(blocks.shape) != expected:
            raise ValueError(f"K/V shape {tuple(blocks.shape)} does not fit blocks of shape {expected}")
        if blocks.dtype != self.kv.dtype:
            raise ValueError(
                f"dtype: shipped K/V is {blocks.dtype}, this cache holds {self.kv.dtype} "
                "(run prefill and decode workers with the same --dtype)"
            )
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(2, ids, blocks.to(self.kv.device, non_blocking=True))

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
