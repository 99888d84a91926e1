"""Pure KV framing: split a request's KV tensor into KvFrames and reassemble them safely.

Wire layout (see proto/pdserve/v1/kv.proto): the payload is the tensor of shape
``[L, 2, n_blocks, block_size, H, D]`` in contiguous C order, so layer ``l`` is the byte range
``[l * layer_nbytes, (l + 1) * layer_nbytes)``. A frame covers layers
``[layer_start, layer_end)`` and carries bytes ``[byte_offset, byte_offset + byte_length)`` of
that layer range. Whole layers are grouped while they fit in ``max_frame_bytes``; a bigger
layer is cut into several frames with ``layer_end == layer_start + 1``.

Invariants enforced by :class:`FrameAssembler` (the receiver trusts nothing):

- every header field matches the expected :class:`KvSpec` and is checked BEFORE any byte is
  written; frames arrive in order (``frame_index`` 0, 1, ...), each starting exactly where the
  previous one ended (no gap, no overlap), within the payload and within its layer range;
- ``len(data) == byte_length`` and ``zlib.crc32(data) == checksum``;
- ``total_frames`` and ``first_token_id`` are identical in every frame, ``last`` is set on the
  final frame only, and the final frame ends exactly at the payload's end;
- after the first error the assembler is poisoned: every later call raises.

Tensors of any supported dtype (including bfloat16, which numpy lacks) move through uint8
views, never through pickle or torch serialization.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pdserve.engine.kv_cache import host_empty, to_host
from pdserve.kv_transfer.base import KvSpec, dtype_name
from pdserve.v1.kv_pb2 import KvFrame, KvHeader

DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_TOTAL_BYTES = 8 * 1024 * 1024 * 1024


class KvFrameError(ValueError):
    """A frame (or the stream) is invalid; ``field`` names the offending header field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class FrameRange:
    """Where one frame's bytes sit: layer range plus offset/length inside that range."""

    layer_start: int
    layer_end: int
    byte_offset: int
    byte_length: int


