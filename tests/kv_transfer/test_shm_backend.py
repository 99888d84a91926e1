"""The same-host shared-memory backend over a real gRPC control channel."""

from __future__ import annotations

import os

import pytest
import torch

from engine.worker_runtime import make_server
from kv_transfer import KvSpec, KvTransferError, KvTransferServicer, get_backend, grpc_message_options
from kv_transfer.shm_backend import SEGMENT_PREFIX, ShmKvSender, header_for
from pdserve.v1 import kv_pb2_grpc
from pdserve.v1.kv_pb2 import KvFrame


@pytest.fixture
def receiver():  # noqa: ANN201
    servicer = KvTransferServicer()
    server = make_server(8, grpc_message_options())
    servicer.add_to_server(server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield servicer, address
    servicer.close()
    server.stop(0)


def _spec(request_id: str, dtype: torch.dtype = torch.float32) -> tuple[KvSpec, torch.Tensor]:
    shape = (3, 2, 2, 16, 2, 8)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    return (KvSpec(request_id=request_id, model_fingerprint="fp", dtype=name, shape=shape, block_size=16,
                   num_tokens=20), torch.randn(shape).to(dtype))


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX)} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_is_bit_exact_and_segments_are_unlinked_at_exit(receiver, dtype: torch.dtype) -> None:  # noqa: ANN001
    servicer, address = receiver
    before = _segments()
    spec, kv = _spec(f"r-{dtype}", dtype)
    pending = servicer.expect(spec, deadline_s=10)
    get_backend("shm").sender_factory(address).send(spec, kv, 11, timeout_s=10)
    got, first = pending.wait(5)
    assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8)) and first == 11
    from kv_transfer.shm_backend import _POOL

    _POOL.close()  # what runs at exit: no segment of ours survives it
    assert _segments() <= before


def test_mismatched_header_fails_only_that_intake(receiver) -> None:  # noqa: ANN001
    servicer, address = receiver
    spec, kv = _spec("bad")
    good_spec, good_kv = _spec("good")
    pending = servicer.expect(KvSpec(**{**spec.__dict__, "model_fingerprint": "other"}), deadline_s=10)
    good = servicer.expect(good_spec, deadline_s=10)
    with pytest.raises(KvTransferError, match="model_fingerprint"):
        ShmKvSender(address).send(spec, kv, 1, timeout_s=10)
    with pytest.raises(KvTransferError):
        pending.wait(1)
    ShmKvSender(address).send(good_spec, good_kv, 2, timeout_s=10)
    assert torch.equal(good.wait(5)[0], good_kv)


def test_foreign_segment_names_are_refused(receiver) -> None:  # noqa: ANN001
    servicer, address = receiver
    spec, _ = _spec("evil")
    pending = servicer.expect(spec, deadline_s=10)
    frame = KvFrame(header=header_for(spec, 1, "some-other-segment"))
    ack = kv_pb2_grpc.KvTransferStub(__import__("grpc").insecure_channel(address)).PushKv(iter([frame]), timeout=5)
    assert not ack.ok and "shm_name" in ack.error
    with pytest.raises(KvTransferError):
        pending.wait(1)
