"""`usage.prompt_tokens_details.cached_tokens` end to end: real router and worker processes on loopback
(1P1D and colocated) serving a tiny random Llama; a repeated prompt is served from the prefix cache."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cluster.local import LocalCluster, LocalClusterConfig
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

BLOCK_SIZE = 16  # the workers' default --block-size


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["1p1d", "1p1d-decode-cache-only", "colocated"])
def cluster(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    topology = {"1p1d": dict(prefill=1, decode=1), "colocated": dict(prefill=0, decode=0, colocated=1),
                # only the decode worker's reused blocks count: the prefill worker recomputes everything
                "1p1d-decode-cache-only": dict(prefill=1, decode=1, prefill_args=("--no-prefix-caching",))}
    config = LocalClusterConfig(model=str(tiny_llama_dir), threads_per_worker=1, http_port=0,
                                model_name="tiny", **topology[request.param])  # type: ignore[arg-type]
    with LocalCluster(config) as started:
        yield started


def http_completion(cluster: LocalCluster, prompt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    request = urllib.request.Request(f"http://{cluster.http_address}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())["usage"]


def grpc_usage(cluster: LocalCluster, prompt: str) -> common_pb2.Usage:
    request = router_pb2.GenerateRequest(prompt=prompt, params=common_pb2.SamplingParams(max_tokens=3))
    with grpc.insecure_channel(cluster.router_address) as channel:
        return list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))[-1].usage


def test_repeated_prompt_reports_cached_tokens(cluster: LocalCluster) -> None:
    prompt = f"[{cluster.config.prefill}] " + " ".join(f"word{i}" for i in range(40))  # > 3 blocks of tokens
    first = http_completion(cluster, prompt)
    assert first["prompt_tokens"] > 3 * BLOCK_SIZE
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = http_completion(cluster, prompt)
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert second["prompt_tokens"] == first["prompt_tokens"]
    # every full block but the one of the last prompt token (that one is always computed)
    assert cached == (first["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached > 0 and cached % BLOCK_SIZE == 0
    again = grpc_usage(cluster, prompt)  # the gRPC API carries the same field
    assert again.cached_tokens == cached and again.prompt_tokens == first["prompt_tokens"]
    fresh = grpc_usage(cluster, "something else entirely " * 3)
    assert fresh.cached_tokens == 0
