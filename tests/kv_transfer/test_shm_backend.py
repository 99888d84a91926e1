"""The same-host shared-memory backend over a real gRPC control channel."""

from __future__ import annotations

import os

import pytest
import torch
from kv_helpers import served

from pdserve.engine.kv_cache import segment_prefix
from pdserve.kv_transfer import (
    ExpectOptions,
    KvSpec,
    KvTransferError,
    KvTransferServicer,
    get_backend,
)
from pdserve.kv_transfer.shm_backend import SEGMENT_PREFIX, ShmKvSender, header_for
from pdserve.v1 import kv_pb2_grpc
from pdserve.v1.kv_pb2 import KvFrame

OURS = segment_prefix()  # the segments these tests ship from are this process's


@pytest.fixture
def receiver():  # noqa: ANN201
    with served(KvTransferServicer()) as serving:
        yield serving


def _spec(request_id: str, dtype: torch.dtype = torch.float32) -> tuple[KvSpec, torch.Tensor]:
    shape = (3, 2, 2, 16, 2, 8)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    return (
        KvSpec(request_id=request_id, model_fingerprint="fp", dtype=name, shape=shape, block_size=16, num_tokens=20),
        torch.randn(shape).to(dtype),
    )


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX)} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_is_bit_exact_and_segments_are_unlinked_at_exit(receiver, dtype: torch.dtype) -> None:  # noqa: ANN001
    servicer, address = receiver
    before = _segments()
    spec, kv = _spec(f"r-{dtype}", dtype)
    pending = servicer.expect(spec, ExpectOptions(10, shm_segment_prefix=OURS))
    get_backend("shm").sender_factory(address).send(spec, kv, 11, timeout_s=10)
    got, first = pending.wait(5)
    assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8)) and first == 11
    from pdserve.kv_transfer.shm_backend import _POOL

    _POOL.close()  # what runs at exit: no segment of ours survives it
    assert _segments() <= before


def test_mismatched_header_fails_only_that_intake(receiver) -> None:  # noqa: ANN001
    servicer, address = receiver
    spec, kv = _spec("bad")
    good_spec, good_kv = _spec("good")
    pending = servicer.expect(
        KvSpec(**{**spec.__dict__, "model_fingerprint": "other"}), ExpectOptions(10, shm_segment_prefix=OURS)
    )
    good = servicer.expect(good_spec, ExpectOptions(10, shm_segment_prefix=OURS))
    with pytest.raises(KvTransferError, match="model_fingerprint"):
        ShmKvSender(address).send(spec, kv, 1, timeout_s=10)
    with pytest.raises(KvTransferError):
        pending.wait(1)
    ShmKvSender(address).send(good_spec, good_kv, 2, timeout_s=10)
    assert torch.equal(good.wait(5)[0], good_kv)


def test_foreign_segment_names_are_refused(receiver) -> None:  # noqa: ANN001
    servicer, address = receiver
    spec, _ = _spec("evil")
    pending = servicer.expect(spec, ExpectOptions(10, shm_segment_prefix=OURS))
    frame = KvFrame(header=header_for(spec, 1, "some-other-segment"))
    ack = kv_pb2_grpc.KvTransferStub(__import__("grpc").insecure_channel(address)).PushKv(iter([frame]), timeout=5)
    assert not ack.ok and "shm_name" in ack.error
    with pytest.raises(KvTransferError):
        pending.wait(1)


def _cache(num_blocks: int = 12, shared: bool = True):  # noqa: ANN202
    from pdserve.engine.kv_cache import KVCache, KVCacheShape

    cache = KVCache(
        KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32),
        num_blocks,
        shared=shared,
    )
    cache.kv.copy_(torch.randn(cache.kv.shape))
    return cache


def _blocks_spec(request_id: str, n: int) -> KvSpec:
    return KvSpec(
        request_id=request_id,
        model_fingerprint="fp",
        dtype="float32",
        shape=(3, 2, n, 16, 2, 8),
        block_size=16,
        num_tokens=16 * n - 3,
    )


