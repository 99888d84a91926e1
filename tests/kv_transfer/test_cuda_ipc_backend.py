"""The "cuda_ipc" backend: its control frame, the receiver's checks and refusals, and its fallbacks to
the host path, over a real gRPC control channel on loopback.

On a machine without CUDA the driver's two IPC calls cannot run, so the tests of the device path
itself replace exactly those two (`export_tensor` and `import_tensor` of kv_transfer/cuda_ipc.py)
with `FakeDriver`: it hands out opaque handles for CPU tensors and maps them back, refusing a handle
it never issued as CUDA does. Everything else (frame, checks, mapping cache, in-place copy, ack) is
the production code. The tests marked `gpu` run the real driver between two processes and are
skipped without a CUDA device.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from unittest.mock import MagicMock

import grpc
import pytest
import torch
from kv_helpers import served

from pdserve.engine.kv_cache import KVCache, KVCacheShape, segment_prefix
from pdserve.kv_transfer import (
    ExpectOptions,
    KvSpec,
    KvTransferError,
    KvTransferServicer,
    cuda_ipc,
    cuda_ipc_backend,
)
from pdserve.kv_transfer.cuda_ipc_backend import CudaIpcKvSender
from pdserve.kv_transfer.routing import KvRoute, PeerFacts, choose_route
from pdserve.kv_transfer.shm_backend import InPlaceKv, header_for
from pdserve.v1 import kv_pb2_grpc
from pdserve.v1.kv_pb2 import KvFrame, KvHeader

OURS = segment_prefix()  # the prefill worker identity the intakes are bound to (this process)
SHAPE = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
GPU = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA IPC maps one process's device memory in another"
)


class RecordingServicer(KvTransferServicer):
    """The real receiver; keeps the frames it was sent, as they came off the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[KvFrame] = []

    def PushKv(self, request_iterator: Iterator[KvFrame], context: grpc.ServicerContext):  # noqa: ANN201, N802
        frames = list(request_iterator)
        self.frames += frames
        return super().PushKv(iter(frames), context)


