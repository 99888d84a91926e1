"""Memory of a serving process: optional glibc heap knobs, and a tracer that finds what grows.

Every pdserve process calls `bound_heap()` at start-up. By default it changes nothing; the knobs are
for operators who see heap growth that is not live memory:
- PDSERVE_MALLOC_ARENAS=N caps glibc's malloc arenas (default: glibc's 8 per core; every thread
  that contends gets its own arena, whose freed memory is rarely given back).
- PDSERVE_MALLOC_TRIM_S=S returns freed heap pages to the OS (`malloc_trim`) every S seconds. Off
  by default: one trim took 10-40 ms in a worker holding the default model, and it holds the
  allocator's lock meanwhile, so a decode step can stall behind it.
- PDSERVE_TRACEMALLOC=S (diagnostics): trace Python allocations and log, every S seconds, the 10
  call sites whose allocations grew most since the first report, with RSS. Costs CPU.
The soak (`benchmarks/soak.py --rss-from 500`) measures growth with and without them
(docs/performance.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import tracemalloc

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc mallopt parameter

_started = False
_lock = threading.Lock()


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - glibc only
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def rss_mb() -> float:
    """This process's resident set size in MiB (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def trim() -> bool:
    """Give freed heap memory back to the OS now; False when not on glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def bound_heap(trim_interval_s: float | None = None) -> bool:
    """Apply the heap knobs (once per process; idempotent) and start the tracer when asked for.
    `trim_interval_s` overrides PDSERVE_MALLOC_TRIM_S. Returns whether glibc is there to take them."""
    global _started
    with _lock:
        if _started:
            return True
        libc = _libc()
        if libc is None:
            return False
        arenas = int(os.environ.get("PDSERVE_MALLOC_ARENAS", "0"))
        if trim_interval_s is None:
            trim_interval_s = float(os.environ.get("PDSERVE_MALLOC_TRIM_S", "0"))
        if arenas > 0:
            libc.mallopt(_M_ARENA_MAX, arenas)
        if trim_interval_s > 0:
            threading.Thread(
                target=_trim_forever, args=(libc, trim_interval_s), name="malloc-trim", daemon=True
            ).start()
        _started = True
    start_trace_from_env()
    return True


def _trim_forever(libc: ctypes.CDLL, interval_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(interval_s):
        libc.malloc_trim(0)


def start_trace_from_env() -> bool:
    """Start the allocation tracer when PDSERVE_TRACEMALLOC is set to a report interval (seconds)."""
    value = os.environ.get("PDSERVE_TRACEMALLOC", "")
    if not value:
        return False
    interval = float(value)
    tracemalloc.start(8)
    threading.Thread(target=_report_forever, args=(interval,), name="tracemalloc", daemon=True).start()
    return True


def _report_forever(interval_s: float) -> None:
    stop = threading.Event()
    first: tracemalloc.Snapshot | None = None
    while not stop.wait(interval_s):
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [
                tracemalloc.Filter(False, tracemalloc.__file__),
                tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
            ]
        )
        if first is None:
            first = snapshot
            log.info(
                "tracemalloc: baseline taken; traced %.1f MB, RSS %.0f MB",
                tracemalloc.get_traced_memory()[0] / 2**20,
                rss_mb(),
            )
            continue
        top = snapshot.compare_to(first, "traceback")[:10]
        lines = [
            f"{s.size_diff / 2**20:+.2f} MB {s.count_diff:+d} blocks at "
            + " <- ".join(f"{f.filename.rsplit('/', 2)[-2:][-1]}:{f.lineno}" for f in s.traceback[:4])
            for s in top
        ]
        log.info(
            "tracemalloc: traced %.1f MB, RSS %.0f MB; growth since baseline:\n  %s",
            tracemalloc.get_traced_memory()[0] / 2**20,
            rss_mb(),
            "\n  ".join(lines),
        )
