"""Same-host shared-memory KV backend ("shm"): one copy from the prefill worker's cache blocks
into the decode worker's cache blocks.

Sender (prefill worker): its KV cache lives in a shared-memory segment (`KVCache(shared=True)`), so
it copies nothing: it sends one control frame over the gRPC `PushKv` stream naming the segment
(`KvHeader.shm_name`), the segment's block count and the ids of the request's blocks in it. A
tensor that is not in shared memory (or a cache that could not be placed there) is first copied
into a reusable staging segment. Either way the sender's blocks stay untouched until the ack.
Receiver (decode worker, `KvTransferServicer`): checks every header field against its pending
intake and maps the segment (mappings are cached). For an intake registered `in_place` (the decode
worker's) it hands the consumer an `InPlaceKv`, which copies the blocks straight into the decode
cache's reserved blocks on the decode loop thread; the ack waits for that copy (or the consumer
giving up), so the sender frees its blocks only when the bytes are no longer read. Otherwise it
copies the blocks out into a new tensor and acks.
Segments are unlinked at exit; a killed worker's `pdserve-kv-<pid>-*` segments are removed by the
next worker that creates a cache on this host (`engine.kv_cache.remove_stale_segments`).

Only for workers on one host. Which segments a receiver opens: every segment of a process is named
`pdserve-kv-<pid>-<64 random bits>-...` (`engine.kv_cache.segment_prefix`), a prefill worker reports
that prefix in GetInfo, and the decode worker registers each intake with the prefix of the prefill
worker it called for that request (`ExpectOptions.shm_segment_prefix`). A control
frame naming any other segment (another worker's cache, a foreign segment) is refused before the
segment is opened, and so is any shm frame for an intake registered without a prefix. Sizes must
hold the expected K/V. Bytes in local memory cross no link, so by default no checksum is computed;
with `--kv-checksum [xxh3|crc32]` on the decode worker the sender adds a checksum of the blocks
(`shm_checksum`) and the receiver checks it over the bytes it copied (`blocks_checksum`). It catches
blocks that changed between the sender's checksum and the receiver's copy (a writer on the segment,
a bug); it is no signature: whoever can write the segment can also rewrite the blocks before.
"""

from __future__ import annotations

import atexit
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from multiprocessing import shared_memory

import grpc
import torch

from pdserve.engine.kv_cache import SHM_PREFIX, KVCache, segment_prefix
from pdserve.engine.kv_cache import unlink_segment as _unlink
from pdserve.engine.kv_cache import untrack_segment as _untrack
from pdserve.kv_transfer.base import (
    CHECKSUM_ALGORITHMS,
    KvSender,
    KvSpec,
    KvTransferError,
    SenderCache,
    dtype_name,
    register_backend,
)
from pdserve.transport import open_channel
from pdserve.v1 import kv_pb2_grpc
from pdserve.v1.kv_pb2 import KvAck, KvFrame, KvHeader

BACKEND_NAME = "shm"
SEGMENT_PREFIX = SHM_PREFIX
#: The receiver acks this long before the sender's deadline at the latest, so a sender never
#: frees blocks that are still being read.
ACK_MARGIN_S = 1.0


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
        name = f"{segment_prefix()}{uuid.uuid4().hex[:12]}"
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
        _unlink(segment)

    def close(self) -> None:
        with self._lock:
            for segment in list(self._all):
                self._drop(segment)
            self._idle.clear()


_POOL = SegmentPool()


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: object) -> None:
        self.value = zlib.crc32(data, self.value)  # type: ignore[arg-type]

    def intdigest(self) -> int:
        return self.value


def _hasher(algorithm: str) -> object:
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "xxh3":
        import xxhash

        return xxhash.xxh3_64()
    raise ValueError(f"checksum algorithm: {algorithm!r} is not one of {', '.join(CHECKSUM_ALGORITHMS)}")


def blocks_checksum(kv: torch.Tensor, block_ids: list[int], algorithm: str) -> int:
    """Checksum (`algorithm`) of blocks `block_ids` of a C-contiguous [L, 2, blocks, ...] tensor, read
    as kv[l, k|v, block] for each layer, then k before v, then block in the given order. Runs of
    consecutive ids are one contiguous range each, so this costs one pass over the bytes."""
    if not kv.is_contiguous():
        raise ValueError("blocks_checksum needs a contiguous tensor")
    hasher = _hasher(algorithm)
    for layer in range(kv.shape[0]):
        for side in range(2):
            i = 0
            while i < len(block_ids):
                run = 1
                while i + run < len(block_ids) and block_ids[i + run] == block_ids[i] + run:
                    run += 1
                chunk = kv[layer, side, block_ids[i] : block_ids[i] + run].to("cpu")  # a view on a CPU tensor
                hasher.update(chunk.reshape(-1).view(torch.uint8).numpy())  # type: ignore[attr-defined]
                i += run
    return int(hasher.intdigest())  # type: ignore[attr-defined]