@pytest.fixture
def receiver():  # noqa: ANN201
    with served(RecordingServicer()) as serving:
        yield serving


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no mapped pool, no exported pool, and logs every fallback again."""
    monkeypatch.setattr(cuda_ipc_backend, "_POOLS", type(cuda_ipc_backend._POOLS)())
    monkeypatch.setattr(cuda_ipc_backend, "_EXPORTS", {})
    monkeypatch.setattr(cuda_ipc_backend, "_LOGGED", set())


class FakeDriver:
    """Stands in for the CUDA driver's IPC export and import on a CPU: a handle is opaque bytes that
    only this driver issued; importing maps the same memory (the tensor itself)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, importable: bool = True) -> None:
        self.issued: dict[bytes, torch.Tensor] = {}
        self.imports = 0
        monkeypatch.setattr(cuda_ipc_backend, "export_tensor", self.export)
        if importable:
            monkeypatch.setattr(cuda_ipc_backend, "import_tensor", self.import_)

    def export(self, tensor: torch.Tensor) -> cuda_ipc.IpcDescriptor:
        handle = os.urandom(64)
        self.issued[handle] = tensor
        storage_bytes = tensor.untyped_storage().nbytes()
        return cuda_ipc.IpcDescriptor(
            0,
            str(tensor.dtype).removeprefix("torch."),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset(),
            storage_bytes,
            0,
            handle,
            b"/ref",
            0,
            bytes(64),
            True,
        )

    def import_(self, d: cuda_ipc.IpcDescriptor, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        self.imports += 1
        if d.memory_handle not in self.issued:
            raise RuntimeError("CUDA error: invalid resource handle")
        return self.issued[d.memory_handle]


def pool(seed: int, blocks: int = 8, shared: bool = False) -> KVCache:
    cache = KVCache(SHAPE, blocks, shared=shared)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def spec_for(request_id: str, num_tokens: int = 10) -> KvSpec:
    return KvSpec.for_cache(request_id, "fp", SHAPE, num_tokens)


def send_in_background(fn) -> Future:  # noqa: ANN001
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - handed to the test
            future.set_exception(err)

    threading.Thread(target=run, daemon=True).start()
    return future


def take_in_place(pending, dst: torch.Tensor, dst_ids: list[int]) -> int:  # noqa: ANN001
    kv, first = pending.wait(10)
    assert isinstance(kv, InPlaceKv)
    kv(dst, dst_ids)
    return first


# ----- the choice ----------------------------------------------------------------------------------
def test_auto_picks_cuda_ipc_only_for_cuda_caches_on_one_host(caplog: pytest.LogCaptureFixture) -> None:
    own, local, remote = "127.0.0.1:9000", PeerFacts("127.0.0.1:7000", OURS), PeerFacts("other-host:7000", OURS)
    with caplog.at_level(logging.WARNING, logger=cuda_ipc_backend.__name__):
        assert choose_route("auto", own, remote, device="cpu") == KvRoute("grpc")
        assert not caplog.records
        assert choose_route("auto", own, local, "xxh3", device="cpu") == KvRoute("shm", OURS, "xxh3")
        assert choose_route("auto", own, local, device="cpu").backend == "shm"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "CUDA IPC needs the KV cache on a CUDA device" in lines[0]
    assert "host memory" in lines[0]
    assert choose_route("grpc", own, local, device="cpu") == KvRoute("grpc")  # a named backend is kept
    assert choose_route("auto", own, PeerFacts("127.0.0.1:7000"), device="cuda:0") == KvRoute("grpc")  # no prefix
    if torch.cuda.is_available():
        route = choose_route("auto", own, local, "crc32", device="cuda:0")
        assert route == KvRoute("cuda_ipc", OURS, "crc32") and route.in_place
        assert route.expect_options(5).shm_segment_prefix == OURS  # the pool is bound to that prefill worker
    else:  # the rule is the device and CUDA's presence, not the name alone
        assert cuda_ipc_backend.ipc_unavailable_reason("cuda:0").startswith("CUDA IPC: CUDA is not available")
        assert choose_route("auto", own, local, device="cuda:0").backend == "shm"
    assert KvRoute("cuda_ipc", OURS).in_place


# ----- the frame -----------------------------------------------------------------------------------
def test_descriptor_survives_the_wire_as_a_frame_field() -> None:
    descriptor = cuda_ipc.IpcDescriptor(
        0, "float32", (3, 2, 8, 4, 2, 8), (1024, 512, 64, 16, 8, 1), 0, 4 * 3072, 0, b"h" * 64, b"/ref", 0, b"", False
    )
    header = header_for(spec_for("r"), 5, "", [6, 2, 3], 8)
    header.cuda_ipc_descriptor = cuda_ipc.pack(descriptor)
    again = KvHeader.FromString(header.SerializeToString())
    assert cuda_ipc.unpack(again.cuda_ipc_descriptor) == descriptor
    assert list(again.shm_block_ids) == [6, 2, 3] and again.shm_num_blocks == 8 and not again.shm_name


def test_blocks_go_in_place_from_the_mapped_pool_and_the_ack_waits(receiver, monkeypatch) -> None:  # noqa: ANN001
    servicer, address = receiver
    driver = FakeDriver(monkeypatch)
    source = pool(seed=1)
    spec = spec_for("r1")  # 10 tokens, block size 4: 3 blocks
    pending = servicer.expect(spec, ExpectOptions(30, in_place=True, shm_segment_prefix=OURS))
    sent = send_in_background(lambda: CudaIpcKvSender(address).send_blocks(spec, source, [6, 1, 2], 9, 30))
    dst = torch.zeros_like(source.kv)
    time.sleep(0.2)
    assert not sent.done()  # the prefill worker keeps its blocks until we copied them
    assert take_in_place(pending, dst, [0, 4, 5]) == 9
    ack = sent.result(10)
    assert ack.ok and ack.bytes_received == spec.nbytes
    assert torch.equal(dst[:, :, [0, 4, 5]], source.kv[:, :, [6, 1, 2]])
    frame = servicer.frames[-1].header
    assert not frame.shm_name and not servicer.frames[-1].data
    assert list(frame.shm_block_ids) == [6, 1, 2] and frame.shm_num_blocks == 8
    assert cuda_ipc.unpack(frame.cuda_ipc_descriptor).shape == tuple(source.kv.shape)
    # the pool is exported once and mapped once per prefill worker
    pending2 = servicer.expect(spec_for("r2"), ExpectOptions(30, in_place=True, shm_segment_prefix=OURS))
    sent2 = send_in_background(lambda: CudaIpcKvSender(address).send_blocks(spec_for("r2"), source, [3, 4, 5], 4, 30))
    take_in_place(pending2, dst, [1, 2, 3])
    assert sent2.result(10).ok and driver.imports == 1 and len(driver.issued) == 1
    assert servicer.frames[-1].header.cuda_ipc_descriptor == frame.cuda_ipc_descriptor


# ----- refusals ------------------------------------------------------------------------------------
def push(address: str, header: KvHeader):  # noqa: ANN201
    with grpc.insecure_channel(address) as channel:
        return kv_pb2_grpc.KvTransferStub(channel).PushKv(iter([KvFrame(header=header)]), timeout=10)


def ipc_header(spec: KvSpec, data: bytes, ids: list[int] | None = None, num_blocks: int = 8) -> KvHeader:
    header = header_for(spec, 1, "", ids or list(range(spec.shape[2])), num_blocks)
    header.cuda_ipc_descriptor = data
    return header


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (lambda good: b"NOTIPC" + good[6:], "bad magic"),
        (lambda good: good[:-3], "truncated"),
        (
            lambda good: cuda_ipc.pack(
                cuda_ipc.IpcDescriptor(
                    0,
                    "float32",
                    (3, 2, 8, 4, 2, 8),
                    (1024, 512, 64, 16, 8, 1),
                    0,
                    4 * 3072,
                    0,
                    os.urandom(64),
                    b"/ref",
                    0,
                    b"",
                    False,
                )
            ),
            "CUDA cannot open the handle",
        ),
        (
            lambda good: cuda_ipc.pack(
                cuda_ipc.IpcDescriptor(
                    0,
                    "bfloat16",
                    (3, 2, 8, 4, 2, 8),
                    (1024, 512, 64, 16, 8, 1),
                    0,
                    2 * 3072,
                    0,
                    os.urandom(64),
                    b"/ref",
                    0,
                    b"",
                    False,
                )
            ),
            "same --dtype",
        ),
        (
            lambda good: cuda_ipc.pack(
                cuda_ipc.IpcDescriptor(
                    0,
                    "float32",
                    (3, 2, 9, 4, 2, 8),
                    (1152, 576, 64, 16, 8, 1),
                    0,
                    4 * 3456,
                    0,
                    os.urandom(64),
                    b"/ref",
                    0,
                    b"",
                    False,
                )
            ),
            "pool shape",
        ),
    ],
)
def test_a_forged_handle_fails_that_intake_at_once(receiver, monkeypatch, forge, message: str) -> None:  # noqa: ANN001
    servicer, address = receiver
    driver = FakeDriver(monkeypatch)
    good = cuda_ipc.pack(driver.export(pool(seed=2).kv))
    spec = spec_for("forged")
    pending = servicer.expect(spec, ExpectOptions(60, in_place=True, shm_segment_prefix=OURS))
    start = time.monotonic()
    ack = push(address, ipc_header(spec, forge(good)))
    assert not ack.ok and message in ack.error
    with pytest.raises(KvTransferError, match="invalid cuda_ipc KV"):
        pending.wait(5)
    assert time.monotonic() - start < 5  # refused now, not at the 60 s deadline
    assert servicer.num_pending() == 0


