"""Sim-engine clusters through the real serving path: 16 workers serve 200 requests with `bench`,
`status` and the Prometheus metrics behaving as with a model; `--speedup` keeps profile-time results."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from sim_profiles import make_profile
from waiting import eventually

from pdserve.cluster.cli import main
from pdserve.cluster.engine_flags import sim_worker_args
from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster


def _bench(url: str, out: Path, *extra: str) -> dict:
    code = main(["bench", "--url", url, "--no-progress", "--seed", "3", "--ignore-eos", "--output", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def _status(url: str, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert main(["status", "--url", url, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _counter(metrics_address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


#: Requests through the 16-worker cluster: 3 rounds of the bench's 64 in flight, 25 per decode worker
#: on average (the point is the 16-worker deployment under concurrent load, not the count; it was 500).
REQUESTS = 200


@pytest.mark.slow
def test_sixteen_worker_sim_cluster_serves_200_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = make_profile(
        prefill=(0.004, 1e-5, 0.0), decode=(0.003, 1e-5, 0.0), transfer_s=0.001, kv_capacity_tokens=16 * 512
    )
    profile.save(tmp_path / "profile.json")
    engine = sim_worker_args(str(tmp_path / "profile.json"))
    config = local_deployment(prefill=8, decode=8, threads_per_worker=1, metrics=True, startup_timeout_s=600.0)
    with LocalCluster(config, LaunchOptions(prefill_args=engine, decode_args=engine)) as cluster:
        url = cluster.router_address
        doc = _bench(
            url,
            tmp_path / "bench.json",
            "--num-prompts",
            str(REQUESTS),
            "--rate",
            "inf",
            "--max-concurrency",
            "64",
            "--input-len",
            "16:64",
            "--output-len",
            "8",
            "--slo",
            "ttft_ms=60000",
            "--slo",
            "tpot_ms=60000",
            "--engine",
            "sim",
            "--profile",
            str(tmp_path / "profile.json"),
        )
        summary = doc["summary"]
        assert summary["completed"] == REQUESTS and summary["failed"] == 0
        assert summary["total_output_tokens"] == REQUESTS * 8 and summary["goodput"] == summary["request_throughput"]
        assert all(r["output_tokens"] == 8 and len(r["itl"]) == 7 for r in doc["records"])
        assert doc["config"]["engine"] == "sim"

        def idle_status() -> dict | None:  # finished requests free their blocks; the router's view catches up
            status = _status(url, capsys)
            return status if all(w["kv_used"] == 0 for w in status["workers"]) else None

        status = eventually(idle_status, 60.0, 0.25, what="every worker's KV blocks free in `status`")
        workers = status["workers"]
        assert sorted(w["role"] for w in workers) == ["decode"] * 8 + ["prefill"] * 8
        assert all(w["healthy"] and w["kv_used"] == 0 and w["kv_total"] == 512 for w in workers)
        assert status["total_requests"] >= REQUESTS
        decode_metrics = [a for name, a in cluster.metrics_addresses.items() if name.startswith("decode")]
        assert len(decode_metrics) == 8
        tokens = sum(_counter(a, "pdserve_generation_tokens_total") for a in decode_metrics)
        assert tokens == REQUESTS * 8


def _sim_run(tmp_path: Path, profile_path: Path, speedup: float) -> dict:
    engine = sim_worker_args(str(profile_path), speedup)
    config = local_deployment(prefill=1, decode=1, threads_per_worker=1, startup_timeout_s=600.0)
    with LocalCluster(config, LaunchOptions(prefill_args=engine, decode_args=engine)) as cluster:
        return _bench(
            cluster.router_address,
            tmp_path / f"speedup-{speedup}.json",
            "--num-prompts",
            "12",
            "--rate",
            "2",
            "--input-len",
            "100",
            "--output-len",
            "6",
            "--speedup",
            str(speedup),
            "--engine",
            "sim",
            "--profile",
            str(profile_path),
        )


@pytest.mark.slow
def test_speedup_gives_the_same_profile_time_results(tmp_path: Path) -> None:
    # passes of 100-250 ms profile time: the serving stack's few ms of wall overhead stay small beside them
    profile = make_profile(prefill=(0.2, 0.0005, 0.0), decode=(0.1, 0.001, 0.0), transfer_s=0.02)
    profile.save(tmp_path / "profile.json")
    slow = _sim_run(tmp_path, tmp_path / "profile.json", 1.0)["summary"]
    fast = _sim_run(tmp_path, tmp_path / "profile.json", 2.0)["summary"]
    assert slow["completed"] == fast["completed"] == 12
    modelled_step = 0.1 + 0.001  # one sequence decoding at a time at 2 req/s
    for summary in (slow, fast):  # both read in profile time: near the modelled step, not half of it
        assert summary["tpot_ms"]["median"] == pytest.approx(modelled_step * 1000, rel=0.3)
        assert summary["ttft_ms"]["median"] >= (0.2 + 0.05 + 0.02) * 1000 * 0.9  # prefill pass + transfer
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert fast[metric]["median"] == pytest.approx(slow[metric]["median"], rel=0.3), metric
    assert fast["duration_s"] == pytest.approx(slow["duration_s"], rel=0.3)


def test_serve_max_queued_requests_reaches_the_router(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pdserve serve --max-queued-requests N` (through the serve command's DeploymentConfig) bounds the
    router's queue, as `pdserve status` reports it."""
    from pdserve.cluster.cli import build_parser, deployment_config

    profile = make_profile(
        prefill=(0.004, 1e-5, 0.0), decode=(0.003, 1e-5, 0.0), transfer_s=0.001, kv_capacity_tokens=512
    )
    profile.save(tmp_path / "profile.json")
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "0",
            "--threads-per-worker",
            "1",
            "--max-queued-requests",
            "7",
            "--device",
            "cpu",
            "--engine",
            "sim",
            "--profile",
            str(tmp_path / "profile.json"),
        ]
    )
    config = deployment_config(args)
    assert config.router.max_queued_requests == 7 and config.model.engine == "sim"
    with LocalCluster(config) as cluster:
        status = _status(cluster.router_address, capsys)
    assert status["max_queued_requests"] == 7 and status["queued_requests"] == 0