def header_for(
    spec: KvSpec,
    first_token_id: int,
    shm_name: str,
    block_ids: list[int] | None = None,
    num_blocks: int | None = None,
    checksum: tuple[str, int] | None = None,
) -> KvHeader:
    """The control frame: the request's blocks are `block_ids` of the segment `shm_name`, which holds
    `num_blocks` blocks laid out as [L, 2, num_blocks, block_size, H, D] (default: exactly the
    spec's blocks, in order); `checksum`: (algorithm, their `blocks_checksum`), when asked for."""
    n = spec.shape[2]
    header = KvHeader(
        request_id=spec.request_id,
        model_fingerprint=spec.model_fingerprint,
        dtype=spec.dtype,
        shape=list(spec.shape),
        block_size=spec.block_size,
        num_tokens=spec.num_tokens,
        block_offset=spec.block_offset,
        layer_start=0,
        layer_end=spec.num_layers,
        byte_offset=0,
        byte_length=spec.nbytes,
        frame_index=0,
        total_frames=1,
        first_token_id=first_token_id,
        last=True,
        shm_name=shm_name,
        shm_block_ids=list(range(n)) if block_ids is None else block_ids,
        shm_num_blocks=n if num_blocks is None else num_blocks,
    )
    if checksum is not None:
        header.shm_checksum_algorithm, header.shm_checksum = checksum
    return header


class ShmKvSender(KvSender):
    def __init__(self, target_address: str) -> None:
        self.target_address = target_address
        self._channel = open_channel(target_address)
        self._stub = kv_pb2_grpc.KvTransferStub(self._channel)

    def send(self, spec: KvSpec, kv: torch.Tensor, first_token_id: int, timeout_s: float, checksum: str = "") -> KvAck:
        """Stage `kv` in a reusable segment (one copy), then hand it over (with a `checksum` of the
        blocks when an algorithm is named)."""
        if tuple(kv.shape) != spec.shape or dtype_name(kv.dtype) != spec.dtype:
            raise ValueError("shape/dtype: tensor does not match its spec")
        segment = _POOL.acquire(spec.nbytes)
        try:
            view = torch.frombuffer(segment.buf, dtype=torch.uint8, count=spec.nbytes)
            view.copy_(kv.contiguous().view(-1).view(torch.uint8))
            del view
            ids = list(range(spec.shape[2]))
            crc = (checksum, blocks_checksum(kv.contiguous(), ids, checksum)) if checksum else None
            return self.push(spec, header_for(spec, first_token_id, segment.name, checksum=crc), timeout_s)
        finally:
            _POOL.release(segment)  # reused only after the receiver acked (or gave up on) this transfer

    def send_blocks(
        self,
        spec: KvSpec,
        cache: KVCache,
        block_ids: list[int],
        first_token_id: int,
        timeout_s: float,
        checksum: str = "",
    ) -> KvAck:
        """Blocks of a cache in shared memory travel by name: no copy here, one on the receiver."""
        if cache.shm_name is None:
            return self.send(spec, cache.gather(block_ids), first_token_id, timeout_s, checksum)
        if len(block_ids) != spec.shape[2]:
            raise ValueError(f"block_ids: {len(block_ids)} blocks for a spec of {spec.shape[2]}")
        crc = (checksum, blocks_checksum(cache.kv, block_ids, checksum)) if checksum else None
        return self.push(
            spec, header_for(spec, first_token_id, cache.shm_name, block_ids, cache.num_blocks, crc), timeout_s
        )

    def push(self, spec: KvSpec, header: KvHeader, timeout_s: float, refuse: bool = True) -> KvAck:
        """Send one control frame (shm, or cuda_ipc's) and return the ack; a refusal raises
        KvTransferError unless `refuse` is False (the caller reads `ack.error` itself)."""
        try:
            ack: KvAck = self._stub.PushKv(iter([KvFrame(header=header)]), timeout=timeout_s)
        except grpc.RpcError as err:
            raise KvTransferError(
                f"shm PushKv {spec.request_id!r} to {self.target_address} failed: {err.code().name}: {err.details()}"
            ) from err
        if refuse and not ack.ok:
            raise KvTransferError(f"shm PushKv {spec.request_id!r} refused: {ack.error}")
        return ack

    def close(self) -> None:
        self._channel.close()