def test_a_stale_handle_is_refused_once_a_pool_is_mapped_for_that_prefill_worker(receiver, monkeypatch) -> None:  # noqa: ANN001
    servicer, address = receiver
    FakeDriver(monkeypatch)
    old, new = pool(seed=3), pool(seed=4)
    first = servicer.expect(spec_for("a"), ExpectOptions(30, in_place=True, shm_segment_prefix=OURS))
    sent = send_in_background(lambda: CudaIpcKvSender(address).send_blocks(spec_for("a"), old, [0, 1, 2], 1, 30))
    take_in_place(first, torch.zeros_like(old.kv), [0, 1, 2])
    assert sent.result(10).ok
    # another pool (a handle the driver can open) claims to be the same prefill worker's: refused
    second = servicer.expect(spec_for("b"), ExpectOptions(30, in_place=True, shm_segment_prefix=OURS))
    with pytest.raises(KvTransferError, match="stale or forged"):
        CudaIpcKvSender(address).send_blocks(spec_for("b"), new, [0, 1, 2], 1, 30)
    with pytest.raises(KvTransferError, match="stale or forged"):
        second.wait(5)
    # bound to another prefill worker (a new identity, e.g. after a restart), the new pool is mapped
    third = servicer.expect(spec_for("c"), ExpectOptions(30, in_place=True, shm_segment_prefix=OURS + "restarted-"))
    sent = send_in_background(lambda: CudaIpcKvSender(address).send_blocks(spec_for("c"), new, [5, 6, 7], 1, 30))
    dst = torch.zeros_like(new.kv)
    take_in_place(third, dst, [0, 1, 2])
    assert sent.result(10).ok and torch.equal(dst[:, :, :3], new.kv[:, :, 5:8])


