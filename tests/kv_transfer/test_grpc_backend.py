"""gRPC backend over a real loopback server: bit-exact transfer, per-request failure isolation,
refusal of unknown ids, deadlines on stalled senders, cancellation and shutdown."""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch
from waiting import eventually

from pdserve.kv_transfer import get_backend
from pdserve.kv_transfer.base import SUPPORTED_DTYPES, ExpectOptions, KvSpec, KvTransferError
from pdserve.kv_transfer.framing import encode_frames
from pdserve.kv_transfer.grpc_backend import (
    GrpcKvSender,
    KvTransferServicer,
    close_senders,
    get_sender,
    grpc_message_options,
)
from pdserve.v1 import kv_pb2_grpc
from pdserve.v1.kv_pb2 import KvAck, KvFrame

MAX_FRAME = 256


def make_spec(request_id: str, dtype: str = "float32", layers: int = 4, num_tokens: int = 37) -> KvSpec:
    block_size = 16
    shape = (layers, 2, math.ceil(num_tokens / block_size), block_size, 2, 8)
    return KvSpec(request_id, "model-abc", dtype, shape, block_size, num_tokens)


def random_kv(spec: KvSpec, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape, generator=gen).to(SUPPORTED_DTYPES[spec.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    )


@pytest.fixture
def receiver() -> Iterator[tuple[KvTransferServicer, str]]:
    """A KvTransferServicer on a fresh loopback server; yields (servicer, address)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=grpc_message_options(MAX_FRAME))
    servicer = KvTransferServicer(max_total_bytes=1 << 24)
    servicer.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.close()
    server.stop(grace=None)


@pytest.fixture
def sender(receiver: tuple[KvTransferServicer, str]) -> Iterator[GrpcKvSender]:
    s = GrpcKvSender(receiver[1], max_frame_bytes=MAX_FRAME)
    yield s
    s.close()


def raw_push(address: str, frames: Iterator[KvFrame] | list[KvFrame], timeout: float = 10.0) -> KvAck:
    """Push arbitrary (possibly corrupt) frames without the sender's checks."""
    with grpc.insecure_channel(address, options=grpc_message_options(MAX_FRAME)) as channel:
        return kv_pb2_grpc.KvTransferStub(channel).PushKv(iter(frames), timeout=timeout)


@pytest.mark.parametrize("dtype", sorted(SUPPORTED_DTYPES))
def test_transfer_is_bit_exact(receiver: tuple[KvTransferServicer, str], sender: GrpcKvSender, dtype: str) -> None:
    servicer, _ = receiver
    spec = make_spec(f"ok-{dtype}", dtype)
    kv = random_kv(spec, seed=3)
    pending = servicer.expect(spec, ExpectOptions(10))
    ack = sender.send(spec, kv, first_token_id=42, timeout_s=10)
    assert ack.ok and ack.error == "" and ack.bytes_received == spec.nbytes
    out, first = pending.wait(timeout=5)
    assert same_bits(out, kv) and first == 42
    assert servicer.num_pending() == 0


def test_corrupt_frame_fails_only_its_request(receiver: tuple[KvTransferServicer, str], sender: GrpcKvSender) -> None:
    servicer, address = receiver
    bad_spec, good_spec = make_spec("bad"), make_spec("good", num_tokens=200)
    bad_pending = servicer.expect(bad_spec, ExpectOptions(10))
    good_pending = servicer.expect(good_spec, ExpectOptions(10))
    bad_frames = list(encode_frames(bad_spec, random_kv(bad_spec), 1, MAX_FRAME))
    bad_frames[3].data = bytes(b ^ 0xFF for b in bad_frames[3].data)
    good_kv = random_kv(good_spec, seed=9)
    with futures.ThreadPoolExecutor(2) as pool:
        good_future = pool.submit(sender.send, good_spec, good_kv, 5, 10.0)
        bad_ack = pool.submit(raw_push, address, bad_frames).result()
        assert good_future.result().ok
    assert not bad_ack.ok and "checksum" in bad_ack.error and bad_ack.bytes_received == 3 * MAX_FRAME
    with pytest.raises(KvTransferError, match="checksum"):
        bad_pending.wait(timeout=5)
    out, first = good_pending.wait(timeout=5)
    assert same_bits(out, good_kv) and first == 5
    assert servicer.num_pending() == 0


def test_wrong_spec_from_sender_is_refused(receiver: tuple[KvTransferServicer, str], sender: GrpcKvSender) -> None:
    servicer, _ = receiver
    pending = servicer.expect(make_spec("r", "float32"), ExpectOptions(10))
    other = make_spec("r", "bfloat16")
    with pytest.raises(KvTransferError, match="dtype"):
        sender.send(other, random_kv(other), 0, timeout_s=10)
    with pytest.raises(KvTransferError, match="invalid KV frame.*dtype"):
        pending.wait(timeout=5)


def test_unknown_request_id_is_refused(receiver: tuple[KvTransferServicer, str], sender: GrpcKvSender) -> None:
    spec = make_spec("nobody-expects-me")
    with pytest.raises(KvTransferError, match="unknown request_id"):
        sender.send(spec, random_kv(spec), 0, timeout_s=10)
    assert receiver[0].num_pending() == 0


def test_second_stream_for_same_request_is_refused(receiver: tuple[KvTransferServicer, str]) -> None:
    servicer, address = receiver
    spec = make_spec("dup")
    pending = servicer.expect(spec, ExpectOptions(10))
    frames = list(encode_frames(spec, random_kv(spec), 0, MAX_FRAME))
    release = threading.Event()

    def stalled() -> Iterator[KvFrame]:
        yield frames[0]
        release.wait(10)
        yield from frames[1:]

    with futures.ThreadPoolExecutor(1) as pool:
        first_push = pool.submit(raw_push, address, stalled())
        eventually(lambda: pending._claimed, 5.0, what="the first stream to be bound")  # noqa: SLF001
        dup_ack = raw_push(address, frames)
        release.set()
        assert first_push.result().ok
    assert not dup_ack.ok and "already being received" in dup_ack.error
    assert pending.wait(timeout=5)[0].shape == spec.shape


def test_stalled_sender_fails_waiter_within_deadline(receiver: tuple[KvTransferServicer, str]) -> None:
    servicer, address = receiver
    spec = make_spec("stall")
    pending = servicer.expect(spec, ExpectOptions(0.5))
    frames = list(encode_frames(spec, random_kv(spec), 0, MAX_FRAME))
    release = threading.Event()

    def stalled() -> Iterator[KvFrame]:
        yield frames[0]
        release.wait(10)

    start = time.monotonic()
    with futures.ThreadPoolExecutor(1) as pool:
        push = pool.submit(raw_push, address, stalled(), 30.0)
        with pytest.raises(KvTransferError, match="deadline"):
            pending.wait()
        assert time.monotonic() - start < 3.0
        with pytest.raises(grpc.RpcError) as info:  # the stalled RPC is cancelled server side
            push.result(timeout=5)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        release.set()
    assert servicer.num_pending() == 0


def test_deadline_without_any_sender(receiver: tuple[KvTransferServicer, str]) -> None:
    servicer, _ = receiver
    pending = servicer.expect(make_spec("never"), ExpectOptions(0.2))
    fired = threading.Event()
    pending.add_done_callback(lambda _p: fired.set())
    assert fired.wait(3.0) and pending.done()
    with pytest.raises(KvTransferError, match="deadline"):
        pending.wait(timeout=0)


def test_wait_timeout_does_not_fail_the_intake(receiver: tuple[KvTransferServicer, str], sender: GrpcKvSender) -> None:
    servicer, _ = receiver
    spec = make_spec("slow")
    pending = servicer.expect(spec, ExpectOptions(10))
    with pytest.raises(KvTransferError, match="not complete"):
        pending.wait(timeout=0.05)
    assert not pending.done()
    sender.send(spec, random_kv(spec), 0, timeout_s=10)
    assert pending.wait(timeout=5)[1] == 0


def test_cancel_pending_intake(receiver: tuple[KvTransferServicer, str], sender: GrpcKvSender) -> None:
    servicer, _ = receiver
    spec = make_spec("cancel-me")
    pending = servicer.expect(spec, ExpectOptions(10))
    assert pending.cancel("client went away")
    assert not pending.cancel()
    with pytest.raises(KvTransferError, match="cancelled: client went away"):
        pending.wait(timeout=1)
    with pytest.raises(KvTransferError, match="unknown request_id"):
        sender.send(spec, random_kv(spec), 0, timeout_s=10)
    assert servicer.expect(spec, ExpectOptions(10)) is not pending  # the id can be registered again


def test_expect_validation(receiver: tuple[KvTransferServicer, str]) -> None:
    servicer, _ = receiver
    spec = make_spec("twice")
    servicer.expect(spec, ExpectOptions(10))
    with pytest.raises(ValueError, match="already has a pending"):
        servicer.expect(spec, ExpectOptions(10))
    with pytest.raises(ValueError, match="deadline_s"):
        servicer.expect(make_spec("zero"), ExpectOptions(0))
    with pytest.raises(ValueError, match="exceeds limit"):
        servicer.expect(make_spec("huge", layers=4, num_tokens=200_000), ExpectOptions(10))


def test_close_fails_pending_intakes() -> None:
    servicer = KvTransferServicer()
    pending = servicer.expect(make_spec("x"), ExpectOptions(10))
    servicer.close()
    with pytest.raises(KvTransferError, match="closed"):
        pending.wait(timeout=1)
    with pytest.raises(KvTransferError, match="closed"):
        servicer.expect(make_spec("y"), ExpectOptions(10))


def test_unreachable_receiver_raises_promptly() -> None:
    spec = make_spec("lost")
    sender = GrpcKvSender(f"127.0.0.1:{free_port()}")
    start = time.monotonic()
    with pytest.raises(KvTransferError, match="failed"):
        sender.send(spec, random_kv(spec), 0, timeout_s=1.0)
    assert time.monotonic() - start < 5
    sender.close()


def test_registry_and_sender_cache(receiver: tuple[KvTransferServicer, str]) -> None:
    backend = get_backend("grpc")
    assert backend.sender_factory(receiver[1]) is get_sender(receiver[1])
    close_senders()
    with pytest.raises(ValueError, match=r"known backends: \['cuda_ipc', 'grpc'"):
        get_backend("rdma")


def free_port() -> int:
    """A local TCP port nobody listens on (reserved, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
