"""Helpers for end-to-end tests: talk to a running service with the raw generated stubs."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]

WORDS = (
    "river mill evening children market flour dawn sea poem capital France story old light winter city mountain lake"
).split()


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: int
    responses: list[router_pb2.GenerateResponse]


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.choice([1, 3, 8, 20, 60, 150]))) for _ in range(n)]


def generate(address: str, prompt: str, max_tokens: int, timeout: float = 300, **params: object) -> Result:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    request = router_pb2.GenerateRequest(
        prompt=prompt, params=common_pb2.SamplingParams(max_tokens=max_tokens, **params)
    )
    responses = list(stub.Generate(request, timeout=timeout))
    return Result(
        "".join(r.text for r in responses),
        [t for r in responses for t in r.token_ids],
        responses[-1].finish_reason,
        responses,
    )


def generate_many(
    address: str, prompts: list[str], max_tokens: list[int], params: list[dict[str, object]] | None = None
) -> list[Result]:
    """Every prompt at once; `params[i]`: extra SamplingParams fields of request i."""
    extra = params or [{} for _ in prompts]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(
            pool.map(
                lambda pmx: generate(address, pmx[0], pmx[1], **pmx[2]), zip(prompts, max_tokens, extra, strict=True)
            )
        )


def worker_info(address: str, role: str) -> common_pb2.WorkerInfo:
    channel = open_channel(address)  # workers speak mTLS when the deployment configures it
    stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
    return stub.GetInfo(worker_pb2.InfoRequest(), timeout=10)


def wait_idle(workers: list[tuple[str, str]], timeout: float = 30) -> list[common_pb2.WorkerInfo]:
    """Poll until every worker holds no KV block and no request; return their final infos."""
    deadline = time.monotonic() + timeout
    while True:
        infos = [worker_info(address, role) for role, address in workers]
        if all(i.kv_blocks_used == 0 and i.running_requests == 0 and i.queue_depth == 0 for i in infos):
            return infos
        if time.monotonic() > deadline:
            raise AssertionError(f"workers not idle: {infos}")
        time.sleep(0.2)


_WORKLOADS: dict[tuple[object, ...], tuple[list[str], list[int], list[list[int]]]] = {}


def greedy_workload(
    model_dir: object, n: int, prompt_seed: int = 12, length_seed: int = 3, lengths: tuple[int, int] = (60, 120)
) -> tuple[list[str], list[int], list[list[int]]]:
    """`n` prompts, output lengths drawn from `lengths` (long enough to be running during a role
    switch, a migration or a removal), and their greedy outputs from the engine in this process.
    A tiny random model has near-ties between logits, where the batch a sequence runs in can flip a
    greedy token; the workload is checked to have none (each request run alone gives its batched
    output), so any difference a test sees is the system's. Computed once per test session for the
    same arguments (the modules that use it only read it)."""
    key = (str(model_dir), n, prompt_seed, length_seed, lengths)
    if key not in _WORKLOADS:
        _WORKLOADS[key] = _greedy_workload(model_dir, n, prompt_seed, length_seed, lengths)
    return _WORKLOADS[key]


def _greedy_workload(
    model_dir: object, n: int, prompt_seed: int, length_seed: int, lengths: tuple[int, int]
) -> tuple[list[str], list[int], list[list[int]]]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_loader import load_model
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.tokenization import encode_text

    loaded = load_model(model_dir)
    prompts = mixed_prompts(n, seed=prompt_seed)
    rng = random.Random(length_seed)
    max_tokens = [rng.randint(*lengths) for _ in prompts]
    ids = [encode_text(loaded.tokenizer, p) for p in prompts]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    engine = LLMEngine(loaded, EngineConfig(num_blocks=1024))
    expected = engine.generate(ids, params)
    engine.pool.assert_all_free()
    for i in range(n):
        alone = LLMEngine(loaded, EngineConfig(num_blocks=1024)).generate([ids[i]], [params[i]])[0]
        assert alone == expected[i], f"workload has a batch-dependent near-tie at request {i}: pick another seed"
    return prompts, max_tokens, expected


def _stream_into(address: str, prompt: str, max_tokens: int, first: threading.Event, out: list) -> None:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    request = router_pb2.GenerateRequest(
        prompt=prompt, params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    try:
        for response in stub.Generate(request, timeout=300):
            out.extend(response.token_ids)
            if response.token_ids:
                first.set()
    except grpc.RpcError as exc:  # recorded: the assertion names it
        out.append(f"{exc.code().name}: {exc.details()}")


class Streams:
    """A `greedy_workload`'s streams through a router, each in a thread; the constructor returns once
    8 have their first token, `check()` joins them and compares every token with the expected output."""

    def __init__(self, address: str, workload: tuple[list[str], list[int], list[list[int]]]) -> None:
        self.prompts, max_tokens, self.expected = workload
        self.outputs: list[list] = [[] for _ in self.prompts]
        self.started = [threading.Event() for _ in self.prompts]
        self.threads = [
            threading.Thread(target=_stream_into, args=(address, p, m, e, o))
            for p, m, e, o in zip(self.prompts, max_tokens, self.started, self.outputs, strict=True)
        ]
        for t in self.threads:
            t.start()
        for event in self.started[:8]:
            assert event.wait(120), "streams did not start"

    def check(self) -> None:
        for t in self.threads:
            t.join(300)
        for i, (got, want) in enumerate(zip(self.outputs, self.expected, strict=True)):
            assert got == want, f"stream {i} differs (prompt {self.prompts[i][:30]!r})"


def _ray_children() -> list[Any]:
    """This process's child processes that belong to Ray (GCS, raylets, their workers, the reaper):
    a Ray instance this test process started and has not finished stopping."""
    import ray  # noqa: F401, I001 - first: it puts its bundled psutil on the path
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "ray::" in command or "/ray/" in command:  # Ray's binaries and scripts live in its package
            found.append(child)
    return found


def start_ray(start: Callable[[], T], attempts: int = 2, pause_s: float = 10.0) -> T:
    """`start()` (ray.init, or a ray.cluster_utils.Cluster built with its nodes) for a test module's
    own Ray. On this 2-core machine a node can time out while starting, most often while the previous
    module's instance is still stopping; that is start-up, not the behaviour under test. So the
    previous instance's processes get up to 30 s to end first, and a start that times out is
    cleaned up (what it left running is killed) and tried once more
    (`pdserve.cluster.ray_cluster.start_with_retry`, which `pdserve serve --ray` uses too)."""
    import ray  # noqa: F401, I001 - first: it puts its bundled psutil on the path
    import psutil

    from pdserve.cluster.ray_cluster import start_with_retry

    def kill_leftovers() -> None:
        left = _ray_children()
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(left, timeout=30)

    psutil.wait_procs(_ray_children(), timeout=30)
    return start_with_retry(start, attempts, pause_s, cleanup=kill_leftovers)


def init_local_ray(num_cpus: int, attempts: int = 2) -> None:
    """ray.init of a test module's own local Ray instance (through `start_ray`)."""
    import ray

    start_ray(lambda: ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False), attempts)


@contextlib.contextmanager
def multinode_ray(head_args: dict[str, Any], nodes: list[dict[str, Any]], namespace: str) -> Iterator[Any]:
    """A `ray.cluster_utils.Cluster` of a head and `nodes` on this machine (through `start_ray`),
    with this process connected to it in `namespace`; shut down on leaving."""
    import ray
    from ray.cluster_utils import Cluster

    def build() -> Cluster:
        c = Cluster(initialize_head=True, head_node_args={**head_args, "include_dashboard": False})
        try:
            for args in nodes:
                c.add_node(**args)
            c.wait_for_nodes()
        except BaseException:
            c.shutdown()
            raise
        return c

    c = start_ray(build)
    try:
        ray.init(address=c.address, namespace=namespace, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def checkout_env() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (for CLI subprocesses)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m pdserve.cluster.cli ARGS` from the checkout, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=checkout_env(),
        cwd=REPO,
    )


def router_status(address: str) -> list[dict[str, object]]:
    """`pdserve status`'s rows for the router at `address`."""
    from pdserve.cluster.client import PdserveClient, status_rows

    with PdserveClient(address, 10.0) as client:
        return status_rows(client.status())
