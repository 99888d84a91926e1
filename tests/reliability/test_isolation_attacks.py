"""Issue 29's table as attacks on real processes (benchmarks/isolation_attacks.py on a tiny model), with
an honest client streaming meanwhile: per row, the attacker gets what it should (clear 4xx, or a normal
answer where the input is legitimate), the honest client gets no error (no 503), and no process keeps
more than 50 MB after the attack. The honest client's stalls are timings: the benchmark reports them
against its goal (2x the baseline gap, or one prefill chunk) and they are not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                                   reason="memory is read from /proc")]


def test_every_row_of_the_table_against_an_honest_client(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "isolation.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "benchmarks/isolation_attacks.py", "--model", str(tiny_llama_dir),
                           "--long-words", "200", "--baseline-s", "2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6, 7, 9, 10]
    for number, row in rows.items():
        assert row["attacker_as_expected"], (number, row)
        assert row["honest_errors"] == [], (number, row)
        assert row["memory_grown_mb"] < 50, (number, row)
    assert rows[2]["attacker"][0] == "UNAUTHENTICATED" and rows[7]["attacker"][0] == "PERMISSION_DENIED"
    assert rows[3]["attacker"] == ["closed 50/50"]
