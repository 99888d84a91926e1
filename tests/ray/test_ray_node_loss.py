"""Node loss with the default flags, on a multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`).

The cluster: a head node with no CPUs (it holds Ray's GCS and pdserve's controller, whose loss ends
the deployment anyway) and four worker nodes of 2 CPUs each, all started and registered before the
first test: each test removes one and still finds three. (Re-adding a node between the tests was
tried: once, in a full suite run, the fresh node's raylet died within 3 s of registering, with
nothing in its logs, and the pack test then had no node to restart its decode workers on.)
`pdserve serve --ray --address ADDR --prefill 1 --decode 2` (a real subprocess; 4 one-CPU bundles on
2-CPU nodes, so a lost node's bundles fit on the others) serves a tiny random-weight Llama; three
long greedy streams run while a node is removed, and each must finish token-identical to Hugging
Face transformers' own greedy decoding.

- Default placement (auto = spread on several nodes): the two decode workers sit on different
  nodes; the node of one of them (not the router's) is removed. The streams on it resume on the other
  decode worker, and the pool is back to two decode workers once Ray restarts the lost actor on the
  node with room (the test prints how long that took).
- `--placement pack`: both decode workers share a node (`pdserve status` warns about it); that node
  is removed. No decode worker is left, so the router holds the streams (and would hold new requests)
  until Ray restarts the decode actors on the free node, then resumes them with the tokens already
  delivered: the client sees a stall, not an error.

The nodes share one host: this checks placement, node loss and the restart wait, not network speed.
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

from ray.cluster_utils import Cluster  # noqa: E402

from pdserve.cluster.client import PdserveClient  # noqa: E402
from pdserve.cluster.ray_cluster import NAMESPACE, ROUTER_NAME  # noqa: E402

from e2e_helpers import (  # noqa: E402
    checkout_env,
    generate,
    mixed_prompts,
    multinode_ray,
    router_status,
    run_cli,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STORE = 80 * 2**20  # object store bytes per node (Ray's minimum is about 75 MiB)
MAX_TOKENS = 240


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with multinode_ray(
        {"num_cpus": 0, "object_store_memory": STORE}, [{"num_cpus": 2, "object_store_memory": STORE}] * 4, NAMESPACE
    ) as c:
        yield c


@pytest.fixture(scope="module")
def workload(tiny_llama_dir: Path) -> tuple[list[str], list[list[int]]]:
    """Three prompts and Hugging Face transformers' greedy continuation of each (MAX_TOKENS tokens,
    EOS not stopping it), computed with the model's own forward and KV cache, one token at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = mixed_prompts(3, seed=61)
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            out = model(ids, use_cache=True)
            tokens: list[int] = []
            for _ in range(MAX_TOKENS):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            expected.append(tokens)
    return prompts, expected


class Serve:
    """`pdserve serve --ray` as a subprocess; `router` and `placement` from what it prints."""

    def __init__(self, cluster: Cluster, model: Path, *flags: str) -> None:
        self.proc = subprocess.Popen(
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
                str(model),
                "--prefill",
                "1",
                "--decode",
                "2",
                "--kv-cache-mb",
                "32",
                "--threads-per-worker",
                "1",
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=checkout_env(),
            cwd=REPO,
            start_new_session=True,
        )
        self.router = self.placement = ""
        deadline = time.monotonic() + 300
        while not (self.router and self.placement):
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            assert line or self.proc.poll() is None, self.proc.stderr.read()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            if line.startswith("router: "):
                self.router = line.split("router: ", 1)[1].strip()
            if line.startswith("placement: "):
                self.placement = line.split("placement: ", 1)[1].strip()

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + 60
        while ROUTER_NAME in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}:
            assert time.monotonic() < deadline, "the router outlived `serve`"
            time.sleep(0.5)


@pytest.fixture
def serve(cluster: Cluster, tiny_llama_dir: Path) -> Iterator[Any]:
    started: list[Serve] = []

    def start(*flags: str) -> Serve:
        started.append(Serve(cluster, tiny_llama_dir, *flags))
        return started[-1]

    live = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 2]
    assert len(live) >= 3, f"{len(live)} worker nodes left: each test needs three (see the module doc)"
    yield start
    for s in started:
        s.stop()


