"""pdserve on Ray (one local Ray instance for the module): worker pools as actors, KV through gRPC or
the object store, a killed decode actor, live scaling. Outputs are compared (greedy) with the engine
in this process."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

ray = pytest.importorskip("ray")

from waiting import eventually  # noqa: E402

from pdserve.cluster.deploy_config import DeploymentConfig  # noqa: E402
from pdserve.cluster.launch import ray_deployment  # noqa: E402
from pdserve.cluster.ray_cluster import RayCluster  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.kv_transfer.base import ExpectOptions, KvSpec  # noqa: E402
from pdserve.tokenization import encode_text  # noqa: E402
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402

from e2e_helpers import generate, init_local_ray, mixed_prompts, wait_idle, worker_info  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    init_local_ray(num_cpus=8)
    yield
    ray.shutdown()


def _expected(default_model, prompts: list[str], max_tokens: list[int]) -> list[list[int]]:  # noqa: ANN001
    engine = LLMEngine(default_model, EngineConfig(num_blocks=1024))
    ids = [encode_text(default_model.tokenizer, p) for p in prompts]
    out = engine.generate(ids, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])
    engine.pool.assert_all_free()
    return out


def _run_all(address: str, prompts: list[str], max_tokens: list[int], concurrency: int = 16) -> list[list[int]]:
    with ThreadPoolExecutor(concurrency) as pool:
        return [
            r.token_ids
            for r in pool.map(
                lambda pm: generate(address, pm[0], pm[1], ignore_eos=True), zip(prompts, max_tokens, strict=True)
            )
        ]


def _live(cluster: RayCluster) -> list[tuple[str, str]]:
    return [(w["role"], w["address"]) for w in cluster.workers()]


def _config(**overrides: object) -> DeploymentConfig:
    return ray_deployment(**{"port": 0, "threads_per_worker": 1, "drain_timeout_s": 30.0, **overrides})


@pytest.fixture(scope="module")
def workload(default_model) -> tuple[list[str], list[int], list[list[int]]]:  # noqa: ANN001
    prompts = mixed_prompts(12, seed=5)
    max_tokens = [2 + (i * 5) % 11 for i in range(len(prompts))]
    return prompts, max_tokens, _expected(default_model, prompts, max_tokens)


def test_1p1d_grpc_backend_matches_engine(workload) -> None:  # noqa: ANN001
    prompts, max_tokens, expected = workload
    with RayCluster(_config(kv_backend="grpc")) as cluster:
        assert _run_all(cluster.router_address, prompts, max_tokens) == expected
        assert all(i["ray_kv_transfers"] == 0 for i in cluster.worker_info())
        wait_idle(_live(cluster))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """One deployment with the ray KV backend; each test scales it to the shape it needs first."""
    with RayCluster(_config(kv_backend="ray")) as cluster:
        yield cluster


def test_1p1d_ray_backend_matches_engine(workload, ray_cluster: RayCluster) -> None:  # noqa: ANN001
    prompts, max_tokens, expected = workload
    ray_cluster.scale(1, 1)
    assert _run_all(ray_cluster.router_address, prompts, max_tokens) == expected
    decode = [i for i in ray_cluster.worker_info() if i["role"] == "decode"]
    assert decode[0]["ray_kv_transfers"] >= len(prompts)  # the KV came through the object store
    roles = _live(ray_cluster)
    infos = {role: worker_info(address, role) for role, address in roles}
    assert infos["decode"].prefill_tokens_computed == 0  # decode never ran a pass over a prompt
    wait_idle(roles)


def test_trace_through_ray_actors(default_model, ray_cluster: RayCluster) -> None:  # noqa: ANN001
    """A traced request in Ray mode: one prefill pass on the prefill actor over the whole prompt, the KV
    hand-off through the object store, then one decode step per further token, KV growing by one."""
    ray_cluster.scale(1, 1)
    prompt_ids = encode_text(default_model.tokenizer, "济南的冬")
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(ray_cluster.router_address))
    request = router_pb2.GenerateRequest(
        prompt="济南的冬", trace=True, params=common_pb2.SamplingParams(max_tokens=5, ignore_eos=True)
    )
    responses = list(stub.Generate(request, timeout=120))
    events = [e for r in responses for e in r.trace]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[:2] == ["route", "tokenize"] and list(events[1].tokenize.token_ids) == prompt_ids
    assert events[0].route.decision == "disaggregated" and events[0].route.prefill_worker
    (prefill,) = [e for e in events if e.HasField("prefill")]
    assert prefill.worker_id.startswith("prefill") and prefill.prefill.samples
    assert (prefill.prefill.num_tokens, prefill.prefill.kv_len_before, prefill.prefill.kv_len_after) == (
        len(prompt_ids),
        0,
        len(prompt_ids),
    )
    (handoff,) = [e.kv_transfer for e in events if e.HasField("kv_transfer")]
    assert handoff.backend == "ray" and handoff.bytes > 0
    steps = [e.decode for e in events if e.HasField("decode")]
    assert [s.kv_len for s in steps] == list(range(len(prompt_ids) + 1, len(prompt_ids) + 5))
    assert kinds.index("prefill") < kinds.index("kv_transfer") < kinds.index("decode")
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == [prefill.prefill.first_token_id] + [s.token_id for s in steps]
    wait_idle(_live(ray_cluster))


def test_2p1d_ray_backend_matches_engine(workload, ray_cluster: RayCluster) -> None:  # noqa: ANN001
    prompts, max_tokens, expected = workload
    ray_cluster.scale(2, 1)
    before = {
        w["address"]: worker_info(w["address"], "prefill").requests_finished
        for w in ray_cluster.workers()
        if w["role"] == "prefill"
    }
    assert _run_all(ray_cluster.router_address, prompts, max_tokens) == expected
    after = {a: worker_info(a, "prefill").requests_finished for a in before}
    assert len(before) == 2 and all(after[a] > before[a] for a in before)  # both prefill actors worked
    wait_idle(_live(ray_cluster))


def test_killed_decode_actor_requests_finish_elsewhere(default_model, ray_cluster: RayCluster) -> None:  # noqa: ANN001
    ray_cluster.scale(1, 2)
    prompts = mixed_prompts(10, seed=21)
    max_tokens = [30] * len(prompts)
    expected = _expected(default_model, prompts, max_tokens)
    victim = [i for i in ray_cluster.worker_info() if i["role"] == "decode"][0]
    with ThreadPoolExecutor(1) as bg:
        pending = bg.submit(_run_all, ray_cluster.router_address, prompts, max_tokens)
        deadline = time.monotonic() + 120
        while worker_info(victim["address"], "decode").running_requests < 2:  # mid-stream, holding requests
            assert time.monotonic() < deadline and not pending.done()
            time.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        assert pending.result(timeout=300) == expected
    deadline = time.monotonic() + 120  # Ray restarts the actor (new port); the controller re-registers it
    while True:
        moved = {w["name"]: w["address"] for w in ray_cluster.workers()}[victim["name"]]
        if moved != victim["address"]:
            break
        assert time.monotonic() < deadline, "restarted decode actor never re-registered"
        time.sleep(0.5)
    restarted = [i for i in ray_cluster.worker_info() if i["name"] == victim["name"]][0]
    assert restarted["pid"] != victim["pid"] and restarted["address"] == moved
    wait_idle(_live(ray_cluster))
    assert generate(ray_cluster.router_address, "Hello there", 4).token_ids


def test_scale_up_and_down_during_a_stream_loses_nothing(default_model, ray_cluster: RayCluster) -> None:  # noqa: ANN001
    ray_cluster.scale(1, 1)
    prompts = mixed_prompts(50, seed=33)
    max_tokens = [3 + i % 6 for i in range(len(prompts))]
    expected = _expected(default_model, prompts, max_tokens)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(indices: list[int]) -> None:
        for i in indices:
            try:
                results[i] = generate(ray_cluster.router_address, prompts[i], max_tokens[i], ignore_eos=True).token_ids
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(list(range(k, 50, 4)),)) for k in range(4)]
    for t in threads:
        t.start()
    up = ray_cluster.scale(2, 2)
    down = ray_cluster.scale(1, 1)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert sorted(up["added"]) == sorted(down["removed"]) and len(up["added"]) == 2
    assert [results[i] for i in range(50)] == expected
    assert sorted(w["role"] for w in ray_cluster.workers()) == ["decode", "prefill"]
    wait_idle(_live(ray_cluster))


def _object_lost(ref: ray.ObjectRef) -> bool:
    """Whether a get of ``ref`` now fails as lost (OwnerDiedError is an ObjectLostError); False while
    it still reads (the result is dropped at once) or does not answer within half a second."""
    from ray.exceptions import GetTimeoutError, ObjectLostError

    try:
        ray.get(ref, timeout=0.5)
    except ObjectLostError:
        return True
    except GetTimeoutError:
        return False
    return False


def test_object_lost_fails_the_intake() -> None:
    """The prefill side died after ray.put: the receiver's intake fails (no hang, no bad KV)."""
    from pdserve.kv_transfer.grpc_backend import KvTransferServicer
    from pdserve.kv_transfer.ray_backend import RayKvReceiver, header_for, payload_of

    @ray.remote(num_cpus=0)
    class Owner:
        def put(self, kv):  # noqa: ANN001, ANN202
            return [ray.put(payload_of(kv))]

    spec = KvSpec("lost-1", "model-abc", "float32", (2, 2, 1, 16, 2, 8), 16, 10)
    intake = KvTransferServicer()
    try:
        owner = Owner.remote()
        refs = ray.get(owner.put.remote(torch.zeros(spec.shape)))
        pending = intake.expect(spec, ExpectOptions(30))
        ray.kill(owner, no_restart=True)
        # The actor is known dead before its objects are: the raylet frees an owner's pinned objects
        # only when its subscription to the owner fails, and until then a same-node get still reads
        # the copy in the object store. Wait for the state the receiver must handle: a get that fails.
        eventually(lambda: _object_lost(refs[0]), 30.0, what="Ray to declare the dead owner's object lost")
        ack = RayKvReceiver(intake, get_timeout_s=10).receive(header_for(spec, 1), refs)
        assert not ack["ok"] and "lost" in ack["error"].lower(), ack
        assert pending.done() and pending.error()
    finally:
        intake.close()
