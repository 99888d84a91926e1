"""KV-aware routing end to end (real processes, 1 prefill + 2 decode workers): the router learns from the
workers' KV events where a prompt's blocks are, sends a follow-up turn to the decode worker holding its
history and lets that worker prefill the few new tokens itself (conditional disaggregation), while a new
prompt still goes through the prefill worker; greedy output equals the engine's in this process whatever
the routing decides.

It serves a tiny random Llama with the default model's tokenizer (tests/conftest.py): the prompts have
the same token counts and blocks, and routing reads blocks and token counts, not the weights; it saves the
default model's load in three worker processes."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from waiting import eventually

from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_text
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from e2e_helpers import worker_info

THRESHOLD = 48  # --conditional-disagg-tokens
HISTORY = (
    "The old mill stood by the river, and every morning the miller walked along the bank to "
    "count the boats that passed. "
) * 6
FOLLOW_UP = HISTORY + "What did he count?"
FRESH = (
    "A recipe for bread: flour, water, salt and yeast, mixed and left to rise overnight in a warm "
    "kitchen before baking. "
) * 6


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    config = local_deployment(
        model=str(tiny_llama_dir),
        prefill=1,
        decode=2,
        threads_per_worker=1,
        metrics=True,
        prefill_policy="kv_aware",
        decode_policy="kv_aware",
    )
    options = LaunchOptions(router_args=("--conditional-disagg-tokens", str(THRESHOLD)))
    with LocalCluster(config, options) as started:
        yield started


def _traced(address: str, prompt: str, max_tokens: int) -> tuple[list[int], common_pb2.TraceRoute]:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    request = router_pb2.GenerateRequest(
        prompt=prompt, trace=True, params=common_pb2.SamplingParams(max_tokens=max_tokens)
    )
    responses = list(stub.Generate(request, timeout=300))
    routes = [e.route for r in responses for e in r.trace if e.HasField("route")]
    assert len(routes) == 1, routes
    return [t for r in responses for t in r.token_ids], routes[0]


def _gauge(metrics_address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_follow_up_goes_where_its_blocks_are_and_prefills_there(cluster: LocalCluster, tiny_llama: LoadedModel) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    tokenizer = tiny_llama.tokenizer
    engine = LLMEngine(tiny_llama, EngineConfig(num_blocks=512))
    expected = engine.generate(
        [encode_text(tokenizer, p) for p in (HISTORY, FOLLOW_UP, FRESH)], [SamplingParams(max_tokens=6)] * 3
    )
    router_metrics = cluster.metrics_addresses["router"]
    prefill = next(w[2] for w in cluster.workers if w[0] == "prefill")

    first, route = _traced(cluster.router_address, HISTORY, 6)
    assert first == expected[0]
    assert route.decision == "disaggregated" and route.decode_cached_tokens == 0 and route.prefill_worker
    history_blocks = (len(encode_text(tokenizer, HISTORY)) - 1) // 16
    # both the prefill worker and the decode worker now hold the history's blocks: the index hears it
    eventually(lambda: _gauge(router_metrics, "pdserve_kv_index_entries") >= 2 * history_blocks, 30)

    computed = worker_info(prefill, "prefill").prefill_tokens_computed
    follow, follow_route = _traced(cluster.router_address, FOLLOW_UP, 6)
    assert follow == expected[1]
    assert follow_route.decision == "local_cached", follow_route
    assert follow_route.decode_worker == route.decode_worker  # where the history's blocks are
    assert follow_route.decode_cached_tokens >= 16 * history_blocks
    assert follow_route.prompt_tokens - follow_route.decode_cached_tokens < THRESHOLD
    assert worker_info(prefill, "prefill").prefill_tokens_computed == computed  # nothing went to the prefill pool

    fresh, fresh_route = _traced(cluster.router_address, FRESH, 6)
    assert fresh == expected[2]
    assert fresh_route.decision == "disaggregated" and fresh_route.decode_cached_tokens == 0
    assert worker_info(prefill, "prefill").prefill_tokens_computed > computed
