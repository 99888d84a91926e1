"""Same-host GPU-to-GPU K/V hand-off by CUDA IPC handles, carried as explicit bytes (never pickled).

The sender exports the CUDA storage behind a device tensor (`export_tensor`) and gets an
`IpcDescriptor`: the device index, dtype, shape, strides and storage offset of the tensor plus the
opaque handles CUDA gives for its memory, its reference counter and its last-write event. The
descriptor travels as the bytes of `pack` (a fixed little-endian layout, below); the receiver
checks every field (`unpack`, then `import_tensor` against the K/V spec it expects) before it
maps anything. torch's own IPC path (`torch.multiprocessing`) pickles the same values; we only
use its two primitives, `UntypedStorage._share_cuda_` and `UntypedStorage._new_shared_cuda`.

Layout of `pack` (all integers little endian):

    magic  b"PDIPC1"        6 bytes
    device                  u16
    dtype name length, name u8, ascii (a `kv_transfer.base.SUPPORTED_DTYPES` name)
    ndim                    u8 (1..8), then ndim x u64 shape, ndim x i64 strides (elements)
    storage offset          u64 (elements into the storage)
    storage size            u64 (bytes), storage offset in its allocation u64 (bytes)
    ref counter offset      u64, event sync required u8
    3 handles               each u16 length + bytes (memory, ref counter, event; at most 256 bytes)

On a machine without CUDA (or for a CPU tensor) `export_tensor` raises `IpcUnavailable`, and the
caller takes the host path (shared memory on one host, gRPC or Ray otherwise): exactly today's
behaviour. Written for GPUs, verified only through its CPU paths so far.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.base import SUPPORTED_DTYPES, dtype_name

MAGIC = b"PDIPC1"
MAX_HANDLE_BYTES = 256
MAX_NDIM = 8


class IpcUnavailable(RuntimeError):
    """CUDA IPC cannot carry this tensor here (no CUDA, a CPU tensor): take the host path."""


@dataclass(frozen=True)
class IpcDescriptor:
    """Everything a process on the same host needs to map another process's CUDA tensor."""

    device: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int  # elements
    storage_size_bytes: int
    storage_offset_bytes: int  # of the storage inside its CUDA allocation
    memory_handle: bytes
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: unsupported {self.dtype!r}")
        if not 1 <= len(self.shape) <= MAX_NDIM or len(self.strides) != len(self.shape):
            raise ValueError(f"shape/strides: need 1..{MAX_NDIM} dims each, got {self.shape} / {self.strides}")
        if any(d < 1 for d in self.shape) or any(s < 0 for s in self.strides) or self.storage_offset < 0:
            raise ValueError("shape/strides/storage_offset: must be positive / non-negative")
        for name in ("memory_handle", "ref_counter_handle", "event_handle"):
            if len(getattr(self, name)) > MAX_HANDLE_BYTES:
                raise ValueError(f"{name}: longer than {MAX_HANDLE_BYTES} bytes")
        if not self.memory_handle:
            raise ValueError("memory_handle: empty")
        if self.last_byte > self.storage_size_bytes:
            raise ValueError(
                f"shape/strides: the tensor reaches byte {self.last_byte}, "
                f"past its storage of {self.storage_size_bytes}"
            )

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=SUPPORTED_DTYPES[self.dtype]).element_size()

    @property
    def last_byte(self) -> int:
        """One past the last byte of the storage the tensor touches."""
        extent = sum((d - 1) * s for d, s in zip(self.shape, self.strides, strict=True)) + 1
        return (self.storage_offset + extent) * self.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def _handle(data: bytes) -> bytes:
    return struct.pack("<H", len(data)) + data