def test_after_a_failed_prefill_the_mapping_is_dropped_and_a_new_pool_maps(receiver, monkeypatch) -> None:  # noqa: ANN001
    servicer, address = receiver
    driver = FakeDriver(monkeypatch)
    old, new = pool(seed=9), pool(seed=10)
    for request_id, source in (("before", old), ("after", new)):
        pending = servicer.expect(spec_for(request_id), ExpectOptions(30, in_place=True, shm_segment_prefix=OURS))
        sent = send_in_background(
            lambda s=source, r=request_id: CudaIpcKvSender(address).send_blocks(spec_for(r), s, [0, 1, 2], 1, 30)
        )
        dst = torch.zeros_like(source.kv)
        take_in_place(pending, dst, [0, 1, 2])
        assert sent.result(10).ok and torch.equal(dst[:, :, :3], source.kv[:, :, :3])
        cuda_ipc_backend.forget_pool(OURS)  # what the decode worker does when a prefill there failed
    assert driver.imports == 2 and not cuda_ipc_backend._POOLS


def test_a_failed_prefill_unmaps_that_workers_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode side's hook (decode_worker/kv_intake.py): a prefill worker that failed may have died
    or restarted, so its mapped pool is dropped with what we knew of it; another worker's stays."""
    from pdserve.decode_worker.kv_intake import KvIntake, PeerCallFailed
    from pdserve.failures import WorkerUnavailable

    other = OURS + "other-"
    cuda_ipc_backend._POOLS[OURS] = (b"ours", torch.zeros(1))
    cuda_ipc_backend._POOLS[other] = (b"other", torch.zeros(1))
    intake = KvIntake(None, None, None, None, None)  # type: ignore[arg-type] - only its peer memory is used
    intake._peers["127.0.0.1:7000"] = PeerFacts("127.0.0.1:7000", OURS)
    call = MagicMock(done=lambda: False)
    failure = intake._prefill_failure(
        PeerCallFailed(WorkerUnavailable, "UNAVAILABLE", "gone"),
        call,
        MagicMock(error=lambda: ""),
        "127.0.0.1:7000",
        False,
    )
    assert isinstance(failure, WorkerUnavailable)
    assert list(cuda_ipc_backend._POOLS) == [other] and not intake._peers


def test_an_intake_bound_to_no_prefill_worker_takes_no_device_kv(receiver, monkeypatch) -> None:  # noqa: ANN001
    servicer, address = receiver
    driver = FakeDriver(monkeypatch)
    spec = spec_for("unbound")
    pending = servicer.expect(spec, ExpectOptions(30, in_place=True))
    ack = push(address, ipc_header(spec, cuda_ipc.pack(driver.export(pool(seed=5).kv))))
    assert not ack.ok and "no prefill worker bound" in ack.error
    assert driver.imports == 0  # refused before anything was mapped
    with pytest.raises(KvTransferError):
        pending.wait(5)


def test_header_fields_are_checked_as_on_the_shm_path(receiver, monkeypatch) -> None:  # noqa: ANN001
    servicer, address = receiver
    driver = FakeDriver(monkeypatch)
    data = cuda_ipc.pack(driver.export(pool(seed=6).kv))
    spec = spec_for("fields")
    pending = servicer.expect(spec, ExpectOptions(30, in_place=True, shm_segment_prefix=OURS))
    header = ipc_header(spec, data, ids=[0, 1, 8])  # block 8 is past the 8-block pool
    ack = push(address, header)
    assert not ack.ok and "shm_block_ids" in ack.error and driver.imports == 0
    with pytest.raises(KvTransferError):
        pending.wait(5)
    other = servicer.expect(spec_for("fp"), ExpectOptions(30, in_place=True, shm_segment_prefix=OURS))
    header = ipc_header(spec_for("fp"), data)
    header.model_fingerprint = "other-weights"
    assert "model_fingerprint" in push(address, header).error
    with pytest.raises(KvTransferError):
        other.wait(5)


