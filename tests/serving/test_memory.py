"""telemetry.memory: the heap bound every pdserve process applies, and the allocation tracer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)]), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
        check=False,
    )


def test_trim_gives_freed_heap_back() -> None:
    """Freed small allocations stay in the heap until malloc_trim returns them to the OS."""
    result = _run("""
        from pdserve.telemetry.memory import rss_mb, trim
        blocks = [bytearray(512) for _ in range(400_000)]  # ~250 MB of small (heap, not mmap) chunks
        keep = blocks[-1]
        del blocks
        before = rss_mb()
        assert trim()
        print(before - rss_mb())
    """)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) > 100, f"trim released only {result.stdout.strip()} MB"


def test_bound_heap_starts_trim_thread_once() -> None:
    result = _run("""
        import threading
        from pdserve.telemetry.memory import bound_heap
        assert bound_heap(trim_interval_s=0.05) and bound_heap()
        print(sum(t.name == "malloc-trim" for t in threading.enumerate()))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def test_heap_knobs_are_off_by_default() -> None:
    code = """
        import threading
        from pdserve.telemetry.memory import bound_heap
        assert bound_heap()
        print(sum(t.name == "malloc-trim" for t in threading.enumerate()))
    """
    assert _run(code).stdout.strip() == "0"
    assert _run(code, PDSERVE_MALLOC_TRIM_S="5").stdout.strip() == "1"


def test_tracemalloc_reports_growing_call_site() -> None:
    # The child waits on the tracer's own reports, not fixed sleeps (a loaded machine delays the
    # reporting thread): it grows only after the baseline, and exits after a report whose snapshot
    # was taken once all 40 MB were allocated. Which call site that report puts first is checked here, not there.
    result = _run(
        """
        import logging, time
        from pdserve.telemetry.memory import bound_heap
        logging.basicConfig(level=logging.INFO)
        reports = []
        class Seen(logging.Handler):
            def emit(self, record):
                reports.append(record.getMessage())
        logging.getLogger().addHandler(Seen())
        def wait_reports(count):
            deadline = time.monotonic() + 60
            while len(reports) < count:
                assert time.monotonic() < deadline, f"only {len(reports)} tracemalloc reports"
                time.sleep(0.02)
        bound_heap()
        hoard = []
        def grow():
            hoard.append(bytearray(4 * 2**20))
        wait_reports(1)
        assert "baseline taken" in reports[0], reports
        for _ in range(10):
            grow()
        wait_reports(len(reports) + 2)  # the first may come from a snapshot taken before the last grow()
    """,
        PDSERVE_TRACEMALLOC="0.3",
    )
    assert result.returncode == 0, result.stderr
    assert "tracemalloc: baseline taken" in result.stderr
    report = result.stderr.split("growth since baseline:")[-1]
    first_site = report.strip().splitlines()[0]
    assert first_site.startswith("+40.") and "<string>" in first_site, report