def plan_frames(spec: KvSpec, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[FrameRange]:
    """Return the frame ranges, in order, covering the whole payload of ``spec``."""
    if max_frame_bytes < 1:
        raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")
    lb, num_layers = spec.layer_nbytes, spec.num_layers
    if lb <= max_frame_bytes:
        per_frame = max_frame_bytes // lb
        return [
            FrameRange(ls, min(ls + per_frame, num_layers), 0, (min(ls + per_frame, num_layers) - ls) * lb)
            for ls in range(0, num_layers, per_frame)
        ]
    return [
        FrameRange(layer, layer + 1, off, min(max_frame_bytes, lb - off))
        for layer in range(num_layers)
        for off in range(0, lb, max_frame_bytes)
    ]


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """Return a read-only uint8 memoryview of ``kv`` in C order (copies only if needed; a device
    tensor is staged through pinned host memory)."""
    flat = to_host(kv.detach()).contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.toreadonly()


def encode_frames(
    spec: KvSpec,
    kv: torch.Tensor,
    first_token_id: int,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Iterator[KvFrame]:
    """Return an iterator of the KvFrames carrying ``kv`` (shape and dtype must match ``spec``).

    Arguments are validated eagerly (ValueError here, not on first iteration); each frame's
    data is one copy of its byte range.
    """
    if tuple(kv.shape) != spec.shape:
        raise ValueError(f"shape: tensor has {tuple(kv.shape)}, spec says {spec.shape}")
    if dtype_name(kv.dtype) != spec.dtype:
        raise ValueError(f"dtype: tensor has {kv.dtype}, spec says {spec.dtype}")
    if first_token_id < 0:
        raise ValueError(f"first_token_id: must be >= 0, got {first_token_id}")
    return _frames(spec, tensor_bytes(kv), first_token_id, plan_frames(spec, max_frame_bytes))


def encode_frames_as_ready(
    spec: KvSpec,
    buf: torch.Tensor,
    first_token_id: int,
    wait_layers: Callable[[int], None],
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Iterator[KvFrame]:
    """Layer-wise streaming: frames of at most one layer each, taken from ``buf`` while it is still
    being filled. Before each frame, ``wait_layers(n)`` blocks until layers [0, n) of ``buf`` hold
    their final bytes (and raises to abort the stream)."""
    if tuple(buf.shape) != spec.shape or dtype_name(buf.dtype) != spec.dtype or not buf.is_contiguous():
        raise ValueError("buf: must be a contiguous tensor of the spec's shape and dtype")
    plan = plan_frames(spec, min(max_frame_bytes, spec.layer_nbytes))
    raw = tensor_bytes(buf)  # a view: bytes are read when each frame is built
    for index, rng in enumerate(plan):
        wait_layers(rng.layer_end)
        start = rng.layer_start * spec.layer_nbytes + rng.byte_offset
        chunk = raw[start : start + rng.byte_length]
        yield KvFrame(
            header=_header(spec, rng, index, len(plan), zlib.crc32(chunk), first_token_id), data=chunk.tobytes()
        )


def _frames(spec: KvSpec, raw: memoryview, first_token_id: int, plan: list[FrameRange]) -> Iterator[KvFrame]:
    for index, rng in enumerate(plan):
        start = rng.layer_start * spec.layer_nbytes + rng.byte_offset
        chunk = raw[start : start + rng.byte_length]
        header = _header(spec, rng, index, len(plan), zlib.crc32(chunk), first_token_id)
        yield KvFrame(header=header, data=chunk.tobytes())


def _header(spec: KvSpec, rng: FrameRange, index: int, total: int, crc: int, first_token_id: int) -> KvHeader:
    return KvHeader(
        request_id=spec.request_id,
        model_fingerprint=spec.model_fingerprint,
        dtype=spec.dtype,
        shape=list(spec.shape),
        block_size=spec.block_size,
        num_tokens=spec.num_tokens,
        block_offset=spec.block_offset,
        layer_start=rng.layer_start,
        layer_end=rng.layer_end,
        byte_offset=rng.byte_offset,
        byte_length=rng.byte_length,
        frame_index=index,
        total_frames=total,
        checksum=crc,
        first_token_id=first_token_id,
        last=index == total - 1,
    )


class FrameAssembler:
    """Validates frames one by one against an expected spec and writes them into a buffer.

    Not thread-safe: feed one request's stream from one thread.
    """

    def __init__(self, expected: KvSpec, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> None:
        if expected.nbytes > max_total_bytes:
            raise KvFrameError("shape", f"payload of {expected.nbytes} bytes exceeds limit {max_total_bytes}")
        self.expected = expected
        self._buf = host_empty(expected.shape, expected.torch_dtype)  # pinned when a GPU may take it
        self._dst = self._buf.reshape(-1).view(torch.uint8).numpy().data
        self._received = 0
        self._next_index = 0
        self._total_frames: int | None = None
        self._first_token_id: int | None = None
        self._complete = False
        self._error: KvFrameError | None = None

    @property
    def bytes_received(self) -> int:
        """Payload bytes validated and written so far."""
        return self._received

    @property
    def complete(self) -> bool:
        """True once the last frame was accepted."""
        return self._complete

    def add(self, frame: KvFrame) -> None:
        """Validate ``frame`` completely, then write its bytes; KvFrameError if invalid."""
        if self._error is not None:
            raise KvFrameError(self._error.field, f"stream already failed: {self._error}")
        if self._complete:
            raise KvFrameError("frame_index", f"frame {frame.header.frame_index} after the last frame")
        try:
            start = self._validate(frame)
        except KvFrameError as err:
            self._error = err
            raise
        self._dst[start : start + len(frame.data)] = frame.data
        self._received += len(frame.data)
        self._next_index += 1
        self._complete = frame.header.last

    def finish(self) -> tuple[torch.Tensor, int]:
        """Return ``(kv_tensor, first_token_id)``; KvFrameError unless every byte arrived."""
        if self._error is not None:
            raise KvFrameError(self._error.field, f"stream failed: {self._error}")
        if not self._complete or self._first_token_id is None:
            total = "?" if self._total_frames is None else self._total_frames
            raise KvFrameError(
                "last",
                f"truncated stream: got {self._next_index} of {total} frames, "
                f"{self._received} of {self.expected.nbytes} bytes",
            )
        return self._buf, self._first_token_id

    def _validate(self, frame: KvFrame) -> int:
        """Check every header field and the data; return the absolute byte offset to write at."""
        if not frame.HasField("header"):
            raise KvFrameError("header", "missing")
        h = frame.header
        self._check_identity(h)
        self._check_sequence(h)
        start = self._check_range(h)
        self._check_data(h, frame.data, start)
        return start

    def _check_identity(self, h: KvHeader) -> None:
        exp = self.expected
        if h.dtype != exp.dtype:  # before the fingerprint (which covers the dtype) so the cause is named
            raise KvFrameError(
                "dtype",
                f"sender's K/V is {h.dtype!r}, this worker's cache holds {exp.dtype!r}: "
                "prefill and decode workers must run the same --dtype",
            )
        for field in ("request_id", "model_fingerprint", "block_size", "num_tokens", "block_offset"):
            got, want = getattr(h, field), getattr(exp, field)
            if got != want:
                raise KvFrameError(field, f"expected {want!r}, got {got!r}")
        if tuple(h.shape) != exp.shape:
            raise KvFrameError("shape", f"expected {list(exp.shape)}, got {list(h.shape)}")

    def _check_sequence(self, h: KvHeader) -> None:
        if h.frame_index != self._next_index:
            raise KvFrameError("frame_index", f"expected {self._next_index}, got {h.frame_index}")
        if self._total_frames is None:
            if not 1 <= h.total_frames <= self.expected.nbytes:
                raise KvFrameError("total_frames", f"must be in [1, {self.expected.nbytes}], got {h.total_frames}")
            if h.first_token_id < 0:
                raise KvFrameError("first_token_id", f"must be >= 0, got {h.first_token_id}")
            self._total_frames, self._first_token_id = h.total_frames, h.first_token_id
        if h.total_frames != self._total_frames:
            raise KvFrameError("total_frames", f"expected {self._total_frames}, got {h.total_frames}")
        if h.first_token_id != self._first_token_id:
            raise KvFrameError("first_token_id", f"expected {self._first_token_id}, got {h.first_token_id}")
        if h.last != (h.frame_index == self._total_frames - 1):
            raise KvFrameError("last", f"is {h.last} on frame {h.frame_index} of {self._total_frames}")

    def _check_range(self, h: KvHeader) -> int:
        num_layers, lb = self.expected.num_layers, self.expected.layer_nbytes
        if not 0 <= h.layer_start < num_layers:
            raise KvFrameError("layer_start", f"must be in [0, {num_layers}), got {h.layer_start}")
        if not h.layer_start < h.layer_end <= num_layers:
            raise KvFrameError("layer_end", f"must be in ({h.layer_start}, {num_layers}], got {h.layer_end}")
        range_bytes = (h.layer_end - h.layer_start) * lb
        if not 0 <= h.byte_offset < range_bytes:
            raise KvFrameError("byte_offset", f"must be in [0, {range_bytes}), got {h.byte_offset}")
        if not 0 < h.byte_length <= range_bytes - h.byte_offset:
            raise KvFrameError("byte_length", f"must be in [1, {range_bytes - h.byte_offset}], got {h.byte_length}")
        start = h.layer_start * lb + h.byte_offset
        if start != self._received:
            raise KvFrameError(
                "byte_offset",
                f"frame starts at payload byte {start}, expected {self._received} (gap or overlap)",
            )
        end = start + h.byte_length
        if h.last != (end == self.expected.nbytes):
            raise KvFrameError("last", f"is {h.last} but frame ends at byte {end} of {self.expected.nbytes}")
        return start

    @staticmethod
    def _check_data(h: KvHeader, data: bytes, start: int) -> None:
        if len(data) != h.byte_length:
            raise KvFrameError("byte_length", f"header says {h.byte_length}, data has {len(data)} bytes")
        crc = zlib.crc32(data)
        if crc != h.checksum:
            raise KvFrameError("checksum", f"crc32 mismatch at byte {start}: header {h.checksum}, data {crc}")
