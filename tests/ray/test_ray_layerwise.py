"""Layer-wise KV streaming through the Ray object store (one local Ray instance for the module):
RayKvSender.send_layers into a real threaded actor holding a RayKvReceiver (parts in any order,
a failing source, cancelled/expired intakes, malformed parts), and a RayCluster whose prefill
workers stream layer by layer, compared (greedy) with the engine in this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from waiting import eventually  # noqa: E402

from pdserve.cluster.launch import LaunchOptions, ray_deployment  # noqa: E402
from pdserve.cluster.ray_cluster import RayCluster  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.kv_transfer.base import ExpectOptions, KvSpec, KvTransferError  # noqa: E402
from pdserve.kv_transfer.ray_backend import (  # noqa: E402
    MIN_PART_BYTES,
    NAMESPACE,
    RayKvSender,
    header_for,
    part_for,
    part_range,
    payload_of,
    plan_parts,
)
from pdserve.prefill_worker.layer_stream import LayerStream  # noqa: E402
from pdserve.tokenization import encode_text  # noqa: E402

from e2e_helpers import generate, init_local_ray, wait_idle  # noqa: E402

pytestmark = pytest.mark.ray

HOST_NAME = "kv-layerwise-host"
TARGET = f"ray:{HOST_NAME}"


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    init_local_ray(num_cpus=6)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def host() -> Iterator[Any]:
    """A threaded actor holding what a decode actor holds for the "ray" backend: the intake registry and
    a RayKvReceiver, with ``receive_kv_part`` as the actor method. (Defined here so Ray ships it by value.)"""

    class ReceiverHost:
        def __init__(self) -> None:
            from pdserve.kv_transfer.grpc_backend import KvTransferServicer
            from pdserve.kv_transfer.ray_backend import RayKvReceiver

            self.receiver = RayKvReceiver(KvTransferServicer(), get_timeout_s=10)
            self.pending: dict[str, Any] = {}

        def expect(self, spec: KvSpec, deadline_s: float = 30.0) -> None:
            self.pending[spec.request_id] = self.receiver.expect(spec, ExpectOptions(deadline_s))

        def receive_kv_part(self, header: dict, part: dict, refs: list) -> dict:
            return self.receiver.receive_part(header, part, refs)

        def outcome(self, request_id: str, timeout: float = 10.0) -> tuple[str, Any]:
            """("ok", kv tensor, first token) or ("error", message)."""
            try:
                kv, first = self.pending.pop(request_id).wait(timeout)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                return "error", str(exc)
            return "ok", (kv.clone(), first)

        def cancel(self, request_id: str, reason: str) -> bool:
            return self.pending[request_id].cancel(reason)

        def state(self) -> dict[str, Any]:
            r = self.receiver
            return {
                "partial": r.partial_layers(),
                "pending": r.intake.num_pending(),
                "parts": r.parts_received,
                "transfers": r.transfers_received,
            }

    handle = (
        ray.remote(ReceiverHost).options(name=HOST_NAME, namespace=NAMESPACE, num_cpus=0, max_concurrency=16).remote()
    )
    ray.get(handle.state.remote(), timeout=120)  # started
    yield handle
    ray.kill(handle)


def _spec(request_id: str, layers: int = 6, dtype: str = "bfloat16") -> KvSpec:
    """70 tokens in blocks of 16 = 5 blocks, the first 2 held by the receiver: 3 blocks shipped."""
    return KvSpec(request_id, "model-abc", dtype, (layers, 2, 3, 16, 4, 32), 16, 70, block_offset=2)


def _source_kv(spec: KvSpec, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape, generator=generator).to(spec.torch_dtype)


def _fill(stream: LayerStream, kv: torch.Tensor, layers: range, delay_s: float = 0.01) -> None:
    """What the prefill loop does: copy each finished layer into the stream's buffer, then announce it."""
    for layer in layers:
        time.sleep(delay_s)
        stream.buffer[layer] = kv[layer]
        stream.layer_done(layer)


