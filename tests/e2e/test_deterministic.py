"""--deterministic (batch-invariant mode), real processes on loopback with a tiny random Llama: a
request's tokens are the same alone and beside 15 other requests, colocated, in 1P1D and in 2P2D, after
kill -9 of the decode worker that runs it, and after a live migration, in float32 and bfloat16, greedy
and seeded sampling; and they are what an engine in this process (another thread count) gives.

A random-weight model's logits are nearly flat, so a changed summation order flips tokens easily: the
model is a good detector here. Decode workers sleep before each step (PDSERVE_INJECT_STEP_DELAY_MS) in
the failover test, so that the stream is still running when the test acts."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from injection import injected

from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster, WorkerProcess
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_text
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from e2e_helpers import generate, mixed_prompts, wait_idle, worker_info

pytestmark = pytest.mark.slow

TARGET = "the old mill by the river turned all winter while the children of the market sang " * 2
MAX_TOKENS = 24
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 77}
OTHERS = mixed_prompts(15, seed=5)
#: what the other requests ask: a mix of greedy and sampled rows of other widths beside the target
OTHER_PARAMS = [{} if i % 3 else {"temperature": 1.0, "top_k": 5 + i, "seed": i} for i in range(15)]
TOPOLOGIES = {
    "colocated": {"prefill": 0, "decode": 0, "colocated": 1},
    "1p1d": {"prefill": 1, "decode": 1},
    "2p2d": {"prefill": 2, "decode": 2},
}

_EXPECTED: dict[tuple[str, str], tuple[list[int], list[int]]] = {}


def _expected(model_dir: Path, dtype: str) -> tuple[list[int], list[int]]:
    """(greedy, seeded) tokens of TARGET alone, from a deterministic engine in this process (whose torch
    threads differ from the workers' one)."""
    if (str(model_dir), dtype) not in _EXPECTED:
        loaded = load_model(model_dir, getattr(torch, dtype))
        engine = LLMEngine(loaded, EngineConfig(dtype=dtype, num_blocks=256, deterministic=True))
        ids = encode_text(loaded.tokenizer, TARGET)
        runs = [
            engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **p))[0]  # type: ignore[arg-type]
            for p in ({}, SEEDED)
        ]
        engine.pool.assert_all_free()
        _EXPECTED[(str(model_dir), dtype)] = (runs[0], runs[1])
    return _EXPECTED[(str(model_dir), dtype)]


def _target_beside_others(address: str, params: dict[str, object]) -> list[int]:
    """TARGET's tokens when it arrives in the middle of 15 other requests, all at once."""
    prompts = OTHERS[:7] + [TARGET] + OTHERS[7:]
    extra = OTHER_PARAMS[:7] + [params] + OTHER_PARAMS[7:]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(
            pool.map(
                lambda pe: generate(address, pe[0], MAX_TOKENS, ignore_eos=True, **pe[1]),
                zip(prompts, extra, strict=True),
            )
        )
    return results[7].token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_gets_the_same_tokens_alone_beside_others_and_in_every_topology(
    tiny_llama_dir: Path, dtype: str
) -> None:
    greedy, seeded = _expected(tiny_llama_dir, dtype)
    assert greedy != seeded  # the sampled run drew, so seeded sampling is under test too
    for name, sizes in TOPOLOGIES.items():
        config = local_deployment(
            model=str(tiny_llama_dir), threads_per_worker=1, dtype=dtype, deterministic=True, **sizes
        )
        with LocalCluster(config) as cluster:
            for params, expected in (({}, greedy), (SEEDED, seeded)):
                alone = generate(cluster.router_address, TARGET, MAX_TOKENS, ignore_eos=True, **params).token_ids
                assert alone == expected, (name, params)
                assert _target_beside_others(cluster.router_address, params) == expected, (name, params)
            infos = [worker_info(w.address, w.role) for w in cluster.workers]
            assert all(i.kernels.startswith("deterministic") for i in infos), [i.kernels for i in infos]
            wait_idle([(w.role, w.address) for w in cluster.workers])


def _stream(address: str, request_id: str, params: dict[str, object]) -> Iterator[router_pb2.GenerateResponse]:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    request = router_pb2.GenerateRequest(
        request_id=request_id,
        prompt=TARGET,
        params=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params),
    )  # type: ignore[arg-type]
    return iter(stub.Generate(request, timeout=300))


def _running_on(cluster: LocalCluster) -> WorkerProcess:
    """The decode worker that runs the one request in flight."""
    decoders = [w for w in cluster.workers if w.role == "decode"]
    return next(w for w in decoders if worker_info(w.address, "decode").running_requests)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_failover_and_migration_keep_the_tokens_of_an_undisturbed_run(tiny_llama_dir: Path, dtype: str) -> None:
    greedy, seeded = _expected(tiny_llama_dir, dtype)
    config = local_deployment(
        model=str(tiny_llama_dir), prefill=1, decode=2, threads_per_worker=1, dtype=dtype, deterministic=True
    )
    with (
        injected(step_delay_ms=60),
        LocalCluster(config, LaunchOptions(decode_args=("--kv-timeout-s", "20"))) as cluster,
    ):
        for action, (params, expected) in (("migrate", ({}, greedy)), ("kill", (SEEDED, seeded))):
            responses, tokens = _stream(cluster.router_address, f"det-{action}", params), []
            while len(tokens) < 6:  # mid-stream
                tokens += next(responses).token_ids
            source = _running_on(cluster)
            if action == "migrate":
                target = next(w for w in cluster.workers if w.role == "decode" and w is not source)
                stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
                stub.Migrate(
                    router_pb2.MigrateRequest(request_id=f"det-{action}", to_worker_id=target.worker_id), timeout=60
                )
            else:
                os.kill(source.pid, signal.SIGKILL)
            for response in responses:
                tokens += response.token_ids
            assert tokens == expected, action
        wait_idle([(w.role, w.address) for w in cluster.workers if w.pid != source.pid])
