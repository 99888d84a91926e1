"""`pdserve serve --autoscale` as a user runs it (real processes, the simulated engine): started with a
split that is wrong for a decode-heavy workload (2 prefill, 1 decode), under load the autoscaler moves
a prefill worker to decode; `pdserve status` shows it, every request completes, and the decision is
in the autoscaler's /metrics and its log, with its reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sim_profiles import make_profile

from pdserve.cluster.cli import main

pytestmark = pytest.mark.slow


def _read_until(proc: subprocess.Popen, prefix: str, lines: list[str], timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"serve exited early: {lines}"
        lines.append(line.strip())
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no {prefix!r} line in {timeout_s} s: {lines}")


def _status(url: str, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert main(["status", "--url", url, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _roles(status: dict) -> list[str]:
    return sorted(w["role"] for w in status["workers"])


def _samples(url: str, name: str) -> dict[str, float]:
    """'{labels}' -> value of every sample of `name` on a /metrics page."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        line.split(" ")[0].removeprefix(name): float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    }


def test_autoscaler_moves_a_prefill_worker_to_decode_under_decode_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # one decode worker steps 8 sequences in 42 ms (190 tokens/s); the load needs about 240: decode is short
    profile = make_profile(
        prefill=(0.005, 2e-5, 0.0),
        decode=(0.01, 0.004, 0.0),
        transfer_s=0.001,
        max_num_seqs=8,
        kv_capacity_tokens=16 * 1024,
    )
    profile.save(tmp_path / "profile.json")
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cluster.cli",
            "serve",
            "--port",
            "0",
            "--threads-per-worker",
            "1",
            "--prefill",
            "2",
            "--decode",
            "1",
            "--engine",
            "sim",
            "--profile",
            str(tmp_path / "profile.json"),
            "--autoscale",
            "--slo",
            "ttft_ms=2000,tpot_ms=100",
            "--min-workers",
            "3",
            "--max-workers",
            "3",
            "--autoscale-interval",
            "0.25",
            "--metrics",
            "--log-dir",
            str(log_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        lines: list[str] = []
        url = _read_until(proc, "router:", lines).split()[-1]
        metrics_url = _read_until(proc, "metrics autoscaler:", lines).split()[-1]
        assert _roles(_status(url, capsys)) == ["decode", "prefill", "prefill"]
        out = tmp_path / "bench.json"
        assert (
            main(
                [
                    "bench",
                    "--url",
                    url,
                    "--no-progress",
                    "--seed",
                    "1",
                    "--ignore-eos",
                    "--output",
                    str(out),
                    "--num-prompts",
                    "150",
                    "--rate",
                    "6",
                    "--input-len",
                    "32",
                    "--output-len",
                    "40",
                    "--engine",
                    "sim",
                    "--profile",
                    str(tmp_path / "profile.json"),
                ]
            )
            == 0
        )
        summary = json.loads(out.read_text())["summary"]
        assert summary["completed"] == 150 and summary["failed"] == 0  # no request lost to the switch
        assert summary["total_output_tokens"] == 150 * 40
        deadline = time.monotonic() + 30  # the autoscaler may still be finishing the switch's drain
        while _roles(status := _status(url, capsys)) != ["decode", "decode", "prefill"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _roles(status) == ["decode", "decode", "prefill"], status["workers"]
        switched = [w for w in status["workers"] if w["worker_id"].startswith("prefill-") and w["role"] == "decode"]
        assert len(switched) == 1
        decisions = _samples(metrics_url, "pdserve_autoscaler_decisions_total")
        assert decisions == {'{kind="switch",outcome="done",role="decode"}': 1.0}, decisions  # once: no flapping
        assert _samples(metrics_url, "pdserve_autoscaler_workers") == {'{role="prefill"}': 1.0, '{role="decode"}': 2.0}
        assert _samples(metrics_url, "pdserve_autoscaler_last_decision_timestamp_seconds")[""] > 0
        log = (log_dir / "autoscaler.log").read_text()
        assert f"switch {switched[0]['worker_id']} -> decode: " in log and "done in" in log, log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
