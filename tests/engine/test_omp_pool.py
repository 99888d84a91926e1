"""pdserve/omp_pool.py: with the main thread's OpenMP pool released, a second thread's parallel
torch ops run without its helpers falling asleep at every region (libgomp's throttled spin).

Run in a fresh interpreter so that no other test's threads hold pools; the count is the compute
thread's voluntary context switches (/proc), not a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, threading, torch
    from pdserve.omp_pool import release_thread_pool

    def switches():
        tid = threading.get_native_id()
        with open(f"/proc/self/task/{tid}/status") as status:
            line = next(l for l in status if l.startswith("voluntary_ctxt_switches"))
        return int(line.split()[1])

    x = torch.ones(4_000_000)
    x.add_(1)  # the main thread's pool, as a worker's model load leaves it
    counts = {}

    def compute(label):
        x.add_(1)  # this thread's pool
        before = switches()
        for _ in range(400):
            x.add_(1)  # one parallel region each
        counts[label] = switches() - before

    for label in ("beside the main pool", "main pool released"):
        if label == "main pool released":
            counts["released"] = release_thread_pool()
        thread = threading.Thread(target=compute, args=(label,))
        thread.start()
        thread.join()
    counts["main threads after"] = torch.get_num_threads()
    print(json.dumps(counts))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp and /proc are Linux's")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: torch runs no OpenMP team at all")
def test_released_main_pool_lets_the_compute_thread_spin_instead_of_sleeping() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["released"] is True  # torch's libgomp was found and its pool freed
    assert counts["main threads after"] == 1  # the released thread stays serial: no new pool
    throttled, released = counts["beside the main pool"], counts["main pool released"]
    # 400 regions: throttled, the thread sleeps at a large share of them; released, at almost none
    assert released <= 20 or released * 5 <= throttled, counts


def test_does_nothing_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.omp_pool import ENV_VAR, release_thread_pool

    monkeypatch.setenv(ENV_VAR, "0")
    assert release_thread_pool() is False


def test_a_worker_process_bounds_the_spin_wait_unless_told_otherwise() -> None:
    """prepare_process() runs in the worker's entry point before torch loads: GOMP_SPINCOUNT is set
    there, unless the user set it, the launcher said the cores are shared, or it is turned off."""
    probe = (
        "import os; from pdserve.omp_pool import prepare_process; "
        "print(prepare_process(), os.environ.get('GOMP_SPINCOUNT'))"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    cases = {
        "default": ({}, "True 3000"),
        "user's own": ({"GOMP_SPINCOUNT": "5"}, "False 5"),
        "shared cores": ({"PDSERVE_SHARED_CORES": "1"}, "False None"),
        "turned off": ({"PDSERVE_OMP_RELEASE": "0"}, "False None"),
    }
    for name, (extra, want) in cases.items():
        env = {**base, **extra}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, name
    late = "import torch; from pdserve.omp_pool import prepare_process; print(prepare_process())"
    out = subprocess.run([sys.executable, "-c", late], env=base, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # torch already loaded: too late, and it says so by returning False


def test_the_launcher_marks_workers_that_share_cores() -> None:
    from pdserve.cluster import local
    from pdserve.cluster.deploy_config import DeploymentConfig

    alone = DeploymentConfig.from_dict({}, {"prefill.count": 0, "decode.count": 0, "colocated.count": 1})
    pair = DeploymentConfig.from_dict({}, {"prefill.count": 1, "decode.count": 1})
    assert local.cores_shared(alone) is False  # one worker with every CPU
    assert local.cores_shared(pair) is True  # a 1P1D pair on one host: each worker gets every CPU
    split = DeploymentConfig.from_dict(
        {}, {"prefill.count": 1, "decode.count": 1, "prefill.threads": 1, "decode.threads": 1}
    )
    assert local.cores_shared(split) is (local._cpu_count() < 2)  # one thread each: shared only on one CPU