def check_header(header: KvHeader, spec: KvSpec, segment_prefix: str = "", require_checksum: str = "") -> str:
    """ "" when the control frame matches the expected intake, else the first mismatch. The segment
    must start with `segment_prefix`, that of the prefill worker called for this request (no prefix:
    no shared-memory KV is accepted); `require_checksum`: the frame must carry a `shm_checksum` of
    that algorithm."""
    return check_fields(header, spec) or check_segment(header, segment_prefix) or check_blocks(header, require_checksum)


def check_fields(header: KvHeader, spec: KvSpec) -> str:
    """ "" when a control frame's K/V fields match the expected intake, else the first mismatch (the
    dtype before the fingerprint, which covers it, so that the cause is named)."""
    checks = [
        ("request_id", header.request_id, spec.request_id),
        ("dtype", header.dtype, spec.dtype),  # before the fingerprint (which covers it): names the cause
        ("model_fingerprint", header.model_fingerprint, spec.model_fingerprint),
        ("shape", tuple(header.shape), spec.shape),
        ("block_size", header.block_size, spec.block_size),
        ("num_tokens", header.num_tokens, spec.num_tokens),
        ("block_offset", header.block_offset, spec.block_offset),
        ("shm_block_ids", len(header.shm_block_ids), spec.shape[2]),
        ("byte_length", header.byte_length, spec.nbytes),
    ]
    for field, got, want in checks:
        if got != want:
            return f"{field}: got {got!r}, expected {want!r}"
    return ""


def check_segment(header: KvHeader, segment_prefix: str) -> str:
    """ "" when the frame names a segment of the prefill worker called for this request."""
    if not header.shm_name.startswith(SEGMENT_PREFIX) or "/" in header.shm_name:
        return f"shm_name: {header.shm_name!r} is not a pdserve KV segment"
    if not segment_prefix:
        return "shm_name: this intake accepts no shared-memory KV (no prefill worker's segments bound to it)"
    if not header.shm_name.startswith(segment_prefix):
        return (
            f"shm_name: segment {header.shm_name!r} does not belong to the prefill worker called for "
            f"request {header.request_id!r} (its segments start with {segment_prefix!r})"
        )
    return ""


def check_blocks(header: KvHeader, require_checksum: str) -> str:
    """ "" when the frame's checksum, first token and block ids are well formed."""
    if require_checksum and not header.HasField("shm_checksum"):
        return f"shm_checksum: missing, and this decode worker requires one (--kv-checksum {require_checksum})"
    if header.HasField("shm_checksum") and header.shm_checksum_algorithm not in CHECKSUM_ALGORITHMS:
        return f"shm_checksum_algorithm: {header.shm_checksum_algorithm!r} is not one of {CHECKSUM_ALGORITHMS}"
    if require_checksum and header.shm_checksum_algorithm != require_checksum:
        return (
            f"shm_checksum_algorithm: got {header.shm_checksum_algorithm!r}, this worker requires {require_checksum!r}"
        )
    if header.first_token_id < 0:
        return f"first_token_id: must be >= 0, got {header.first_token_id}"
    if not 0 < header.shm_num_blocks <= 2**24:
        return f"shm_num_blocks: must be in [1, 2**24], got {header.shm_num_blocks}"
    if any(not 0 <= b < header.shm_num_blocks for b in header.shm_block_ids):
        return f"shm_block_ids: every id must be in [0, {header.shm_num_blocks})"
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


def source_blocks(header: KvHeader, spec: KvSpec) -> tuple[torch.Tensor, list[int]]:
    """The sender's segment as [L, 2, shm_num_blocks, block_size, H, D] (a view) and the request's
    block ids in it; header checked with `check_header` first (raises OSError/ValueError)."""
    segment = _mapped(header.shm_name)
    block_bytes = spec.nbytes // spec.shape[2]
    needed = header.shm_num_blocks * block_bytes
    if segment.size < needed:
        raise ValueError(f"shm segment holds {segment.size} bytes, {header.shm_num_blocks} blocks need {needed}")
    shape = (spec.shape[0], 2, header.shm_num_blocks, *spec.shape[3:])
    view = torch.frombuffer(segment.buf, dtype=torch.uint8, count=needed).view(spec.torch_dtype).view(shape)
    return view, list(header.shm_block_ids)


def locate_blocks(
    header: KvHeader,
    spec: KvSpec,
    segment_prefix: str = "",
    require_checksum: str = "",
) -> tuple[torch.Tensor, list[int]]:
    """`check_header`, then `source_blocks`; ValueError naming the problem."""
    error = check_header(header, spec, segment_prefix, require_checksum)
    if error:
        raise ValueError(error)
    try:
        return source_blocks(header, spec)
    except (OSError, ValueError) as err:
        raise ValueError(f"shm segment {header.shm_name!r}: {err}") from err