def _router_node() -> str:
    return str(ray.get(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE).info.remote(), timeout=30)["node_id"])


def _node(cluster: Cluster, node_id: str):  # noqa: ANN202
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def _lose_node_during_streams(
    cluster: Cluster, router: str, node_id: str, prompts: list[str], expected: list[list[int]]
) -> float:
    """Run the three streams, remove `node_id` once a decode worker on it is decoding, check every
    stream against Hugging Face; returns when (monotonic) the node was removed."""
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(generate, router, p, MAX_TOKENS, 300, ignore_eos=True) for p in prompts]
        deadline = time.monotonic() + 120
        while not any(
            r["node_id"] == node_id and r["role"] == "decode" and r["running"] for r in router_status(router)
        ):
            assert time.monotonic() < deadline and not any(s.done() for s in streams), "no stream reached the node"
            time.sleep(0.02)
        cluster.remove_node(_node(cluster, node_id))
        removed = time.monotonic()
        got = [s.result(timeout=300).token_ids for s in streams]
    for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
        assert tokens == want, f"stream {i} differs from Hugging Face after the node loss"
    return removed


def _wait_pool_back(router: str, since: float, label: str) -> None:
    deadline = time.monotonic() + 180
    while True:
        rows = router_status(router)
        decode = [r for r in rows if r["role"] == "decode"]
        if len(decode) == 2 and all(r["healthy"] for r in rows) and len(rows) == 3:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.25)
    print(f"\n{label}: decode pool back to 2 healthy workers {time.monotonic() - since:.1f} s after the node loss")


def test_default_flags_spread_pools_and_survive_a_decode_node_loss(cluster: Cluster, serve, workload) -> None:  # noqa: ANN001
    prompts, expected = workload
    deployment = serve()  # no --placement
    assert deployment.placement.startswith("spread (auto:"), deployment.placement
    rows = router_status(deployment.router)
    decode_nodes = [str(r["node_id"]) for r in rows if r["role"] == "decode"]
    assert len(set(decode_nodes)) == 2, rows  # each pool over different nodes
    doc = json.loads(run_cli("status", "--address", cluster.address, "--json").stdout)
    assert doc["warnings"] == []
    router_node = _router_node()
    victim = next(n for n in decode_nodes if n != router_node)
    removed = _lose_node_during_streams(cluster, deployment.router, victim, prompts, expected)
    _wait_pool_back(deployment.router, removed, "spread")
    assert victim not in {str(r["node_id"]) for r in router_status(deployment.router)}
    with PdserveClient(deployment.router, 10.0) as client:  # every stream finished normally
        assert client.status().total_requests == 3


def test_pack_waits_for_the_restarted_decode_workers(cluster: Cluster, serve, workload) -> None:  # noqa: ANN001
    prompts, expected = workload
    deployment = serve("--placement", "pack")
    assert deployment.placement == "pack"
    rows = router_status(deployment.router)
    decode_nodes = {str(r["node_id"]) for r in rows if r["role"] == "decode"}
    assert len(decode_nodes) == 1, rows  # PACK: both decode workers on one node
    (victim,) = decode_nodes
    assert victim != _router_node(), "PACK put the router with both decode workers: the test needs them apart"
    status = run_cli("status", "--address", cluster.address)
    assert status.returncode == 0 and "warning: all 2 decode workers run on node" in status.stderr, status.stderr
    removed = _lose_node_during_streams(cluster, deployment.router, victim, prompts, expected)
    _wait_pool_back(deployment.router, removed, "pack")
    assert victim not in {str(r["node_id"]) for r in router_status(deployment.router)}
    metrics = run_cli("status", "--address", cluster.address, "--json")
    assert metrics.returncode == 0
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    waits = ray.get(
        router.__ray_call__.remote(
            lambda actor: actor.server.metrics.prom.registry.get_sample_value(
                "pdserve_worker_waits_total", {"stage": "decode"}
            )
        ),
        timeout=30,
    )
    assert waits is not None and waits >= 1  # the streams waited for a restarted decode worker
