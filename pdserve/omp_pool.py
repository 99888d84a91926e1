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

Without the throttle a waiting thread spins for GOMP_SPINCOUNT iterations (libgomp's default
300,000, milliseconds) before it sleeps. That is right while the team has its cores to itself and
ruinous while another program holds one of them: the spinning thread then burns the time slice its
partner needs (a served 32-chat burst beside one spinning process fell from 249 to 72 output tok/s
in bf16, most of it in the first prompt pass, before the thread governor moves the passes to one
thread). `prepare_process()`, called by a worker's entry point before torch loads (libgomp reads
its environment once), sets GOMP_SPINCOUNT=3000: long enough for the Python between most ops of a
pass, short enough to give the core back. Served 32-chat bursts, colocated, median of 3 interleaved
rounds (benchmarks/reports/omp-team/served-spin-matrix.txt), against the pools kept (throttled):
bf16 462 against 349 tok/s quiet (1.32x) and 248 against 287 beside a busy core (0.86x); fp32 309
against 269 (1.15x) and 186 against 180 (1.03x). A spin of 10,000 gave 432 / 234 and 297 / 161.

Several workers of one deployment on the same cores (a 1P1D pair on one host, each with every CPU)
are an oversubscription by design; there libgomp's throttle is what they need. The local launcher
marks such workers (`PDSERVE_SHARED_CORES=1`, cluster/local.py) and they keep their pools and the
default spin (`dedicate_engine_thread()` does nothing).

Where torch is not loaded or does not run on libgomp (another OpenMP runtime, no OpenMP), nothing
is done; `PDSERVE_OMP_RELEASE=0` turns all of it off, and a GOMP_SPINCOUNT or OMP_WAIT_POLICY the
user set is kept.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys

ENV_VAR = "PDSERVE_OMP_RELEASE"
SHARED_ENV = "PDSERVE_SHARED_CORES"  # "1": this worker shares its cores with others of its deployment
SPIN_ENV = "GOMP_SPINCOUNT"
SPIN_DEFAULT = "3000"
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


def cores_shared() -> bool:
    """Whether the launcher marked this worker as sharing its cores with other workers."""
    return os.environ.get(SHARED_ENV, "").strip() == "1"


def prepare_process() -> bool:
    """In a worker process before torch is imported: bound libgomp's spin-wait (see the module
    docstring). True if GOMP_SPINCOUNT was set here."""
    if _disabled() or cores_shared() or "torch" in sys.modules:
        return False
    if SPIN_ENV in os.environ or "OMP_WAIT_POLICY" in os.environ:  # the user's choice
        return False
    os.environ[SPIN_ENV] = SPIN_DEFAULT
    return True


def dedicate_engine_thread() -> bool:
    """Called by a worker process's main thread once its engine thread runs the passes: release
    this thread's pool, unless the cores are shared with other workers. True if released."""
    if cores_shared():
        return False
    return release_thread_pool()


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
