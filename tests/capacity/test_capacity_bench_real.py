"""A short real bench against a 1P1D LocalCluster with the default model (the session's, tests/conftest.py),
through `pdserve bench`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cluster.cli import main
from pdserve.cluster.local import LocalCluster

from e2e_helpers import wait_idle


@pytest.mark.slow
def test_real_bench_writes_every_record(default_1p1d: LocalCluster, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    # the session's 1P1D default-model cluster (tests/conftest.py)
    code = main(
        [
            "bench",
            "--url",
            default_1p1d.router_address,
            "--num-prompts",
            "8",
            "--rate",
            "4",
            "--seed",
            "1",
            "--input-len",
            "8:24",
            "--output-len",
            "4",
            "--ignore-eos",
            "--warmup",
            "1",
            "--no-progress",
            "--slo",
            "ttft_ms=60000",
            "--slo",
            "tpot_ms=60000",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    records, summary = doc["records"], doc["summary"]
    assert [r["index"] for r in records] == list(range(8))
    assert summary["completed"] == 8 and summary["failed"] == 0
    for r in records:
        assert not r["error"] and 8 <= r["prompt_tokens"] <= 24 and r["output_tokens"] == 4
        assert 0 < r["ttft"] <= r["e2e"] and len(r["itl"]) == 3 and all(g >= 0 for g in r["itl"])
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / 3)
    assert summary["total_output_tokens"] == 32
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # generous SLOs: all good
    assert summary["slo_attainment_all"] == 1.0
    assert 0 < summary["ttft_ms"]["median"] <= summary["ttft_ms"]["p99"]
    assert doc["config"]["input_len"] == {"uniform": [8, 24]} and doc["config"]["rate"] == 4.0
    wait_idle([(w.role, w.address) for w in default_1p1d.workers])  # the shared cluster is left idle
