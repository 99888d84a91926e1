"""Live role switch, end to end on real processes (router + elastic workers on a tiny random Llama):
while 16 streams run, a decode worker becomes a prefill worker and a prefill worker becomes a decode
worker; every stream gets exactly the tokens of an undisturbed run, `pdserve status` shows the new
roles, and the switched workers then serve in them. The router reaches the workers over
GenerateMux (--decode-mux)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from waiting import eventually

from pdserve.cluster.cli import main as pdserve_main
from pdserve.cluster.client import PdserveClient, status_rows
from pdserve.cluster.elastic_cli import switch_role
from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from e2e_helpers import Streams, greedy_workload, wait_idle, worker_info

NUM_STREAMS = 16
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workload(tiny_llama_dir: Path) -> tuple[list[str], list[int], list[list[int]]]:
    """16 prompts, outputs long enough to be running during the switches, their greedy outputs."""
    return greedy_workload(tiny_llama_dir, NUM_STREAMS)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path):  # noqa: ANN201
    # the router talks to the elastic workers over GenerateMux (--decode-mux), so the elastic decode
    # face's mux is what these switches run under (the Generate path: the Ray and autoscale tests)
    config = local_deployment(model=str(tiny_llama_dir), prefill=2, decode=2, threads_per_worker=1, elastic=True)
    options = LaunchOptions(decode_args=("--max-num-seqs", "16"), router_args=("--decode-mux",))
    with LocalCluster(config, options) as running:
        yield running


def _roles(address: str) -> dict[str, str]:
    with PdserveClient(address) as client:
        return {row["worker_id"]: row["role"] for row in status_rows(client.status())}


def _routed_as(address: str, roles: dict[str, str]) -> bool:
    """The router sees every worker in `roles` (worker_id -> role) healthy in that role: what it
    assigns the next requests by."""
    with PdserveClient(address) as client:
        rows = {row["worker_id"]: row for row in status_rows(client.status())}
    return all(rows[w]["role"] == role and rows[w]["healthy"] for w, role in roles.items())


def _run_streams_with_switches(
    cluster: LocalCluster,
    workload,  # noqa: ANN001
    switches: list[tuple[str, str]],
) -> list[router_pb2.SwitchRoleResponse]:
    streams = Streams(cluster.router_address, workload)
    results = []
    for worker_id, role in switches:  # while the streams run
        result = switch_role(cluster.router_address, worker_id, role, drain_timeout_s=240)
        results.append(result)
        assert result.worker.role == common_pb2.WorkerRole.Value(f"WORKER_ROLE_{role.upper()}")
    streams.check()
    return results


def test_switch_both_ways_during_16_streams_keeps_every_token(cluster, workload, capsys) -> None:  # noqa: ANN001
    assert _roles(cluster.router_address) == {
        "prefill-0": "prefill",
        "prefill-1": "prefill",
        "decode-0": "decode",
        "decode-1": "decode",
    }
    # decode -> prefill (it finishes the streams it holds), prefill -> decode, under the same load
    results = _run_streams_with_switches(cluster, workload, [("decode-1", "prefill"), ("prefill-1", "decode")])
    assert results[0].drain_s > 0  # decode-1 held running streams and finished them before switching
    roles = _roles(cluster.router_address)
    assert roles == {"prefill-0": "prefill", "prefill-1": "decode", "decode-0": "decode", "decode-1": "prefill"}
    # a request opened on decode-1's GenerateMux now ends as a Generate call would there: UNAVAILABLE
    address = next(w.address for w in cluster.workers if w.worker_id == "decode-1")
    opened = worker_pb2.MuxRequest(
        open=worker_pb2.MuxOpen(request=worker_pb2.DecodeRequest(request_id="late", prompt="hi"), timeout_s=30)
    )
    items = [
        i
        for m in worker_pb2_grpc.DecodeWorkerStub(open_channel(address)).GenerateMux(iter([opened]), timeout=30)
        for i in m.items
    ]
    assert [(i.request_id, i.end, i.code) for i in items] == [("late", True, grpc.StatusCode.UNAVAILABLE.value[0])]
    assert "is a prefill worker now" in items[0].details
    # `pdserve status` shows the new roles
    assert pdserve_main(["status", "--url", cluster.router_address, "--json"]) == 0
    assert '"worker_id": "decode-1"' in capsys.readouterr().out
    # the switched workers serve in their new roles: a new round of streams uses both. It starts once
    # the workers are idle and the router routes by their new roles (both healthy in them: round robin
    # then gives each decode worker and each prefill worker its share of the 16)
    wait_idle([(w.role, w.address) for w in cluster.workers])
    eventually(
        lambda: _routed_as(cluster.router_address, roles),
        30,
        0.1,
        "the router to see every worker healthy in its new role",
    )
    _run_streams_with_switches(cluster, workload, [])
    # read from the workers themselves: the router's status holds its last poll, which may predate
    # the round's first KV transfer
    address = {w.worker_id: w.address for w in cluster.workers}
    assert worker_info(address["prefill-1"], "decode").kv_bytes_received > 0  # decoded after becoming a decode worker
    assert worker_info(address["decode-1"], "prefill").kv_bytes_sent > 0  # prefilled after becoming a prefill worker
    # and back, via the command line
    assert pdserve_main(["role", "--url", cluster.router_address, "decode-1", "decode"]) == 0
    assert pdserve_main(["role", "--url", cluster.router_address, "prefill-1", "prefill"]) == 0
    assert _roles(cluster.router_address)["decode-1"] == "decode"
    logs = "".join((cluster.log_dir / f"{w}.log").read_text() for w in ("decode-0", "prefill-1"))
    assert "GenerateMux start" in logs and "Generate start" not in logs  # every stream went over the mux


def test_switch_refused_when_it_would_leave_no_prefill_worker(cluster) -> None:  # noqa: ANN001
    prefill = [w for w, r in _roles(cluster.router_address).items() if r == "prefill"]
    for worker_id in prefill[:-1]:
        switch_role(cluster.router_address, worker_id, "decode")
    with pytest.raises(grpc.RpcError) as caught:
        switch_role(cluster.router_address, prefill[-1], "decode")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as caught:
        switch_role(cluster.router_address, "no-such-worker", "decode")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