def pack(d: IpcDescriptor) -> bytes:
    """The descriptor as bytes (layout in the module docstring)."""
    name = d.dtype.encode("ascii")
    n = len(d.shape)
    return b"".join(
        [
            MAGIC,
            struct.pack("<HB", d.device, len(name)),
            name,
            struct.pack("<B", n),
            struct.pack(f"<{n}Q", *d.shape),
            struct.pack(f"<{n}q", *d.strides),
            struct.pack(
                "<QQQQB",
                d.storage_offset,
                d.storage_size_bytes,
                d.storage_offset_bytes,
                d.ref_counter_offset,
                int(d.event_sync_required),
            ),
            _handle(d.memory_handle),
            _handle(d.ref_counter_handle),
            _handle(d.event_handle),
        ]
    )


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ValueError("descriptor: truncated")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def raw(self, size: int) -> bytes:
        if self.pos + size > len(self.data):
            raise ValueError("descriptor: truncated")
        self.pos += size
        return self.data[self.pos - size : self.pos]

    def handle(self) -> bytes:
        (size,) = self.take("<H")
        if size > MAX_HANDLE_BYTES:
            raise ValueError(f"descriptor: handle of {size} bytes")
        return self.raw(size)


def unpack(data: bytes) -> IpcDescriptor:
    """Parse and validate `pack`'s bytes; ValueError naming the problem otherwise."""
    reader = _Reader(bytes(data))
    if reader.raw(len(MAGIC)) != MAGIC:
        raise ValueError("descriptor: bad magic (not a pdserve CUDA IPC descriptor)")
    device, name_len = reader.take("<HB")
    try:
        dtype = reader.raw(name_len).decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("descriptor: dtype name is not ascii") from None
    (ndim,) = reader.take("<B")
    if not 1 <= ndim <= MAX_NDIM:
        raise ValueError(f"descriptor: ndim {ndim}")
    shape, strides = reader.take(f"<{ndim}Q"), reader.take(f"<{ndim}q")
    offset, size, size_offset, ref_offset, sync = reader.take("<QQQQB")
    handles = [reader.handle() for _ in range(3)]
    if reader.pos != len(reader.data):
        raise ValueError("descriptor: trailing bytes")
    return IpcDescriptor(
        device,
        dtype,
        tuple(shape),
        tuple(strides),
        offset,
        size,
        size_offset,
        handles[0],
        handles[1],
        ref_offset,
        handles[2],
        bool(sync),
    )


def export_tensor(tensor: torch.Tensor) -> IpcDescriptor:
    """Describe a CUDA tensor for a process on this host; IpcUnavailable for anything else. The
    sender must keep `tensor` alive (and unchanged) until the receiver acks."""
    if tensor.device.type != "cuda" or not torch.cuda.is_available():
        raise IpcUnavailable(f"CUDA IPC needs a CUDA tensor, got one on {tensor.device}")
    storage = tensor.untyped_storage()
    (device, handle, size, size_offset, ref_handle, ref_offset, event_handle, sync) = storage._share_cuda_()  # type: ignore[attr-defined]
    return IpcDescriptor(
        int(device),
        dtype_name(tensor.dtype),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        int(tensor.storage_offset()),
        int(size),
        int(size_offset),
        bytes(handle),
        bytes(ref_handle),
        int(ref_offset),
        bytes(event_handle or b""),
        bool(sync),
    )


def import_tensor(d: IpcDescriptor, expected_shape: tuple[int, ...], expected_dtype: str) -> torch.Tensor:
    """Map the sender's tensor (a view of its memory) after checking it is the K/V we expect."""
    if tuple(d.shape) != tuple(expected_shape) or d.dtype != expected_dtype:
        raise ValueError(f"descriptor: {d.shape} {d.dtype} is not the expected {expected_shape} {expected_dtype}")
    if not torch.cuda.is_available() or d.device >= torch.cuda.device_count():
        raise IpcUnavailable(f"CUDA device {d.device} is not visible in this process")
    torch.cuda.init()  # opening an IPC handle needs an initialised CUDA context
    storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
        d.device,
        d.memory_handle,
        d.storage_size_bytes,
        d.storage_offset_bytes,
        d.ref_counter_handle,
        d.ref_counter_offset,
        d.event_handle or None,
        d.event_sync_required,
    )
    out = torch.empty(0, dtype=SUPPORTED_DTYPES[d.dtype], device=f"cuda:{d.device}")
    return out.set_(storage, d.storage_offset, d.shape, d.strides)