def test_shared_cache_blocks_are_copied_once_straight_into_the_consumer_blocks(receiver) -> None:  # noqa: ANN001
    import threading

    servicer, address = receiver
    source = _cache()
    assert source.shm_name is not None and source.shm_name in _segments()
    src_ids = [7, 8, 2, 3, 4, 10]  # runs and gaps
    spec = _blocks_spec("in-place", len(src_ids))
    pending = servicer.expect(spec, ExpectOptions(10, in_place=True, shm_segment_prefix=OURS))
    acks: list = []
    sender = threading.Thread(
        target=lambda: acks.append(ShmKvSender(address).send_blocks(spec, source, src_ids, 9, timeout_s=10))
    )
    sender.start()
    kv, first = pending.wait(5)
    assert first == 9 and not isinstance(kv, torch.Tensor)
    sender.join(0.3)
    assert sender.is_alive() and not acks  # the ack waits until the consumer copied the blocks
    dest = torch.zeros(3, 2, 20, 16, 2, 8)
    dst_ids = [0, 1, 5, 6, 7, 19]
    kv(dest, dst_ids)
    sender.join(5)
    assert acks and acks[0].ok
    assert torch.equal(dest[:, :, dst_ids], source.kv[:, :, src_ids])
    untouched = [b for b in range(20) if b not in dst_ids]
    assert not dest[:, :, untouched].any()


def test_a_released_in_place_intake_fails_the_sender_and_cannot_copy_late(receiver) -> None:  # noqa: ANN001
    import threading

    servicer, address = receiver
    source = _cache()
    spec = _blocks_spec("released", 2)
    pending = servicer.expect(spec, ExpectOptions(10, in_place=True, shm_segment_prefix=OURS))
    errors: list[Exception] = []

    def send() -> None:
        try:
            ShmKvSender(address).send_blocks(spec, source, [0, 1], 1, timeout_s=10)
        except KvTransferError as exc:
            errors.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    kv, _ = pending.wait(5)
    kv.release()
    thread.join(5)
    assert errors and "did not take" in str(errors[0])
    with pytest.raises(KvTransferError, match="no longer readable"):
        kv(torch.zeros(3, 2, 4, 16, 2, 8), [0, 1])


def test_a_cache_in_private_memory_goes_through_a_staging_segment(receiver) -> None:  # noqa: ANN001
    servicer, address = receiver
    source = _cache(shared=False)
    assert source.shm_name is None
    spec = _blocks_spec("staged", 3)
    pending = servicer.expect(spec, ExpectOptions(10, shm_segment_prefix=OURS))  # not in place: a tensor
    ShmKvSender(address).send_blocks(spec, source, [5, 1, 9], 4, timeout_s=10)
    got, first = pending.wait(5)
    assert first == 4 and torch.equal(got, source.kv[:, :, [5, 1, 9]])


@pytest.mark.parametrize(
    ("field", "header_change"),
    [
        ("shm_block_ids", {"shm_block_ids": [0, 99]}),
        ("shm_block_ids", {"shm_block_ids": [0]}),
        ("shm_num_blocks", {"shm_num_blocks": 0}),
        ("blocks need", {"shm_num_blocks": 10_000, "shm_block_ids": [0, 1]}),
    ],
)
def test_block_ids_outside_the_segment_are_refused(receiver, field: str, header_change: dict) -> None:  # noqa: ANN001
    servicer, address = receiver
    source = _cache()
    spec = _blocks_spec(f"evil-{field}-{len(header_change)}", 2)
    pending = servicer.expect(spec, ExpectOptions(10, in_place=True, shm_segment_prefix=OURS))
    header = header_for(spec, 1, source.shm_name, [0, 1], source.num_blocks)
    for key, value in header_change.items():
        header.ClearField(key)
        if isinstance(value, list):
            getattr(header, key).extend(value)
        else:
            setattr(header, key, value)
    ack = kv_pb2_grpc.KvTransferStub(__import__("grpc").insecure_channel(address)).PushKv(
        iter([KvFrame(header=header)]), timeout=5
    )
    assert not ack.ok and field in ack.error
    with pytest.raises(KvTransferError):
        pending.wait(1)


