"""One OpenMP thread team per worker process: the engine thread's.

torch's CPU kernels on Linux run on GNU OpenMP (libgomp). libgomp keeps a pool of helper threads
for every thread that starts a parallel region, and while the process holds more pool threads than
it has CPUs it cuts every team's spin-wait to about a hundred spins: at each of a decode pass's
hundreds of parallel regions (one per linear, norm, attention, elementwise op) the helpers then fall
asleep on a futex and the engine thread waits for them to be woken, where a lone team spins through
the few microseconds of Python between ops. A worker loads its model, times its kernels and builds
its engine on the main thread (one pool) and then runs every pass on its engine thread (a second
pool), so it ran throttled for its whole life: measured on the 2-core EPYC of docs/performance.md,
a batch-32 bf16 step on a second thread took 76-80 ms against 50-61 ms on the loading thread, with
about 190 sleeps of the engine thread per step against none (`benchmarks/omp_team.py`).

`release_thread_pool()` frees the calling thread's pool (`omp_pause_resource_all`, OpenMP 5.0) and
keeps that thread's later torch ops serial, so it never builds one again. A worker process calls it
on its main thread once its engine loop runs (worker/runtime.py); the serving threads call it on
starting (the event loop and its executors, pdserve/serving.py; the KV send threads): only the
engine thread computes in parallel. An elastic worker's role switch, which builds an engine, runs
on a thread of its own that ends with it (its pool goes with it).

Where torch is not loaded or does not run on libgomp (another OpenMP runtime, no OpenMP), it does
nothing and returns False; `PDSERVE_OMP_RELEASE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import sys

log = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_OMP_RELEASE"
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: a soft pause frees the threads, keeps nothing else


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted(set(re.findall(r"\S*/libgomp[^/\s]*\.so[^/\s]*", maps.read())))
    except OSError:  # not Linux
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):  # an older libgomp without omp_pause_resource_all
            continue
    return None


def _disabled() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("0", "false", "no", "off")


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP helper threads and run its later torch ops on itself alone.
    True if done; False where there is nothing to do (no torch, no libgomp, or turned off)."""
    torch = sys.modules.get("torch")
    if torch is None or _disabled():
        return False
    gomp = _libgomp()
    if gomp is None:
        return False
    torch.get_num_threads()  # torch sets a thread's count on its first use there: let that happen first
    if gomp.omp_pause_resource_all(_OMP_PAUSE_SOFT) != 0:  # inside a parallel region: leave it alone
        return False
    gomp.omp_set_num_threads(1)
    return True


def serial_thread_initializer() -> None:
    """For executors and loop threads that serve (never compute): `release_thread_pool` at start."""
    release_thread_pool()