# ----- fallbacks to the host path ------------------------------------------------------------------
def test_a_prefill_worker_without_cuda_sends_over_shm_and_says_so(receiver, caplog) -> None:  # noqa: ANN001
    servicer, address = receiver
    source = pool(seed=7, shared=True)  # a CPU pool: nothing to export
    spec = spec_for("cpu-prefill")
    pending = servicer.expect(spec, ExpectOptions(30, in_place=True, shm_segment_prefix=OURS))
    with caplog.at_level(logging.WARNING, logger=cuda_ipc_backend.__name__):
        sent = send_in_background(lambda: CudaIpcKvSender(address).send_blocks(spec, source, [4, 5, 6], 2, 30))
        dst = torch.zeros_like(source.kv)
        take_in_place(pending, dst, [0, 1, 2])
        assert sent.result(10).ok
    assert torch.equal(dst[:, :, :3], source.kv[:, :, 4:7])
    assert servicer.frames[-1].header.shm_name.startswith(OURS)  # the host path: shared memory
    assert not servicer.frames[-1].header.cuda_ipc_descriptor
    assert any("cannot export its pool" in r.getMessage() and "host memory" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the receiver must lack CUDA for this fallback")
def test_a_decode_worker_that_cannot_map_the_pool_gets_it_over_shm(receiver, monkeypatch, caplog) -> None:  # noqa: ANN001
    servicer, address = receiver
    FakeDriver(monkeypatch, importable=False)  # the real import: no CUDA in this process
    source = pool(seed=8, shared=True)
    spec = spec_for("no-cuda-here")
    pending = servicer.expect(spec, ExpectOptions(30, in_place=True, shm_segment_prefix=OURS))
    with caplog.at_level(logging.WARNING, logger=cuda_ipc_backend.__name__):
        sent = send_in_background(lambda: CudaIpcKvSender(address).send_blocks(spec, source, [1, 2, 3], 3, 30))
        dst = torch.zeros_like(source.kv)
        assert take_in_place(pending, dst, [5, 6, 7]) == 3
        assert sent.result(10).ok
    assert torch.equal(dst[:, :, 5:8], source.kv[:, :, 1:4])
    first, second = servicer.frames[-2].header, servicer.frames[-1].header
    assert first.cuda_ipc_descriptor and second.shm_name.startswith(OURS)  # one try, then the host path
    assert any("cannot map this pool" in r.getMessage() for r in caplog.records)


# ----- on a GPU: the real driver between two processes ---------------------------------------------
CHILD = """
import sys, torch
from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.kv_transfer import KvSpec
from pdserve.kv_transfer.cuda_ipc_backend import CudaIpcKvSender
shape = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
cache = KVCache(shape, 8, device="cuda:0")
cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(int(sys.argv[2]))))
spec = KvSpec.for_cache(sys.argv[3], "fp", shape, 10)
try:
    ack = CudaIpcKvSender(sys.argv[1]).send_blocks(spec, cache, [6, 1, 2], 9, 60)
    print("ACK", ack.ok)
except Exception as err:
    print("REFUSED", err)
"""


def child(address: str, seed: int, request_id: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, address, str(seed), request_id],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@GPU
def test_gpu_blocks_move_device_to_device_between_processes(receiver) -> None:  # noqa: ANN001
    servicer, address = receiver
    shape = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
    spec = KvSpec.for_cache("gpu-1", "fp", shape, 10)
    pending = servicer.expect(spec, ExpectOptions(60, in_place=True, shm_segment_prefix="prefill-a-"))
    proc = child(address, 11, "gpu-1")
    dst = torch.zeros((3, 2, 8, 4, 2, 8), dtype=torch.bfloat16, device="cuda:0")
    assert take_in_place(pending, dst, [0, 4, 5]) == 9
    out, _ = proc.communicate(timeout=120)
    assert "ACK True" in out, out
    expected = torch.randn((3, 2, 8, 4, 2, 8), generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    assert torch.equal(dst[:, :, [0, 4, 5]].cpu(), expected[:, :, [6, 1, 2]])
    assert servicer.frames[-1].header.cuda_ipc_descriptor  # it went by IPC, not by the host path
    # a second pool claiming the same prefill worker's identity is refused at once
    stale = servicer.expect(
        KvSpec.for_cache("gpu-2", "fp", shape, 10), ExpectOptions(60, in_place=True, shm_segment_prefix="prefill-a-")
    )
    out, _ = child(address, 12, "gpu-2").communicate(timeout=120)
    assert "REFUSED" in out and "stale or forged" in out, out
    with pytest.raises(KvTransferError, match="stale or forged"):
        stale.wait(5)


@GPU
def test_gpu_a_handle_cuda_did_not_issue_is_refused() -> None:
    d = cuda_ipc.export_tensor(torch.zeros((3, 2, 8, 4, 2, 8), device="cuda:0"))
    forged = cuda_ipc.IpcDescriptor(**{**d.__dict__, "memory_handle": bytes(b ^ 0x5A for b in d.memory_handle)})
    with pytest.raises(ValueError, match="CUDA cannot open the handle"):
        cuda_ipc_backend.mapped_pool("prefill-b-", cuda_ipc.pack(forged), forged)
