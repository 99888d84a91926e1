"""The device check cannot rot between device runs: `bash benchmarks/gpu_check.sh --device cpu` (the
same script as on a lent GPU machine, tiny random-weight shapes, no model download) runs every step
here and passes; and the dependency step installs only what is missing or too old, from carried wheels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_deps  # noqa: E402


@pytest.mark.slow
def test_dry_run_of_the_device_check_passes_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    # --repeats 1: the decode step times each engine and HF run once after its warm-up run, not twice
    # (its rows are only checked to be positive here); every step still runs
    done = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--out", str(tmp_path), "--repeats", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    rows = doc["rows"]
    assert {r["step"] for r in rows} == {"env", "exactness", "decode", "floor", "prefill", "profile", "serving", "kv"}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    exact = {r["what"]: r["value"] for r in rows if r["step"] == "exactness"}
    assert exact["fp32 tiny-llama greedy = HF generate, batched"] == "7/7"
    assert exact["fp32 tiny-llama greedy = HF generate, alone"] == "7/7"
    decode = [r for r in rows if r["step"] == "decode" and r["what"].endswith("engine / HF static")]
    assert len(decode) == 4 and all(r["value"] > 0 for r in decode)  # 2 tiny shapes x batch 1 and 4
    assert "every dependency is installed" in done.stderr  # nothing to install on this machine


def test_only_missing_or_older_dependencies_are_installed() -> None:
    installed = {name: "99.0" for name in device_deps.FLOORS}
    assert device_deps.needed(installed) == {}
    installed.update({"grpcio": "1.80.0", "protobuf": None, "transformers": "5.17.0"})
    need = device_deps.needed(installed)
    assert set(need) == {"grpcio", "protobuf"}  # 5.17 is past the transformers floor
    assert need["grpcio"] == "1.80.0 < 1.85.1" and need["protobuf"].startswith("missing")
    assert device_deps.version_tuple("7.35.1rc1") == (7, 35, 1) < device_deps.version_tuple("7.36")


def test_carried_wheels_are_found_by_distribution_name(tmp_path: Path) -> None:
    for name in (
        "grpcio-1.85.3-cp312-cp312-manylinux_2_17_x86_64.whl",
        "grpcio_health_checking-1.85.1-py3-none-any.whl",
        "protobuf-7.36.2-cp39-abi3-manylinux2014_x86_64.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    assert device_deps.wheel_for("grpcio", tmp_path).name.startswith("grpcio-1.85.3")
    assert device_deps.wheel_for("grpcio-health-checking", tmp_path).name.startswith("grpcio_health_checking")
    assert device_deps.wheel_for("grpcio-reflection", tmp_path) is None
