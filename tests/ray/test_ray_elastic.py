"""Elastic roles and the autoscaler's actuator on Ray (one local Ray instance and one deployment for
the module: `serve --ray --autoscale`, a tiny random Llama, 2 prefill + 2 decode elastic worker
actors, min 3 / max 5 workers).

- A role switch during 16 streams: every stream gets the tokens of an undisturbed greedy run, the
  switched actor keeps its process (the model stays loaded), and `pdserve status` and the
  controller show the new role.
- The Ray actuator (the autoscaler loop's resize) adds a worker when told to scale up, refuses at
  max_workers, removes one (draining: its running streams are live-migrated to the other decode
  workers, none changes) when told to scale down, refuses at min_workers.

The loop's period is an hour here, so that it takes no decision of its own during the test; one
tick is run on demand (`Controller.autoscaler_tick`) against the Ray router."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from pdserve.cluster.cli import main as pdserve_main  # noqa: E402
from pdserve.cluster.client import PdserveClient, status_rows  # noqa: E402
from pdserve.cluster.deploy_config import DeploymentConfig  # noqa: E402
from pdserve.cluster.elastic_cli import switch_role  # noqa: E402
from pdserve.cluster.ray_cluster import RayCluster  # noqa: E402
from pdserve.v1 import common_pb2  # noqa: E402

from e2e_helpers import Streams, greedy_workload, init_local_ray, wait_idle, worker_info  # noqa: E402

NUM_STREAMS = 16
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    init_local_ray(num_cpus=8)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def workload(tiny_llama_dir: Path) -> tuple[list[str], list[int], list[list[int]]]:
    """16 prompts with outputs long enough to be running during a switch or a removal, and their
    greedy outputs (checked free of batch-dependent near-ties). Longer than the shared workload's
    60-120 tokens: on a loaded 2-core machine the scale-in's role refresh and drain call took longer
    than the victim's last streams had left, and nothing was left to migrate."""
    return greedy_workload(tiny_llama_dir, NUM_STREAMS, lengths=(200, 300))


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[RayCluster]:
    pool = {"count": 2, "threads": 1, "drain_timeout_s": 120.0}
    config = DeploymentConfig.from_dict(
        {
            "mode": "ray",
            "model": {"path": str(tiny_llama_dir), "device": "cpu"},
            "router": {"port": 0},
            "prefill": pool,
            "decode": {**pool, "max_num_seqs": 16},
            "elastic": {
                "autoscale": True,
                "slo": "ttft_ms=600000,tpot_ms=600000",
                "min_workers": 3,
                "max_workers": 5,
                "interval_s": 3600.0,
            },
        }
    )
    with RayCluster(config) as running:
        yield running


def _router_roles(address: str) -> dict[str, str]:
    with PdserveClient(address) as client:
        return {row["worker_id"]: row["role"] for row in status_rows(client.status())}


def _controller_roles(cluster: RayCluster, expected: dict[str, str], timeout_s: float = 30) -> dict[str, str]:
    """The controller's view (its watcher polls each actor's role); waits until it equals `expected`."""
    deadline = time.monotonic() + timeout_s
    while True:
        roles = {w["name"]: w["role"] for w in cluster.workers() if not w["draining"]}
        if roles == expected or time.monotonic() > deadline:
            return roles
        time.sleep(0.2)


def _idle(cluster: RayCluster) -> None:
    wait_idle([(w["role"], w["address"]) for w in cluster.workers()], timeout=60)


def test_role_switch_during_16_streams_on_ray(cluster: RayCluster, workload, capsys) -> None:  # noqa: ANN001
    address = cluster.router_address
    start = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
    assert _router_roles(address) == start
    pids = {i["name"]: i["pid"] for i in cluster.worker_info()}
    streams = Streams(address, workload)
    results = [
        switch_role(address, "decode-1", "prefill", drain_timeout_s=240),  # while the streams run
        switch_role(address, "prefill-1", "decode", drain_timeout_s=240),
    ]
    streams.check()
    assert [r.worker.role for r in results] == [common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE]
    switched = {**start, "decode-1": "prefill", "prefill-1": "decode"}
    assert _router_roles(address) == switched
    assert _controller_roles(cluster, switched) == switched
    infos = {i["name"]: i for i in cluster.worker_info()}
    assert {n: i["pid"] for n, i in infos.items()} == pids  # switched in place: same processes, model kept
    assert infos["decode-1"]["role_switches"] == infos["prefill-1"]["role_switches"] == 1
    assert pdserve_main(["status", "--url", address, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {w["worker_id"]: w["role"] for w in printed["workers"]} == switched
    # the switched workers serve in their new roles
    _idle(cluster)
    Streams(address, workload).check()
    infos_pb = {name: worker_info(i["address"], i["role"]) for name, i in infos.items()}
    assert infos_pb["prefill-1"].kv_bytes_received > 0 and infos_pb["decode-1"].kv_bytes_sent > 0
    # and back, with the command line
    assert pdserve_main(["role", "--url", address, "decode-1", "decode"]) == 0
    assert pdserve_main(["role", "--url", address, "prefill-1", "prefill"]) == 0
    assert _router_roles(address) == start
    assert _controller_roles(cluster, start) == start
    _idle(cluster)


def test_ray_actuator_adds_and_removes_workers_within_min_max(cluster: RayCluster, workload) -> None:  # noqa: ANN001
    address = cluster.router_address
    assert len(_router_roles(address)) == 4
    # scale up: a new elastic worker actor, registered with the router once it serves
    assert cluster.resize("add", "decode") == "added decode-2"
    assert _router_roles(address)["decode-2"] == "decode"
    assert cluster.resize("add", "prefill") == "refused: 5 workers, max_workers 5"
    assert len(_router_roles(address)) == 5 and len(cluster.workers()) == 5
    # scale down while 16 streams run: the decode worker holding the most drains first (its running
    # streams move to the others), then leaves
    _idle(cluster)
    streams = Streams(address, workload)
    decode = [w for w in cluster.workers() if w["role"] == "decode"]
    victim = max(decode, key=lambda w: worker_info(w["address"], "decode").running_requests)
    assert worker_info(victim["address"], "decode").running_requests > 0
    others = [w["address"] for w in decode if w is not victim]
    migrated_in = sum(worker_info(a, "decode").requests_migrated_in for a in others)
    assert cluster.resize("remove", "decode", victim["name"]) == f"removed {victim['name']}"
    streams.check()
    # its running streams moved to the other decode workers (live migration) rather than waiting it out
    assert sum(worker_info(a, "decode").requests_migrated_in for a in others) > migrated_in
    assert victim["name"] not in _router_roles(address)
    assert cluster.resize("remove", "prefill") == "removed prefill-1"  # the newest prefill worker
    assert cluster.resize("remove", "decode") == "refused: 3 workers, min_workers 3"
    assert sorted(_router_roles(address).values()) == ["decode", "decode", "prefill"]
    assert len(cluster.workers()) == 3
    status = cluster.autoscaler_status()
    assert status is not None
    outcomes = [a["outcome"].split()[0].rstrip(":") for a in status["resizes"]]
    assert outcomes == ["added", "refused", "removed", "removed", "refused"]
    # the loop runs in the controller against the Ray router: one tick sees 1P2D and, at
    # min_workers with the SLOs held, decides nothing
    assert ray.get(cluster.controller.autoscaler_tick.remote(), timeout=60) == []
    last = cluster.autoscaler_status()["last"]
    assert (last["prefill"], last["decode"]) == (1, 2)
    _idle(cluster)
