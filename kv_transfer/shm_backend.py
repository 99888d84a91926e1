"""Same-host shared-memory KV backend ("shm").

Sender (prefill worker): copies the request's K/V once into a shared-memory segment and sends one
control frame over the gRPC `PushKv` stream naming it (`KvHeader.shm_name`, no data).
Receiver (decode worker, `KvTransferServicer`): checks every header field against its pending
intake, maps the segment (mappings are cached), checks its size, copies the bytes out and acks.
The sender reuses a segment only after its ack (or an error) came back and unlinks all of them at
exit; a killed sender can leave `pdserve-kv-<pid>-*` segments behind in /dev/shm.

Only for workers on one host: the receiver opens segments by name, so it accepts only names with
this backend's prefix and sizes that hold the expected K/V. Bytes in local memory cross no link,
so no checksum is computed; every other header check still applies.
"""

from __future__ import annotations

import atexit
import os
import threading
import uuid
from collections import OrderedDict
from multiprocessing import resource_tracker, shared_memory

import grpc
import torch

from kv_transfer.base import KvSender, KvSpec, KvTransferError, SenderCache, dtype_name, register_backend
from pdserve.transport import open_channel
from pdserve.v1 import kv_pb2_grpc
from pdserve.v1.kv_pb2 import KvAck, KvFrame, KvHeader

BACKEND_NAME = "shm"
SEGMENT_PREFIX = "pdserve-kv-"


def _untrack(segment: shared_memory.SharedMemory) -> None:
    """Python's resource tracker would unlink segments it saw opened; ownership is ours."""
    try:
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - best effort
        pass


