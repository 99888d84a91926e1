"""KvTransferServicer.deliver (intake completed from an assembled tensor, as the "ray" backend does)
and the ray backend's header validation; no Ray instance is started here."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer import get_backend
from pdserve.kv_transfer.base import ExpectOptions, KvSpec, KvTransferError
from pdserve.kv_transfer.grpc_backend import KvTransferServicer


def _spec(request_id: str = "r1", dtype: str = "bfloat16") -> KvSpec:
    return KvSpec(request_id, "model-abc", dtype, (2, 2, 3, 16, 2, 8), 16, 40)


@pytest.fixture
def intake():  # noqa: ANN201
    servicer = KvTransferServicer()
    yield servicer
    servicer.close()


def test_deliver_completes_the_pending_intake(intake: KvTransferServicer) -> None:
    spec = _spec()
    kv = torch.randn(spec.shape).to(torch.bfloat16)
    pending = intake.expect(spec, ExpectOptions(5))
    intake.deliver(spec, lambda: kv, first_token_id=7)
    got, first = pending.wait(1)
    assert torch.equal(got, kv) and first == 7 and intake.num_pending() == 0


def test_deliver_refuses_unknown_and_twice(intake: KvTransferServicer) -> None:
    spec = _spec()
    with pytest.raises(KvTransferError, match="no pending"):
        intake.deliver(spec, torch.zeros(spec.shape, dtype=torch.bfloat16), 1)
    intake.expect(spec, ExpectOptions(5))
    intake.deliver(spec, torch.zeros(spec.shape, dtype=torch.bfloat16), 1)
    with pytest.raises(KvTransferError, match="no pending"):
        intake.deliver(spec, torch.zeros(spec.shape, dtype=torch.bfloat16), 1)


@pytest.mark.parametrize("change", ["model_fingerprint", "dtype", "num_tokens", "tensor_shape", "tensor_dtype"])
def test_deliver_mismatch_fails_that_intake_without_fetching(intake: KvTransferServicer, change: str) -> None:
    spec = _spec()
    pending = intake.expect(spec, ExpectOptions(5))
    other = intake.expect(_spec("r2"), ExpectOptions(5))
    header = {
        "model_fingerprint": KvSpec("r1", "model-xyz", "bfloat16", spec.shape, 16, 40),
        "dtype": KvSpec("r1", "model-abc", "float16", spec.shape, 16, 40),
        "num_tokens": KvSpec("r1", "model-abc", "bfloat16", spec.shape, 16, 41),
    }.get(change, spec)
    tensor = {
        "tensor_shape": torch.zeros((2, 2, 3, 16, 2, 4), dtype=torch.bfloat16),
        "tensor_dtype": torch.zeros(spec.shape, dtype=torch.float16),
    }.get(change, torch.zeros(spec.shape))
    fetched = []
    with pytest.raises(KvTransferError, match="does not match"):
        intake.deliver(header, lambda: fetched.append(1) or tensor, 3)
    assert fetched == ([] if change in ("model_fingerprint", "dtype", "num_tokens") else [1])
    assert pending.done() and "does not match" in pending.error()
    assert not other.done()  # other requests untouched


def test_deliver_fetch_failure_fails_the_intake(intake: KvTransferServicer) -> None:
    spec = _spec()
    pending = intake.expect(spec, ExpectOptions(5))

    def lost() -> torch.Tensor:
        raise KvTransferError("KV object lost (OwnerDiedError): owner died")

    with pytest.raises(KvTransferError, match="OwnerDiedError"):
        intake.deliver(spec, lost, 3)
    with pytest.raises(KvTransferError, match="OwnerDiedError"):
        pending.wait(1)


def test_ray_backend_is_registered() -> None:
    backend = get_backend("ray")
    assert backend.name == "ray"


def test_ray_header_round_trip_and_validation() -> None:
    from pdserve.kv_transfer.ray_backend import actor_name, header_for, spec_from_header

    spec = _spec()
    header = header_for(spec, 42)
    assert spec_from_header(header) == (spec, 42)
    assert actor_name("ray:decode-3") == "decode-3"
    with pytest.raises(ValueError):
        actor_name("127.0.0.1:5000")
    bad = [
        {**header, "total_bytes": spec.nbytes + 1},
        {**header, "shape": [2, 2, 3, 16, 2]},
        {**header, "num_tokens": 40.0},
        {**header, "dtype": "int8"},
        {**header, "first_token_id": -1},
        {**header, "extra": 1},
        {k: v for k, v in header.items() if k != "request_id"},
        "not a dict",
    ]
    for h in bad:
        with pytest.raises(ValueError):
            spec_from_header(h)


def test_ray_receiver_refuses_bad_input_without_ray(intake: KvTransferServicer) -> None:
    from pdserve.kv_transfer.ray_backend import RayKvReceiver, header_for

    receiver = RayKvReceiver(intake)
    assert not receiver.receive({"request_id": "x"}, [])["ok"]
    ack = receiver.receive(header_for(_spec(), 1), [b"not a ref"])
    assert not ack["ok"] and "ObjectRef" in ack["error"]


def test_what_a_receiver_cannot_honour_it_refuses(intake: KvTransferServicer) -> None:
    """ExpectOptions is the same for every receiver: Ray delivers whole tensors (no segment, no
    checksum), so it refuses an intake that asks for either instead of never completing it; a
    delivered tensor cannot satisfy an intake that requires a checksum."""
    from pdserve.kv_transfer.ray_backend import RayKvReceiver

    receiver = RayKvReceiver(intake)
    for options in (ExpectOptions(5, shm_segment_prefix="pdserve-kv-1-ab-"), ExpectOptions(5, require_checksum="xxh3")):
        with pytest.raises(ValueError, match="ray backend cannot honour"):
            receiver.expect(_spec(), options)
    assert intake.num_pending() == 0
    spec = _spec()
    pending = intake.expect(spec, ExpectOptions(5, require_checksum="crc32"))
    with pytest.raises(KvTransferError, match="no checksum"):
        intake.deliver(spec, torch.zeros(spec.shape, dtype=torch.bfloat16), 1)
    assert pending.done() and "no checksum" in pending.error()


@pytest.mark.parametrize(
    "options", [dict(deadline_s=0), dict(deadline_s=-1), dict(deadline_s=5, require_checksum="md5")]
)
def test_expect_options_are_checked(options: dict) -> None:
    with pytest.raises(ValueError):
        ExpectOptions(**options)
