"""The static tools see the whole project: mypy (pyproject's [tool.mypy]: every package through
pdserve/'s symlinks, and the benchmarks, at check_untyped_defs) and ruff (lint and format) pass, and a
probe with a deliberate cross-package type error is reported, so the checker follows `pdserve.*`
imports into the top-level folders instead of seeing them as Any."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = """
from pdserve.engine.block_pool import BlockPool
from pdserve.kv_transfer import KvSpec

pool: int = BlockPool(num_blocks=4, block_size=16)
spec: str = KvSpec.for_cache
"""


def _run(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )


def test_mypy_checks_the_whole_project_and_passes() -> None:
    done = _run("mypy")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    checked = int(done.stdout.split("in ")[-1].split()[0])
    assert checked >= 150, done.stdout  # every package and benchmark, not a few files


def test_the_checker_sees_across_packages(tmp_path: Path) -> None:
    """A type error whose types live in two other packages (engine, kv_transfer) is reported: with
    the imports unresolved (Any) mypy would say 'Success'."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    done = _run("mypy", "--no-incremental", "--config-file", str(REPO / "pyproject.toml"), str(probe))
    out = done.stdout
    assert done.returncode == 1, out
    assert 'Incompatible types in assignment (expression has type "BlockPool", variable has type "int")' in out
    assert 'variable has type "str")' in out and "probe.py:6" in out


@pytest.mark.parametrize("check", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_ruff(check: tuple[str, ...]) -> None:
    done = _run("ruff", *check)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
