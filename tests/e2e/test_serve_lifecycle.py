"""`pdserve serve` as a user runs it, and conditional disaggregation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve.cluster.launch import local_deployment
from pdserve.cluster.local import LocalCluster

from e2e_helpers import generate, wait_idle, worker_info


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_serve_prints_address_serves_and_stops_on_sigterm_without_orphans() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cluster.cli", "serve", "--port", "0", "--threads-per-worker", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = []
        while not lines or not lines[-1].startswith("Ctrl-C"):
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, f"serve exited early: {lines}"
            lines.append(line.strip())
        address = lines[0].split()[-1]
        pids = [int(row.split()[-1]) for row in lines[2:-1]]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        assert generate(address, "Hello", 4).token_ids
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "worker processes outlived `pdserve serve`"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_short_prompts_prefilled_on_the_decode_worker(tiny_llama_dir: Path) -> None:
    """Workers serve the tiny random Llama (the default model's tokenizer): where a prompt is prefilled
    depends on its token count, not on the model."""
    config = local_deployment(
        model=str(tiny_llama_dir), prefill=1, decode=1, threads_per_worker=1, local_prefill_threshold=32
    )
    with LocalCluster(config) as cluster:
        roles = [(w.role, w.address) for w in cluster.workers]
        address = dict(roles)
        generate(cluster.router_address, "Hi there", 3)
        assert worker_info(address["decode"], "decode").prefill_tokens_computed > 0
        assert worker_info(address["prefill"], "prefill").prefill_tokens_computed == 0
        generate(cluster.router_address, "The old river ran past the mill at evening " * 8, 3)
        assert worker_info(address["prefill"], "prefill").prefill_tokens_computed > 32
        wait_idle(roles)
