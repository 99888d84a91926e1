"""Same-host GPU-to-GPU KV backend ("cuda_ipc"): the decode worker copies the request's blocks device
to device out of the prefill worker's KV pool, which it maps by a CUDA IPC handle. No host copy.

It is the "shm" backend's control flow with a device pool in place of a shared-memory segment:
- Sender (prefill worker, `CudaIpcKvSender`): exports its device KV pool once (`cuda_ipc.export_tensor`,
  the descriptor as `cuda_ipc.pack` bytes, never pickled), waits for its stream (the pass's writes are
  done), and sends one control frame over `PushKv`: the shm frame's fields (`shm_block_ids`,
  `shm_num_blocks`: the request's blocks and the pool's layout) with `cuda_ipc_descriptor` in place
  of `shm_name`. Its blocks stay untouched until the ack, then it frees them, as on the shm path.
- Receiver (decode worker, `KvTransferServicer`): `locate_blocks` runs the shm path's field checks
  (dtype named first, fingerprint, shape, block size, token count, block ids, checksum), then checks
  the descriptor against the expected layout ([L, 2, shm_num_blocks, block_size, H, D], C order), and
  maps the pool once per prefill worker (`_POOLS`, keyed by the identity the decode worker bound to
  the intake: that prefill worker's segment prefix, from its GetInfo). A frame naming another
  descriptor than the pool already mapped for that prefill worker is refused (a stale or forged
  handle), so is one whose handle CUDA cannot open; the intake fails at once and the request fails
  over (the router prefills it elsewhere). The consumer's `InPlaceKv` copies device to device into
  the reserved blocks and waits for the copy before the ack.

Fallbacks to the host path, each with a log line, never silently:
- `kv_transfer.routing.choose_route` under `auto`: cuda_ipc only when the prefill worker is on this
  host and this worker's KV cache is on a CUDA device; otherwise shm (same host) or grpc.
- The sender's pool is not on CUDA (`IpcUnavailable` on export): it sends over shm instead (the
  decode worker's intake for cuda_ipc also accepts that prefill worker's shm segments).
- The receiver cannot map the pool's device (`IpcUnavailable` on import): it acks with
  `HOST_PATH_PLEASE`, leaves the intake pending, and the sender sends the same blocks over shm.
Written for GPUs; only the CPU paths (checks, refusals, fallbacks) run in the test suite.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict

import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.kv_transfer import shm_backend
from pdserve.kv_transfer.base import KvSender, KvSpec, KvTransferError, SenderCache, register_backend
from pdserve.kv_transfer.cuda_ipc import IpcDescriptor, IpcUnavailable, export_tensor, import_tensor, pack, unpack
from pdserve.v1.kv_pb2 import KvAck, KvHeader

log = logging.getLogger(__name__)

BACKEND_NAME = "cuda_ipc"
#: Backends whose receiver copies the blocks straight out of the sender's memory into the reserved
#: blocks (the decode worker registers their intakes in place, bound to the prefill worker's identity).
IN_PLACE_BACKENDS = (shm_backend.BACKEND_NAME, BACKEND_NAME)
#: Starts the error of an ack that asks the sender to send the same blocks over the host path.
HOST_PATH_PLEASE = "cuda_ipc unavailable on the receiver, send over shm"
MAX_POOLS = 32

_LOGGED: set[str] = set()
_LOGGED_LOCK = threading.Lock()


def log_fallback(reason: str) -> None:
    """One log line per distinct reason the host path is taken instead of CUDA IPC."""
    with _LOGGED_LOCK:
        if reason in _LOGGED:
            return
        _LOGGED.add(reason)
    log.warning("kv backend: %s; KV goes through host memory", reason)


def ipc_unavailable_reason(device: torch.device | str) -> str:
    """Why a KV cache on `device` cannot take part in CUDA IPC ("" when it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"CUDA IPC needs the KV cache on a CUDA device, this worker's is on {device}"
    if not torch.cuda.is_available():
        return "CUDA IPC: CUDA is not available in this process"
    return ""


# ----- sender --------------------------------------------------------------------------------------
_EXPORTS: dict[int, tuple[torch.Tensor, bytes]] = {}  # id(pool tensor) -> (the pool, kept alive; its descriptor)
_EXPORTS_LOCK = threading.Lock()


def exported_pool(cache: KVCache) -> bytes:
    """The descriptor bytes of `cache`'s whole pool, exported once per pool; IpcUnavailable off CUDA."""
    with _EXPORTS_LOCK:
        known = _EXPORTS.get(id(cache.kv))
        if known is not None and known[0] is cache.kv:
            return known[1]
        data = pack(export_tensor(cache.kv))
        _EXPORTS[id(cache.kv)] = (cache.kv, data)
        return data


class CudaIpcKvSender(KvSender):
    """Sends a control frame naming the pool's IPC handle; the host path (shm) when IPC cannot."""

    def __init__(self, target_address: str) -> None:
        self.target_address = target_address
        self._host = shm_backend.get_sender(target_address)  # one control channel per decode worker

    def send(self, spec: KvSpec, kv: torch.Tensor, first_token_id: int, timeout_s: float, checksum: str = "") -> KvAck:
        """A tensor outside the pool (a gathered copy) has no handle worth exporting: host path."""
        return self._host.send(spec, kv, first_token_id, timeout_s, checksum)

    def send_blocks(
        self,
        spec: KvSpec,
        cache: KVCache,
        block_ids: list[int],
        first_token_id: int,
        timeout_s: float,
        checksum: str = "",
    ) -> KvAck:
        if len(block_ids) != spec.shape[2]:
            raise ValueError(f"block_ids: {len(block_ids)} blocks for a spec of {spec.shape[2]}")
        try:
            descriptor = exported_pool(cache)
        except IpcUnavailable as err:
            log_fallback(f"cuda_ipc asked of a prefill worker that cannot export its pool ({err})")
            return self._host.send_blocks(spec, cache, block_ids, first_token_id, timeout_s, checksum)
        if cache.device.type == "cuda":  # the pass's K/V is written before another process reads it
            torch.cuda.current_stream(cache.device).synchronize()
        crc = (checksum, shm_backend.blocks_checksum(cache.kv, block_ids, checksum)) if checksum else None
        header = shm_backend.header_for(spec, first_token_id, "", block_ids, cache.num_blocks, crc)
        header.cuda_ipc_descriptor = descriptor
        ack = self._host.push(spec, header, timeout_s, refuse=False)
        if not ack.ok and ack.error.startswith(HOST_PATH_PLEASE):
            log_fallback(f"decode worker {self.target_address} cannot map this pool ({ack.error})")
            return self._host.send_blocks(spec, cache, block_ids, first_token_id, timeout_s, checksum)
        if not ack.ok:
            raise KvTransferError(f"cuda_ipc PushKv {spec.request_id!r} refused: {ack.error}")
        return ack


# ----- receiver ------------------------------------------------------------------------------------
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides (elements) of `shape`."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def check_descriptor(d: IpcDescriptor, header: KvHeader, spec: KvSpec) -> str:
    """ "" when the descriptor is the pool the frame says, holding the expected K/V; else why not."""
    if d.dtype != spec.dtype:
        return (
            f"cuda_ipc_descriptor: the pool holds {d.dtype!r}, this worker's cache {spec.dtype!r}: prefill "
            "and decode workers must run the same --dtype"
        )
    layout = (spec.shape[0], 2, header.shm_num_blocks, *spec.shape[3:])
    if d.shape != layout:
        return f"cuda_ipc_descriptor: pool shape {list(d.shape)}, the frame's layout is {list(layout)}"
    if d.strides != contiguous_strides(d.shape):
        return f"cuda_ipc_descriptor: strides {list(d.strides)} are not the C-order strides of {list(d.shape)}"
    return ""


_POOLS: OrderedDict[str, tuple[bytes, torch.Tensor]] = OrderedDict()  # prefill identity -> (descriptor, map)
_POOLS_LOCK = threading.Lock()


def mapped_pool(owner: str, data: bytes, d: IpcDescriptor) -> torch.Tensor:
    """The pool of prefill worker `owner`, mapped on first use. ValueError for another descriptor than
    the one mapped for `owner` (stale or forged) or one CUDA cannot open; IpcUnavailable when this
    process cannot see the pool's device."""
    with _POOLS_LOCK:
        known = _POOLS.get(owner)
        if known is not None:
            if known[0] != data:
                raise ValueError(
                    "cuda_ipc_descriptor: not the pool mapped for this prefill worker (a stale or forged handle)"
                )
            _POOLS.move_to_end(owner)
            return known[1]
        try:
            pool = import_tensor(d, d.shape, d.dtype)
        except IpcUnavailable:
            raise
        except RuntimeError as err:  # the driver refused the handle
            raise ValueError(f"cuda_ipc_descriptor: CUDA cannot open the handle: {err}") from err
        _POOLS[owner] = (data, pool)
        while len(_POOLS) > MAX_POOLS:
            _POOLS.popitem(last=False)
        return pool


def forget_pool(owner: str) -> None:
    """Unmap the pool of prefill worker `owner` (a prefill there failed: it may have died or restarted;
    a mapping would keep a dead worker's device memory alive)."""
    with _POOLS_LOCK:
        _POOLS.pop(owner, None)


def locate_blocks(
    header: KvHeader,
    spec: KvSpec,
    owner: str,
    require_checksum: str = "",
) -> tuple[torch.Tensor, list[int]]:
    """The mapped pool and the request's block ids in it, after every check (ValueError naming the
    field); IpcUnavailable when this process cannot map it (the sender then takes the host path).
    `owner`: the identity of the prefill worker called for this request ("": no device KV accepted)."""
    error = shm_backend.check_fields(header, spec) or shm_backend.check_blocks(header, require_checksum)
    if not error and not owner:
        error = "cuda_ipc_descriptor: this intake accepts no device KV (no prefill worker bound to it)"
    if error:
        raise ValueError(error)
    data = bytes(header.cuda_ipc_descriptor)
    descriptor = unpack(data)  # ValueError naming the problem
    error = check_descriptor(descriptor, header, spec)
    if error:
        raise ValueError(error)
    return mapped_pool(owner, data, descriptor), list(header.shm_block_ids)


_SENDERS: SenderCache[CudaIpcKvSender] = SenderCache(CudaIpcKvSender)

register_backend(BACKEND_NAME, _SENDERS.get)
