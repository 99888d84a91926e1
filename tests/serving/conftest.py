"""Fixtures for serving-core tests: real workers and a real router, in this process, on loopback.

Workers are started with their own `start_worker` (the code a worker process and a Ray actor run),
so the gRPC servers, engine loop threads and KV paths are the real ones; only the process boundary
is skipped, to keep these tests fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.worker.runtime import StartedWorker


@pytest.fixture
def start_colocated(tiny_llama_dir: Path) -> Iterator[Callable[..., StartedWorker]]:
    """Start a colocated decode worker on the tiny Llama model with extra flags; stopped afterwards."""
    from pdserve.decode_worker.process import DecodeWorkerConfig, parse_args, start_worker

    started: list[StartedWorker] = []

    def start(*flags: str) -> StartedWorker:
        args = parse_args(
            ["--model", str(tiny_llama_dir), "--colocated", "--kv-cache-mb", "16", "--drain-timeout-s", "1", *flags]
        )
        worker = start_worker(DecodeWorkerConfig.from_args(args))
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