class SegmentPool:
    """Reusable segments: a fresh segment costs a page fault per 4 KiB page on first touch, which
    makes it several times slower than the copy itself. Sizes are rounded up to 4 MiB; at most
    MAX_IDLE idle segments are kept; every segment is unlinked at exit."""

    GRANULE = 4 * 2**20
    MAX_IDLE = 8

    def __init__(self) -> None:
        self._idle: list[shared_memory.SharedMemory] = []
        self._all: list[shared_memory.SharedMemory] = []
        self._lock = threading.Lock()
        atexit.register(self.close)

    def acquire(self, nbytes: int) -> shared_memory.SharedMemory:
        with self._lock:
            fits = [s for s in self._idle if s.size >= nbytes]
            if fits:
                segment = min(fits, key=lambda s: s.size)
                self._idle.remove(segment)
                return segment
        size = -(-nbytes // self.GRANULE) * self.GRANULE
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        segment = shared_memory.SharedMemory(name=name, create=True, size=size)
        _untrack(segment)
        with self._lock:
            self._all.append(segment)
        return segment

    def release(self, segment: shared_memory.SharedMemory) -> None:
        with self._lock:
            self._idle.append(segment)
            while len(self._idle) > self.MAX_IDLE:
                self._drop(self._idle.pop(0))

    def _drop(self, segment: shared_memory.SharedMemory) -> None:
        self._all.remove(segment)
        segment.close()
        segment.unlink()

    def close(self) -> None:
        with self._lock:
            for segment in list(self._all):
                self._drop(segment)
            self._idle.clear()


_POOL = SegmentPool()


def header_for(spec: KvSpec, first_token_id: int, shm_name: str) -> KvHeader:
    return KvHeader(
        request_id=spec.request_id, model_fingerprint=spec.model_fingerprint, dtype=spec.dtype,
        shape=list(spec.shape), block_size=spec.block_size, num_tokens=spec.num_tokens,
        block_offset=spec.block_offset, layer_start=0,
        layer_end=spec.num_layers, byte_offset=0, byte_length=spec.nbytes, frame_index=0, total_frames=1,
        first_token_id=first_token_id, last=True, shm_name=shm_name,
    )


class ShmKvSender(KvSender):
    def __init__(self, target_address: str) -> None:
        self.target_address = target_address
        self._channel = open_channel(target_address)
        self._stub = kv_pb2_grpc.KvTransferStub(self._channel)

    def send(self, spec: KvSpec, kv: torch.Tensor, first_token_id: int, timeout_s: float) -> KvAck:
        if tuple(kv.shape) != spec.shape or dtype_name(kv.dtype) != spec.dtype:
            raise ValueError("shape/dtype: tensor does not match its spec")
        segment = _POOL.acquire(spec.nbytes)
        try:
            view = torch.frombuffer(segment.buf, dtype=torch.uint8, count=spec.nbytes)
            view.copy_(kv.contiguous().view(-1).view(torch.uint8))  # the one copy
            del view
            frame = KvFrame(header=header_for(spec, first_token_id, segment.name))
            try:
                ack: KvAck = self._stub.PushKv(iter([frame]), timeout=timeout_s)
            except grpc.RpcError as err:
                raise KvTransferError(f"shm PushKv {spec.request_id!r} to {self.target_address} failed: "
                                      f"{err.code().name}: {err.details()}") from err
            if not ack.ok:
                raise KvTransferError(f"shm PushKv {spec.request_id!r} refused: {ack.error}")
            return ack
        finally:
            _POOL.release(segment)  # reused only after the receiver acked (or gave up on) this transfer

    def close(self) -> None:
        self._channel.close()


def check_header(header: KvHeader, spec: KvSpec) -> str:
    """"" when the control frame matches the expected intake, else the first mismatch."""
    checks = [
        ("request_id", header.request_id, spec.request_id),
        ("model_fingerprint", header.model_fingerprint, spec.model_fingerprint),
        ("dtype", header.dtype, spec.dtype), ("shape", tuple(header.shape), spec.shape),
        ("block_size", header.block_size, spec.block_size), ("num_tokens", header.num_tokens, spec.num_tokens),
        ("block_offset", header.block_offset, spec.block_offset),
        ("byte_length", header.byte_length, spec.nbytes),
    ]
    for field, got, want in checks:
        if got != want:
            return f"{field}: got {got!r}, expected {want!r}"
    if not header.shm_name.startswith(SEGMENT_PREFIX) or "/" in header.shm_name:
        return f"shm_name: {header.shm_name!r} is not a pdserve KV segment"
    if header.first_token_id < 0:
        return f"first_token_id: must be >= 0, got {header.first_token_id}"
    return ""


_MAPPED: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()  # receiver side, LRU
_MAPPED_LOCK = threading.Lock()
MAX_MAPPED = 32


def _mapped(name: str) -> shared_memory.SharedMemory:
    """The receiver's mapping of a sender's segment, kept while the sender keeps reusing it."""
    with _MAPPED_LOCK:
        segment = _MAPPED.pop(name, None)
        if segment is None:
            segment = shared_memory.SharedMemory(name=name, create=False)
            _untrack(segment)
        _MAPPED[name] = segment
        while len(_MAPPED) > MAX_MAPPED:
            _MAPPED.popitem(last=False)[1].close()
        return segment


def read_segment(header: KvHeader, spec: KvSpec) -> torch.Tensor:
    """Copy the segment's bytes into a new tensor of the spec's shape (raises OSError/ValueError)."""
    segment = _mapped(header.shm_name)
    if segment.size < spec.nbytes:
        raise ValueError(f"shm segment holds {segment.size} bytes, expected {spec.nbytes}")
    out = torch.empty(spec.shape, dtype=spec.torch_dtype)
    source = torch.frombuffer(segment.buf, dtype=torch.uint8, count=spec.nbytes)
    out.view(-1).view(torch.uint8).copy_(source)
    return out


_SENDERS: SenderCache[ShmKvSender] = SenderCache(ShmKvSender)  # one control channel per decode worker

register_backend(BACKEND_NAME, _SENDERS.get, lambda *args: None)