def test_copy_blocks_matches_fancy_indexing() -> None:
    import random

    from pdserve.kv_transfer.shm_backend import copy_blocks

    rng = random.Random(3)
    src = torch.randn(2, 2, 30, 4, 1, 2)
    for _ in range(20):
        n = rng.randrange(1, 12)
        src_ids, dst_ids = rng.sample(range(30), n), rng.sample(range(25), n)
        src_ids[: n // 2] = sorted(src_ids[: n // 2])
        dst = torch.zeros(2, 2, 25, 4, 1, 2)
        copy_blocks(dst, dst_ids, src, src_ids)
        expected = torch.zeros_like(dst)
        expected[:, :, dst_ids] = src[:, :, src_ids]
        assert torch.equal(dst, expected)


def test_segments_of_dead_processes_are_removed() -> None:
    from multiprocessing import shared_memory

    from pdserve.engine.kv_cache import remove_stale_segments, untrack_segment

    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    names = [f"{SEGMENT_PREFIX}cache-{dead_pid}-x", f"{SEGMENT_PREFIX}{dead_pid}-y", f"{SEGMENT_PREFIX}{os.getpid()}-z"]
    for name in names:
        untrack_segment(shared_memory.SharedMemory(name=name, create=True, size=4096))
    assert remove_stale_segments() >= 2
    left = _segments()
    assert names[0] not in left and names[1] not in left and names[2] in left
    os.unlink(f"/dev/shm/{names[2]}")


def _push(address: str, header) -> object:  # noqa: ANN001
    import grpc

    return kv_pb2_grpc.KvTransferStub(grpc.insecure_channel(address)).PushKv(iter([KvFrame(header=header)]), timeout=5)


def test_segment_prefixes_are_per_process_and_unguessable() -> None:
    import subprocess
    import sys

    ours = segment_prefix()
    assert ours.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-") and len(ours.split("-")[-2]) == 16
    code = "from engine.kv_cache import segment_prefix; print(segment_prefix())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other != ours and other.startswith(SEGMENT_PREFIX)
    assert _cache().shm_name.startswith(ours)


@pytest.mark.parametrize("in_place", [True, False])
def test_another_workers_segment_is_refused_before_it_is_opened(receiver, in_place: bool) -> None:  # noqa: ANN001
    """A control frame naming a real pdserve cache segment of another process (the prefill worker this
    request was not sent to) is refused: the intake is bound to the called worker's prefix."""
    servicer, address = receiver
    victim = _cache()  # stands for another worker's cache: a real segment with the right geometry
    spec = _blocks_spec(f"forged-{in_place}", 2)
    called = f"{SEGMENT_PREFIX}{os.getpid()}-{'0' * 16}-"  # the prefill worker the decode worker called
    pending = servicer.expect(spec, ExpectOptions(10, in_place=in_place, shm_segment_prefix=called))
    ack = _push(address, header_for(spec, 1, victim.shm_name, [0, 1], victim.num_blocks))
    assert not ack.ok and "does not belong to the prefill worker called" in ack.error
    with pytest.raises(KvTransferError, match="does not belong"):
        pending.wait(1)
    from pdserve.kv_transfer.shm_backend import _MAPPED

    assert victim.shm_name not in _MAPPED  # refused before the segment was opened


def test_an_intake_bound_to_no_prefill_worker_takes_no_shared_memory_kv(receiver) -> None:  # noqa: ANN001
    servicer, address = receiver
    source = _cache()
    spec = _blocks_spec("unbound", 2)
    pending = servicer.expect(spec, ExpectOptions(10, in_place=True))
    ack = _push(address, header_for(spec, 1, source.shm_name, [0, 1], source.num_blocks))
    assert not ack.ok and "accepts no shared-memory KV" in ack.error
    with pytest.raises(KvTransferError):
        pending.wait(1)


def _send_in_place(servicer, address: str, spec: KvSpec, header) -> tuple[object, torch.Tensor, list]:  # noqa: ANN001
    """Push `header` while a consumer copies into a fresh destination; (ack, destination, errors)."""
    import threading

    algorithm = header.shm_checksum_algorithm or "xxh3"
    options = ExpectOptions(10, in_place=True, shm_segment_prefix=OURS, require_checksum=algorithm)
    pending = servicer.expect(spec, options)
    acks: list = []
    thread = threading.Thread(target=lambda: acks.append(_push(address, header)))
    thread.start()
    dest, errors = torch.zeros(3, 2, 8, 16, 2, 8), []
    try:
        kv, _ = pending.wait(5)
        kv(dest, [4, 5, 6][: spec.shape[2]])
    except KvTransferError as exc:
        errors.append(exc)
    thread.join(5)
    return acks[0], dest, errors


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32"])
def test_checksum_over_the_copied_blocks(receiver, algorithm: str) -> None:  # noqa: ANN001
    from pdserve.kv_transfer.shm_backend import blocks_checksum

    servicer, address = receiver
    source = _cache()
    spec = _blocks_spec(f"crc-ok-{algorithm}", 3)
    crc = (algorithm, blocks_checksum(source.kv, [7, 2, 3], algorithm))
    ack, dest, errors = _send_in_place(
        servicer, address, spec, header_for(spec, 1, source.shm_name, [7, 2, 3], source.num_blocks, crc)
    )
    assert ack.ok and not errors and torch.equal(dest[:, :, [4, 5, 6]], source.kv[:, :, [7, 2, 3]])
    assert blocks_checksum(dest, [4, 5, 6], algorithm) == crc[1]
    whole = source.kv[:, :, [7, 2, 3]].contiguous()  # the order is kv[l, k|v, block]: one pass over a gather
    assert blocks_checksum(whole, [0, 1, 2], algorithm) == crc[1]


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32"])
def test_blocks_that_do_not_match_their_checksum_are_refused(receiver, algorithm: str) -> None:  # noqa: ANN001
    """Bytes changed after the sender's checksum (a writer on the segment): the copy is refused."""
    from pdserve.kv_transfer.shm_backend import blocks_checksum

    servicer, address = receiver
    source = _cache()
    spec = _blocks_spec(f"crc-bad-{algorithm}", 2)
    crc = (algorithm, blocks_checksum(source.kv, [0, 1], algorithm))
    source.kv[2, 1, 1, 3, 0, 0] += 1.0  # one value of the last layer's V changes in shared memory
    ack, _, errors = _send_in_place(
        servicer, address, spec, header_for(spec, 1, source.shm_name, [0, 1], source.num_blocks, crc)
    )
    assert errors and "shm_checksum" in str(errors[0])
    assert not ack.ok and "shm_checksum" in ack.error


def test_a_frame_without_the_required_checksum_is_refused(receiver) -> None:  # noqa: ANN001
    servicer, address = receiver
    source = _cache()
    spec = _blocks_spec("crc-missing", 2)
    pending = servicer.expect(spec, ExpectOptions(10, in_place=True, shm_segment_prefix=OURS, require_checksum="xxh3"))
    ack = _push(address, header_for(spec, 1, source.shm_name, [0, 1], source.num_blocks))
    assert not ack.ok and "shm_checksum: missing" in ack.error
    with pytest.raises(KvTransferError):
        pending.wait(1)


def test_the_sender_adds_a_checksum_when_asked_and_a_staged_copy_is_checked(receiver) -> None:  # noqa: ANN001
    servicer, address = receiver
    source = _cache(shared=False)  # through a staging segment: read_segment checks the crc
    spec = _blocks_spec("crc-staged", 3)
    pending = servicer.expect(spec, ExpectOptions(10, shm_segment_prefix=OURS, require_checksum="crc32"))
    ShmKvSender(address).send_blocks(spec, source, [5, 1, 9], 4, timeout_s=10, checksum="crc32")
    got, _ = pending.wait(5)
    assert torch.equal(got, source.kv[:, :, [5, 1, 9]])