def read_segment(header: KvHeader, spec: KvSpec) -> torch.Tensor:
    """Copy the request's blocks out of the segment into a new tensor of the spec's shape (ValueError
    if the header carries a checksum that the copied bytes do not match)."""
    view, ids = source_blocks(header, spec)
    return read_blocks(view, ids, spec, expected_checksum(header))


def read_blocks(
    source: torch.Tensor, ids: list[int], spec: KvSpec, checksum: tuple[str, int] | None = None
) -> torch.Tensor:
    """Blocks `ids` of a [L, 2, blocks, ...] source as a new tensor of the spec's shape, on the
    source's device (ValueError if `checksum` does not match the copied bytes)."""
    out = torch.empty(spec.shape, dtype=spec.torch_dtype, device=source.device)
    copy_blocks(out, list(range(len(ids))), source, ids)
    if checksum is not None:
        check_checksum(out, list(range(len(ids))), checksum)
    return out


def expected_checksum(header: KvHeader) -> tuple[str, int] | None:
    """(algorithm, value) announced by a control frame, or None."""
    return (header.shm_checksum_algorithm, header.shm_checksum) if header.HasField("shm_checksum") else None


def check_checksum(kv: torch.Tensor, block_ids: list[int], expected: tuple[str, int]) -> None:
    """ValueError naming both values unless the copied blocks have the announced checksum."""
    algorithm, value = expected
    got = blocks_checksum(kv, block_ids, algorithm)
    if got != value:
        raise ValueError(
            f"shm_checksum: {algorithm} of the copied blocks is {got}, the sender announced {value} "
            "(the segment changed while it was read)"
        )


def copy_blocks(dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int]) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids] for [L, 2, blocks, ...] tensors, in one pass over the
    bytes: runs of consecutive ids on both sides are copied as one strided slice. Returns once the
    bytes are in place: a device copy is waited for, since the sender frees its blocks on the ack."""
    if len(dst_ids) != len(src_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    i = 0
    while i < len(src_ids):
        run = 1
        while i + run < len(src_ids) and src_ids[i + run] == src_ids[i] + run and dst_ids[i + run] == dst_ids[i] + run:
            run += 1
        dst[:, :, dst_ids[i] : dst_ids[i] + run].copy_(src[:, :, src_ids[i] : src_ids[i] + run])
        i += run
    for device in {dst.device, src.device}:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


class InPlaceKv:
    """Received K/V still in the sender's shared memory. The consumer calls it with (its cache
    tensor, the block ids to fill) to copy the blocks straight in, or `release()`s it; the receiver
    acks only after either (`wait_consumed`), and never lets a copy start after it gave up."""

    def __init__(
        self, source: torch.Tensor, block_ids: list[int], nbytes: int, expected_checksum: tuple[str, int] | None = None
    ) -> None:
        self._source, self._block_ids, self.nbytes = source, block_ids, nbytes
        self._expected_checksum = expected_checksum  # checked over the destination blocks after the copy
        self._state = "pending"  # -> copying -> copied | failed;  pending -> released
        self._cond = threading.Condition()
        self.error = ""  # why the copy failed, for the sender's ack

    def __call__(self, kv: torch.Tensor, block_ids: list[int]) -> None:
        with self._cond:
            if self._state != "pending":
                raise KvTransferError(f"shared-memory KV no longer readable ({self._state})")
            self._state = "copying"
        copied = False
        try:
            copy_blocks(kv, block_ids, self._source, self._block_ids)
            if self._expected_checksum is not None:
                check_checksum(kv, block_ids, self._expected_checksum)
            copied = True
        except ValueError as err:
            self.error = str(err)
            raise KvTransferError(f"shared-memory KV refused: {err}") from err
        finally:
            with self._cond:
                self._state = "copied" if copied else "failed"
                self._cond.notify_all()

    def release(self) -> None:
        """The consumer will not copy (aborted, failed): let the sender go."""
        with self._cond:
            if self._state == "pending":
                self._state = "released"
                self._cond.notify_all()

    def wait_consumed(self, timeout_s: float) -> bool:
        """Receiver side: True once copied. After `timeout_s` (or a release) no copy can start any
        more; a copy under way is waited for."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            self._cond.wait_for(
                lambda: self._state not in ("pending", "copying"), max(0.0, deadline - time.monotonic())
            )
            if self._state == "pending":
                self._state = "released"
            self._cond.wait_for(lambda: self._state != "copying")
            return self._state == "copied"


_SENDERS: SenderCache[ShmKvSender] = SenderCache(ShmKvSender)  # one control channel per decode worker


def get_sender(target_address: str) -> ShmKvSender:
    """The process-wide sender (and control channel) for `target_address`."""
    return _SENDERS.get(target_address)


register_backend(BACKEND_NAME, get_sender)
