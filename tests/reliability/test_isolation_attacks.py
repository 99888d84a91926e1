"""Issue 29's table as attacks on real processes (benchmarks/isolation_attacks.py on a tiny model), with
an honest client streaming meanwhile: per row, the attacker gets what it should (clear 4xx, or a normal
answer where the input is legitimate), the honest client gets no error (no 503), and no process keeps
more than 50 MB after the attack, and no pass that decoded the honest stream carried more prompt work
than one plain prefill chunk (the stall bound in work units, from the workers' pass logs). The honest
client's stalls in wall time are timings: the benchmark reports them against its goal (2x the
baseline gap, or for rows 5 and 11 2x row 12's, the same prompt without logprobs; or one prefill
chunk) and they are not asserted here (row 5 on the default model:
docs/security.md has its runs; on a shared machine its worst gap against the chunk moved from 0.58x
to 1.65x between runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="memory is read from /proc"),
]


def _attacks(model: Path, out: Path, *args: str, timeout: float = 600) -> dict[int, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "benchmarks/isolation_attacks.py", "--model", str(model), "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout[-3000:])
    return {r["row"]: r for r in json.loads(out.read_text())["rows"]}


def test_every_row_of_the_table_against_an_honest_client(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # rows 5, 11 and 12's prompt: 270 words, about 970 tokens of the tiny model (context 1,024)
    rows = _attacks(tiny_llama_dir, tmp_path / "isolation.json", "--long-words", "270", "--baseline-s", "2")
    assert sorted(rows) == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13]
    for number, row in rows.items():
        assert row["attacker_as_expected"], (number, row)
        assert row["honest_errors"] == [], (number, row)
        assert row["memory_grown_mb"] < 50, (number, row)
    assert rows[2]["attacker"][0] == "UNAUTHENTICATED" and rows[7]["attacker"][0] == "PERMISSION_DENIED"
    assert rows[3]["attacker"] == ["closed 50/50"]
    assert rows[13]["attacker"] == ["400"]  # 256 huge chat messages: over the context, refused
    # the stall bound in work units (engine.chunk_cost): no pass that decoded the honest stream carried
    # more prompt work than one plain chunk
    for number, row in rows.items():
        assert row["prompt_cost_beside_streams"] <= 1.0 + 1e-6, (number, row)
    # logprobs (row 5), echo + logprobs (row 11) and the plain prompt (row 12) are prefilled on the
    # prefill pool alike: the decode worker serving the honest stream computed none of them
    for number in (5, 11, 12):
        assert rows[number]["prompt_passes_beside_streams"] == 0, rows[number]
        assert rows[number]["goal_reference"] == ("row 12" if number != 12 else "baseline")
