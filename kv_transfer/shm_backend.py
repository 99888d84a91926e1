"""Same-host shared-memory KV backend ("shm").

Sender (prefill worker): copies the request's K/V once into a new POSIX shared-memory segment and
sends one control frame over the gRPC `PushKv` stream naming it (`KvHeader.shm_name`, no data).
Receiver (decode worker, `KvTransferServicer`): checks every header field against its pending
intake, opens the segment, checks its size, copies the bytes out, closes it and acks. The sender
unlinks the segment once the ack (or an error) came back, so no segment outlives a transfer.

Only for workers on one host: the receiver opens segments by name, so it accepts only names with
this backend's prefix and sizes equal to the expected K/V. Bytes in local memory cross no link,
so no checksum is computed; every other header check still applies.
"""

from __future__ import annotations

import os
import uuid
from multiprocessing import resource_tracker, shared_memory

import grpc
import torch

from kv_transfer.base import KvSender, KvSpec, KvTransferError, dtype_name, register_backend
from pdserve.transport import open_channel
from pdserve.v1 import kv_pb2_grpc
from pdserve.v1.kv_pb2 import KvAck, KvFrame, KvHeader

BACKEND_NAME = "shm"
SEGMENT_PREFIX = "pdserve-kv-"


def _segment_name(request_id: str) -> str:
    return f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _untrack(segment: shared_memory.SharedMemory) -> None:
    """Python's resource tracker would unlink segments it saw opened; ownership is ours."""
    try:
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - best effort
        pass


def header_for(spec: KvSpec, first_token_id: int, shm_name: str) -> KvHeader:
    return KvHeader(
        request_id=spec.request_id, model_fingerprint=spec.model_fingerprint, dtype=spec.dtype,
        shape=list(spec.shape), block_size=spec.block_size, num_tokens=spec.num_tokens, layer_start=0,
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
        segment = shared_memory.SharedMemory(name=_segment_name(spec.request_id), create=True, size=spec.nbytes)
        _untrack(segment)
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
            segment.close()
            segment.unlink()

    def close(self) -> None:
        self._channel.close()


def check_header(header: KvHeader, spec: KvSpec) -> str:
    """"" when the control frame matches the expected intake, else the first mismatch."""
    checks = [
        ("request_id", header.request_id, spec.request_id),
        ("model_fingerprint", header.model_fingerprint, spec.model_fingerprint),
        ("dtype", header.dtype, spec.dtype), ("shape", tuple(header.shape), spec.shape),
        ("block_size", header.block_size, spec.block_size), ("num_tokens", header.num_tokens, spec.num_tokens),
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


def read_segment(header: KvHeader, spec: KvSpec) -> torch.Tensor:
    """Copy the segment's bytes into a new tensor of the spec's shape (raises OSError/ValueError)."""
    segment = shared_memory.SharedMemory(name=header.shm_name, create=False)
    _untrack(segment)
    try:
        if segment.size < spec.nbytes:
            raise ValueError(f"shm segment holds {segment.size} bytes, expected {spec.nbytes}")
        out = torch.empty(spec.shape, dtype=spec.torch_dtype)
        source = torch.frombuffer(segment.buf, dtype=torch.uint8, count=spec.nbytes)
        out.view(-1).view(torch.uint8).copy_(source)
        del source
        return out
    finally:
        segment.close()


register_backend(BACKEND_NAME, ShmKvSender, lambda *args: None)
