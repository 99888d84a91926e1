"""pdserve on a multi-node Ray cluster on one machine (``ray.cluster_utils.Cluster``: a head and two
worker nodes, each with its own raylet and object store, told apart by their node ids and a custom
resource). A tiny random-weight Llama keeps it fast; outputs are compared (greedy) with the engine
in this process.

- `pdserve serve --ray --address ADDR` (a real subprocess) joins the cluster without starting a local
  Ray, places router, prefill and decode on three different nodes (STRICT_SPREAD), moves KV across
  nodes over gRPC, and `pdserve status --address ADDR --json` finds the router and gives each
  worker's node; a bad address fails fast with a clear error.
- An in-process deployment (SPREAD, KV through the object store) then: exact tokens across nodes;
  a node removed during 3 streams (they finish on the surviving nodes with the tokens served before
  the loss; the pool refills when a node returns); the router actor killed (Ray restarts it, it
  re-learns its workers from the controller, its new address is discoverable); scale up and down
  (the new worker sits in a placement group of its own, on the node that has room, removed with it).

The nodes share one host: this checks placement, node loss and cross-object-store KV, not network speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import psutil  # noqa: E402  (a Ray dependency)
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from pdserve.cluster.launch import ray_deployment  # noqa: E402
from pdserve.cluster.ray_cluster import NAMESPACE, ROUTER_NAME, RayCluster  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.model_loader import load_model  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.tokenization import encode_text  # noqa: E402

from e2e_helpers import (  # noqa: E402
    checkout_env,
    generate,
    mixed_prompts,
    multinode_ray,
    router_status,
    run_cli,
    wait_idle,
    worker_info,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STORE = 80 * 2**20  # object store bytes per node (Ray's minimum is about 75 MiB)


def _node_args(cpus: int, name: str, decode_slot: bool = True) -> dict[str, Any]:
    """A node's CPUs, its own resource `name` and (worker nodes) one `decode_slot` that decode workers need."""
    return {
        "num_cpus": cpus,
        "resources": {name: 1, **({"decode_slot": 1} if decode_slot else {})},
        "object_store_memory": STORE,
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Head (2 CPUs) + node-a (1 CPU, 1 decode_slot) + node-b (same): room for exactly a router and three
    workers, decode workers only on node-a and node-b."""
    with multinode_ray(
        _node_args(2, "node_head", decode_slot=False), [_node_args(1, "node_a"), _node_args(1, "node_b")], NAMESPACE
    ) as c:
        yield c


@pytest.fixture(scope="module")
def engine_model(tiny_llama_dir: Path):  # noqa: ANN201
    return load_model(tiny_llama_dir)


def _expected(model, prompts: list[str], max_tokens: list[int]) -> list[list[int]]:  # noqa: ANN001
    engine = LLMEngine(model, EngineConfig(num_blocks=512))
    ids = [encode_text(model.tokenizer, p) for p in prompts]
    return engine.generate(ids, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])


def _run_all(address: str, prompts: list[str], max_tokens: list[int]) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return [
            r.token_ids
            for r in pool.map(
                lambda pm: generate(address, pm[0], pm[1], ignore_eos=True), zip(prompts, max_tokens, strict=True)
            )
        ]


def _alive_nodes() -> dict[str, dict[str, Any]]:
    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}


def test_serve_with_unreachable_address_fails_fast() -> None:
    start = time.monotonic()
    out = run_cli("serve", "--ray", "--address", "127.0.0.1:1", "--port", "0", timeout=60)
    assert out.returncode == 1, out
    assert "error: ConnectionError: no Ray cluster at 127.0.0.1:1" in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - start < 45  # ray.init alone would retry for minutes
    bad = run_cli("status", "--address", "127.0.0.1:1", timeout=60)
    assert bad.returncode == 1 and "no Ray cluster at 127.0.0.1:1" in bad.stderr


def test_cli_joins_cluster_strict_spread_grpc_kv_across_nodes(
    cluster: Cluster,
    engine_model,  # noqa: ANN001
    tiny_llama_dir: Path,
) -> None:
    nodes_before = set(_alive_nodes())
    env = checkout_env()
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cluster.cli",
            "serve",
            "--ray",
            "--address",
            cluster.address,
            "--port",
            "0",
            "--model",
            str(tiny_llama_dir),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--placement",
            "strict_spread",
            "--router-resource",
            "node_head",
            "--worker-host",
            "node",
            "--kv-backend",
            "grpc",
            "--threads-per-worker",
            "1",
            "--kv-cache-mb",
            "32",
            "--startup-timeout",
            "240",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        router = ""
        deadline = time.monotonic() + 300
        while not router:
            line = serve.stdout.readline()  # type: ignore[union-attr]
            assert line or serve.poll() is None, serve.stderr.read()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            router = line.split("router: ", 1)[1].strip() if line.startswith("router: ") else ""
        # joined the cluster: no Ray of its own (no GCS / raylet under the serve process), no new node
        children = {p.name() for p in psutil.Process(serve.pid).children(recursive=True)}
        assert not {"gcs_server", "raylet"} & children, children
        assert set(_alive_nodes()) == nodes_before

        status = run_cli("status", "--address", cluster.address, "--json")
        assert status.returncode == 0, status.stderr[-2000:]
        doc = json.loads(status.stdout)
        assert doc["router_address"] == router
        workers = {w["role"]: w for w in doc["workers"]}
        assert set(workers) == {"prefill", "decode"} and all(w["healthy"] for w in workers.values())
        router_node = ray.get(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE).info.remote())["node_id"]
        assert router_node == cluster.head_node.node_id  # --router-resource node_head
        placed = {workers["prefill"]["node_id"], workers["decode"]["node_id"], router_node}
        assert len(placed) == 3 and placed <= nodes_before  # STRICT_SPREAD: one node each
        assert all(w["host"] for w in workers.values())

        prompts = mixed_prompts(6, seed=41)
        max_tokens = [4 + i for i in range(len(prompts))]
        assert _run_all(router, prompts, max_tokens) == _expected(engine_model, prompts, max_tokens)
        again = json.loads(run_cli("status", "--address", cluster.address, "--json").stdout)
        after = {w["role"]: w for w in again["workers"]}
        assert after["decode"]["healthy"] and after["prefill"]["node_id"] != after["decode"]["node_id"]
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    assert serve.returncode == 0
    deadline = time.monotonic() + 30
    while ROUTER_NAME in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}:
        assert time.monotonic() < deadline, "the router outlived `serve`"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def deployment(cluster: Cluster, tiny_llama_dir: Path) -> Iterator[RayCluster]:
    """1 prefill + 2 decode, SPREAD over the three nodes (4 bundles, 4 CPUs: the cluster is full; decode
    workers need a decode_slot, so router and prefill share the head), KV through the object store."""
    config = ray_deployment(
        prefill=1,
        decode=2,
        model=str(tiny_llama_dir),
        address=cluster.address,
        port=0,
        worker_host="node",
        kv_backend="ray",
        placement="spread",
        decode_resource="decode_slot",
        router_resource="node_head",
        threads_per_worker=1,
        kv_cache_mb=32,
        drain_timeout_s=20.0,
        poll_interval_s=0.5,
        startup_timeout_s=240.0,
    )
    with RayCluster(config) as deployment:
        yield deployment


def _infos(deployment: RayCluster) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in deployment.worker_info()}


def _roles(deployment: RayCluster) -> list[tuple[str, str]]:
    return [(w["role"], w["address"]) for w in deployment.workers()]


def test_spread_ray_kv_exact_across_nodes(cluster: Cluster, deployment: RayCluster, engine_model) -> None:  # noqa: ANN001
    infos = _infos(deployment)
    assert len({i["node_id"] for i in infos.values()}) == 3  # 3 workers on 3 nodes
    assert infos["prefill-0"]["node_id"] == cluster.head_node.node_id  # decode workers need a decode_slot
    rows = {r["worker_id"]: r for r in router_status(deployment.router_address)}
    assert {name: rows[name]["node_id"] for name in infos} == {name: i["node_id"] for name, i in infos.items()}
    prompts = mixed_prompts(8, seed=43)
    max_tokens = [3 + i for i in range(len(prompts))]
    assert _run_all(deployment.router_address, prompts, max_tokens) == _expected(engine_model, prompts, max_tokens)
    infos = _infos(deployment)
    prefill_node = infos["prefill-0"]["node_id"]
    crossed = sum(
        i["ray_kv_transfers"] for i in infos.values() if i["role"] == "decode" and i["node_id"] != prefill_node
    )
    assert crossed >= 1  # a decode worker on another node than the prefill worker took KV from the object store
    wait_idle(_roles(deployment))


def _node(cluster: Cluster, node_id: str):  # noqa: ANN202
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def test_node_loss_during_three_streams_then_pool_refills(cluster: Cluster, deployment: RayCluster) -> None:
    address = deployment.router_address
    prompts = mixed_prompts(3, seed=47)
    max_tokens = [300] * 3
    before = _run_all(address, prompts, max_tokens)  # the tokens served while every node is up
    router_node = ray.get(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE).info.remote())["node_id"]
    infos = _infos(deployment)
    victim = next(i for i in infos.values() if i["role"] == "decode")  # on node-a or node-b
    assert victim["node_id"] not in (router_node, cluster.head_node.node_id)
    # the router and workers share the controller's fate, so it must sit on the head node, not the victim's
    controller_node = ray.get(
        deployment.controller.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())
    )
    assert controller_node == cluster.head_node.node_id
    lost = _node(cluster, victim["node_id"])
    resource = next(r for r in ("node_a", "node_b") if _alive_nodes()[victim["node_id"]]["Resources"].get(r))

    survivor = next(r for r in router_status(address) if r["role"] == "decode" and r["worker_id"] != victim["name"])
    finished_before = worker_info(survivor["address"], "decode").requests_finished
    with ThreadPoolExecutor(3) as pool:
        streams = [
            pool.submit(generate, address, p, m, ignore_eos=True) for p, m in zip(prompts, max_tokens, strict=True)
        ]
        deadline = time.monotonic() + 60
        while not any(r["worker_id"] == victim["name"] and r["running"] for r in router_status(address)):
            assert time.monotonic() < deadline and not any(s.done() for s in streams), "victim never took a stream"
            time.sleep(0.02)
        cluster.remove_node(lost)  # its raylet, object store and the worker processes on it
        assert [s.result(timeout=240).token_ids for s in streams] == before
    # all three finished on the surviving decode worker: the victim's were resumed there, not completed by it
    assert worker_info(survivor["address"], "decode").requests_finished - finished_before == 3
    assert not psutil.pid_exists(victim["pid"]) or psutil.Process(victim["pid"]).status() == psutil.STATUS_ZOMBIE
    healthy = [r for r in router_status(address) if r["healthy"]]
    assert sorted(r["role"] for r in healthy) == ["decode", "prefill"]  # survivors only: no room elsewhere

    cluster.add_node(**_node_args(1, resource))  # the node comes back: the bundle, then the actor, return
    deadline = time.monotonic() + 180
    while True:
        rows = router_status(address)
        if sum(r["healthy"] for r in rows) == 3 and len(rows) == 3:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.5)
    back = _infos(deployment)[victim["name"]]
    assert back["pid"] != victim["pid"] and back["node_id"] not in (victim["node_id"], router_node)
    assert _run_all(address, prompts[:1], [40]) == [before[0][:40]]
    wait_idle(_roles(deployment))


def test_router_actor_restart_relearns_workers(deployment: RayCluster, engine_model) -> None:  # noqa: ANN001
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    old = ray.get(router.info.remote())
    os.kill(old["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (address := deployment.current_router_address()) == old["address"]:  # port 0: a new port
        assert time.monotonic() < deadline, "the restarted router's address never showed up"
        time.sleep(0.5)
    new = ray.get(router.info.remote())
    assert new["restarted"] and new["pid"] != old["pid"]
    known = {w["address"]: w["role"] for w in deployment.workers()}
    deadline = time.monotonic() + 30
    while True:
        rows = router_status(address)
        if rows and all(r["healthy"] for r in rows):
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.3)
    assert {r["address"]: r["role"] for r in rows} == known  # the controller's workers, current addresses
    prompts = mixed_prompts(4, seed=53)
    max_tokens = [6] * 4
    assert _run_all(address, prompts, max_tokens) == _expected(engine_model, prompts, max_tokens)
    status = run_cli("status", "--address", deployment.config.ray.address, "--json")  # discoverable from any driver
    assert status.returncode == 0 and json.loads(status.stdout)["router_address"] == address, status.stderr[-2000:]
    wait_idle(_roles(deployment))


def test_scale_up_and_down_keeps_new_workers_in_a_placement_group(
    cluster: Cluster, deployment: RayCluster, engine_model
) -> None:  # noqa: ANN001
    groups_before = {k for k, v in placement_group_table().items() if v["state"] == "CREATED"}
    extra = cluster.add_node(**_node_args(1, "node_c"))  # the only free CPU in the cluster
    try:
        up = deployment.scale(1, 3)
        assert len(up["added"]) == 1 and not up["removed"]
        (name,) = up["added"]
        assert _infos(deployment)[name]["node_id"] == extra.node_id
        groups = {k: v for k, v in placement_group_table().items() if v["state"] == "CREATED"}
        (new_group,) = set(groups) - groups_before
        assert groups[new_group]["strategy"] == "SPREAD" and len(groups[new_group]["bundles"]) == 1
        prompts = mixed_prompts(9, seed=59)
        max_tokens = [5] * 9
        address = deployment.current_router_address()
        assert _run_all(address, prompts, max_tokens) == _expected(engine_model, prompts, max_tokens)
        assert _infos(deployment)[name]["ray_kv_transfers"] >= 1  # round robin gave it requests

        down = deployment.scale(1, 2)
        assert down["removed"] == [name]
        assert placement_group_table()[new_group]["state"] == "REMOVED"
        assert sorted(w["role"] for w in deployment.workers()) == ["decode", "decode", "prefill"]
        wait_idle(_roles(deployment))
    finally:
        cluster.remove_node(extra)