def _in_thread(fn: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _state(host: Any) -> dict[str, Any]:  # noqa: ANN401 - a Ray ActorHandle
    return ray.get(host.state.remote(), timeout=30)


def _outcome(host: Any, request_id: str) -> tuple[str, Any]:  # noqa: ANN401
    return ray.get(host.outcome.remote(request_id), timeout=30)


def _send_part(
    host: Any,
    spec: KvSpec,
    kv: torch.Tensor,
    start: int,
    end: int,  # noqa: ANN401
    header: dict[str, Any] | None = None,
    part: dict[str, Any] | None = None,
    payload: Any = None,
) -> Any:  # noqa: ANN401 - an ObjectRef of the ack
    """Submit one part by hand (what send_layers submits), optionally with a tampered header/part/payload."""
    array = payload_of(kv[start:end]) if payload is None else payload
    return host.receive_kv_part.remote(
        header or header_for(spec, 0), part or part_for(spec, start, end), [ray.put(array)]
    )


def test_plan_parts_groups_whole_layers_up_to_the_minimum() -> None:
    spec = _spec("plan", layers=7)
    assert plan_parts(spec, 1) == [(i, i + 1) for i in range(7)]
    assert plan_parts(spec, 2 * spec.layer_nbytes + 1) == [(0, 3), (3, 6), (6, 7)]
    assert plan_parts(spec, 10**12) == [(0, 7)]
    assert spec.nbytes < MIN_PART_BYTES and plan_parts(spec) == [(0, 7)]  # small: one part by default
    big = KvSpec("plan-big", "model-abc", "float32", (4, 2, 64, 16, 8, 64), 16, 1024)
    assert big.layer_nbytes >= MIN_PART_BYTES and plan_parts(big) == [(i, i + 1) for i in range(4)]
    for start, end in plan_parts(spec, 3 * spec.layer_nbytes):
        assert part_range(part_for(spec, start, end), spec) == (start, end)


@pytest.mark.parametrize("min_part_bytes", [1, 2 * 24576 + 1, MIN_PART_BYTES], ids=["layer", "3-layers", "default"])
def test_send_layers_round_trip_while_layers_land(host: Any, min_part_bytes: int) -> None:  # noqa: ANN401
    spec = _spec(f"round-trip-{min_part_bytes}")
    assert spec.layer_nbytes == 24576
    kv = _source_kv(spec, seed=min_part_bytes % 1000)
    ray.get(host.expect.remote(spec), timeout=30)
    before = _state(host)
    stream = LayerStream(torch.empty(spec.shape, dtype=spec.torch_dtype), timeout_s=30)
    filler = _in_thread(lambda: _fill(stream, kv, range(spec.num_layers)))
    ack = RayKvSender(TARGET, min_part_bytes=min_part_bytes).send_layers(spec, stream, timeout_s=30)
    filler.join()
    assert ack.ok and ack.bytes_received == spec.nbytes
    status, (got, first) = _outcome(host, spec.request_id)
    assert status == "ok" and first == 0
    assert got.dtype == spec.torch_dtype and torch.equal(got, kv)
    after = _state(host)
    assert after["parts"] - before["parts"] == len(plan_parts(spec, min_part_bytes))
    assert after["transfers"] - before["transfers"] == 1
    assert after["partial"] == {} and after["pending"] == 0


def test_parts_travel_before_the_last_layer_is_ready(host: Any) -> None:  # noqa: ANN401
    spec = _spec("overlap")
    kv = _source_kv(spec, seed=7)
    ray.get(host.expect.remote(spec), timeout=30)
    stream = LayerStream(torch.empty(spec.shape, dtype=spec.torch_dtype), timeout_s=30)
    sender = RayKvSender(TARGET, min_part_bytes=1)
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(sender.send_layers, spec, stream, 30)
        _fill(stream, kv, range(3), delay_s=0)
        # the receiver copies the first three layers while the other three are not computed yet
        eventually(
            lambda: _state(host)["partial"].get(spec.request_id) == 3, 20.0, what="the first three layers to arrive"
        )
        assert not sending.done()
        _fill(stream, kv, range(3, spec.num_layers), delay_s=0)
        assert sending.result(timeout=30).ok
    status, (got, _) = _outcome(host, spec.request_id)
    assert status == "ok" and torch.equal(got, kv)


def test_parts_out_of_order_and_concurrent_assemble_exactly(host: Any) -> None:  # noqa: ANN401
    spec = _spec("reverse", dtype="float32")
    kv = _source_kv(spec, seed=3)
    ray.get(host.expect.remote(spec), timeout=30)
    ranges = [(4, 6), (0, 1), (2, 4), (1, 2)]  # all submitted before any answer: the actor runs them concurrently
    acks = ray.get([_send_part(host, spec, kv, s, e) for s, e in ranges], timeout=30)
    assert all(a["ok"] for a in acks), acks
    assert sum(a["bytes_received"] for a in acks) == spec.nbytes
    status, (got, _) = _outcome(host, spec.request_id)
    assert status == "ok" and torch.equal(got, kv)
    late = ray.get(_send_part(host, spec, kv, 0, 1), timeout=30)  # the intake completed: nothing takes it
    assert not late["ok"] and "no pending" in late["error"]


def test_unknown_request_is_refused(host: Any) -> None:  # noqa: ANN401
    spec = _spec("never-expected")
    ack = ray.get(_send_part(host, spec, _source_kv(spec, 1), 0, 1), timeout=30)
    assert not ack["ok"] and "unknown request_id" in ack["error"]
    stream = LayerStream(_source_kv(spec, 1), timeout_s=5)
    stream.layer_done(spec.num_layers - 1)
    with pytest.raises(KvTransferError, match="unknown request_id"):
        RayKvSender(TARGET, min_part_bytes=1).send_layers(spec, stream, timeout_s=30)
    assert _state(host)["partial"] == {}


def test_source_failing_mid_stream_aborts_the_intake(host: Any) -> None:  # noqa: ANN401
    spec = _spec("source-fails")
    kv = _source_kv(spec, seed=11)
    ray.get(host.expect.remote(spec), timeout=30)
    stream = LayerStream(torch.empty(spec.shape, dtype=spec.torch_dtype), timeout_s=30)

    def prefill_that_fails() -> None:
        _fill(stream, kv, range(3))
        eventually(lambda: _state(host)["partial"].get(spec.request_id) == 3, 20.0, what="a partial assembly")
        stream.fail(RuntimeError("forward pass exploded at layer 3"))

    filler = _in_thread(prefill_that_fails)
    with pytest.raises(KvTransferError, match="forward pass exploded"):
        RayKvSender(TARGET, min_part_bytes=1).send_layers(spec, stream, timeout_s=30)
    filler.join()
    status, error = _outcome(host, spec.request_id)
    assert status == "error" and "aborted by the sender" in error and "forward pass exploded" in error
    state = _state(host)
    assert state["partial"] == {} and state["pending"] == 0


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_cancelled_or_expired_intake_drops_its_partial_buffer(host: Any, how: str) -> None:  # noqa: ANN401
    spec = _spec(f"dropped-{how}")
    kv = _source_kv(spec, seed=13)
    ray.get(host.expect.remote(spec, 30.0 if how == "cancel" else 2.0), timeout=30)
    stream = LayerStream(torch.empty(spec.shape, dtype=spec.torch_dtype), timeout_s=30)
    sender = RayKvSender(TARGET, min_part_bytes=1)
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(sender.send_layers, spec, stream, 30)
        _fill(stream, kv, range(2), delay_s=0)
        eventually(lambda: _state(host)["partial"].get(spec.request_id) == 2, 20.0, what="a partial assembly")
        if how == "cancel":  # what the decode worker does when its Prefill call failed or the client left
            assert ray.get(host.cancel.remote(spec.request_id, "client cancelled"), timeout=30)
        eventually(lambda: _state(host)["partial"] == {}, 20.0, what="the partial buffer to be dropped")
        _fill(stream, kv, range(2, spec.num_layers), delay_s=0)  # the rest arrives too late
        with pytest.raises(KvTransferError, match="refused"):
            sending.result(timeout=30)
    status, error = _outcome(host, spec.request_id)
    assert status == "error" and ("cancelled" if how == "cancel" else "deadline") in error
    state = _state(host)
    assert state["partial"] == {} and state["pending"] == 0


BAD_PARTS = {  # name -> (what the bad part changes, the field its error names)
    "payload_short": ("payload", "part_bytes"),
    "part_bytes": ("part", "part_bytes"),
    "layer_out_of_range": ("part", "layer_end"),
    "layer_start_negative": ("part", "layer_start"),
    "overlap": ("range", "overlap"),
    "first_token": ("header", "first_token_id"),
    "shape": ("header", "does not match"),
}


@pytest.mark.parametrize("bad", sorted(BAD_PARTS))
def test_malformed_part_fails_that_intake_only(host: Any, bad: str) -> None:  # noqa: ANN401
    spec, other = _spec(f"bad-{bad}"), _spec(f"good-beside-{bad}")
    kv, other_kv = _source_kv(spec, seed=17), _source_kv(other, seed=19)
    ray.get([host.expect.remote(spec), host.expect.remote(other)], timeout=30)
    stream = LayerStream(torch.empty(other.shape, dtype=other.torch_dtype), timeout_s=30)
    with ThreadPoolExecutor(1) as pool:  # a concurrent, healthy request
        sending = pool.submit(RayKvSender(TARGET, min_part_bytes=1).send_layers, other, stream, 30)
        _fill(stream, other_kv, range(2))
        assert ray.get(_send_part(host, spec, kv, 0, 2), timeout=30)["ok"]  # a good first part
        start, end = 2, 4
        tampered: dict[str, Any] = {}
        if bad == "payload_short":
            tampered["payload"] = payload_of(kv[start : end - 1])
        elif bad == "part_bytes":
            tampered["part"] = {**part_for(spec, start, end), "part_bytes": spec.layer_nbytes}
        elif bad == "layer_out_of_range":
            tampered["part"] = {**part_for(spec, start, end), "layer_end": spec.num_layers + 1}
        elif bad == "layer_start_negative":
            tampered["part"] = {**part_for(spec, start, end), "layer_start": -1}
        elif bad == "overlap":
            start, end = 1, 3
        elif bad == "first_token":
            tampered["header"] = header_for(spec, 5)
        elif bad == "shape":  # the header describes more layers than the intake reserved
            tampered["header"] = header_for(_spec(spec.request_id, layers=spec.num_layers + 1), 0)
        ack = ray.get(_send_part(host, spec, kv, start, end, **tampered), timeout=30)
        field = BAD_PARTS[bad][1]
        assert not ack["ok"] and field in ack["error"], ack
        after = ray.get(_send_part(host, spec, kv, 4, 6), timeout=30)  # later parts are refused
        assert not after["ok"]
        _fill(stream, other_kv, range(2, other.num_layers))
        assert sending.result(timeout=30).ok
    status, error = _outcome(host, spec.request_id)
    assert status == "error" and field in error
    status, (got, _) = _outcome(host, other.request_id)
    assert status == "ok" and torch.equal(got, other_kv)
    state = _state(host)
    assert state["partial"] == {} and state["pending"] == 0


# ----- end to end: prefill workers streaming layer by layer through the object store ----------------


def _expected(default_model, prompts: list[str], max_tokens: int) -> list[list[int]]:  # noqa: ANN001
    engine = LLMEngine(default_model, EngineConfig(num_blocks=1024))
    ids = [encode_text(default_model.tokenizer, p) for p in prompts]
    out = engine.generate(ids, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(prompts))
    engine.pool.assert_all_free()
    return out


def test_ray_cluster_layer_streaming_matches_engine(default_model) -> None:  # noqa: ANN001
    prompts = ["Hello", "The capital of France is", "Tell me a story about the river and the old mill. " * 12]
    expected = _expected(default_model, prompts, 5)
    config = ray_deployment(port=0, threads_per_worker=1, drain_timeout_s=30.0, kv_backend="ray")
    with RayCluster(config, options=LaunchOptions(prefill_args=("--kv-streaming", "layer"))) as cluster:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: generate(cluster.router_address, p, 5, ignore_eos=True), prompts))
        assert [r.token_ids for r in results] == expected
        decode = [i for i in cluster.worker_info() if i["role"] == "decode"][0]
        assert decode["ray_kv_transfers"] >= len(prompts)
        assert decode["ray_kv_parts"] > len(prompts)  # the long prompt's KV came in several parts
        wait_idle([(w["role"], w["address"]) for w in cluster.workers()])
