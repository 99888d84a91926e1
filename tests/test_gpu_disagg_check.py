"""The disaggregation device check cannot rot between device runs: `bash benchmarks/gpu_disagg_check.sh
--device cpu` (the same script as on a lent GPU machine, tiny random-weight shapes, no model download)
runs every step here and passes. On a CPU the K/V goes through the host path, so the dry run also
shows that fallback end to end: a second process asked for cuda_ipc sends over shm, and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dry_run_of_the_disaggregation_check_passes_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    done = subprocess.run(
        ["bash", "benchmarks/gpu_disagg_check.sh", "--device", "cpu", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=960,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = json.loads((tmp_path / "gpu-disagg-check.json").read_text())["rows"]
    assert {r["step"] for r in rows} == {"env", "kv", "serving", "kill"}
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    values = {r["what"]: r["value"] for r in rows}
    assert values["hand-off path taken"] == "shm"  # no CUDA here: the host path...
    assert "cannot export its pool" in done.stderr and "host memory" in done.stderr  # ...and it says so
    assert values["blocks arrived bit-exact"] is True
    assert values["1p1d decode worker prefilled no prompt"] == 0
    assert values["1p1d KV path"] == "host (fallback logged)"
    assert values["tokens identical to an undisturbed run"] is True
    assert values["decode KV blocks still used afterwards"] == 0
    for key in ("1p1d interference itl_ms_p90", "colocated interference itl_ms_p90", "1p1d short alone ttft_ms_p50"):
        assert values[key] > 0
