"""Chunked prefill and the prefix cache on a real prefill worker: same tokens, nothing leaked.

The token-equality and block-count tests serve a tiny random Llama (the default model's tokenizer, so
prompts have the same token counts and share the same blocks): what they check is the prefill worker's
bookkeeping, which no model property changes, and each saved the default model's load in two worker
processes. Eviction keeps the default model (its 8 MiB pool holds only a few of its large blocks) and so
does the short-prompt test (only the default model's passes are long enough to go between)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from waiting import eventually

from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_text

from e2e_helpers import generate, wait_idle, worker_info

SHARED = "You are a careful assistant. Answer briefly and precisely. " * 12


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def _expected(loaded: LoadedModel, prompts: list[str], max_tokens: int) -> list[list[int]]:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=1024))
    ids = [encode_text(loaded.tokenizer, p) for p in prompts]
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_chunked_prefill_and_prefix_hits_give_the_same_tokens(tiny_llama_dir: Path, tiny_llama: LoadedModel) -> None:
    prompts = [SHARED + q for q in ("What is a river?", "Name a sea.", "What is flour?", "Who was the miller?")]
    expected = _expected(tiny_llama, prompts, 6)
    config = local_deployment(model=str(tiny_llama_dir), prefill=1, decode=1, threads_per_worker=1)
    with LocalCluster(config, LaunchOptions(prefill_args=("--prefill-chunk-tokens", "48"))) as cluster:
        roles = [(w.role, w.address) for w in cluster.workers]
        prefill = dict(roles)["prefill"]
        first = generate(cluster.router_address, prompts[0], 6, ignore_eos=True)
        assert worker_info(prefill, "prefill").prefix_cache_hit_blocks == 0
        rest = [generate(cluster.router_address, p, 6, ignore_eos=True) for p in prompts[1:]]
        assert [r.token_ids for r in [first, *rest]] == expected
        info = worker_info(prefill, "prefill")
        assert info.prefix_cache_hit_blocks >= 3 * 8  # the shared prefix spans many full blocks
        assert info.prefill_tokens_computed < sum(len(encode_text(tiny_llama.tokenizer, p)) for p in prompts)
        wait_idle(roles)


def test_short_prompt_is_not_stuck_behind_a_long_one() -> None:
    config = local_deployment(prefill=1, decode=1, threads_per_worker=1)
    options = LaunchOptions(prefill_args=("--prefill-chunk-tokens", "64", "--no-prefix-caching"))
    with LocalCluster(config, options) as cluster:
        finished: list[str] = []
        lock = threading.Lock()

        def run(name: str, prompt: str) -> None:
            generate(cluster.router_address, prompt, 1)
            with lock:
                finished.append(name)

        with ThreadPoolExecutor(2) as pool:
            # ~600 tokens: ten chunks of 64, each a separate pass the short prompt can go between
            long = pool.submit(run, "long", "The river ran past the old mill at evening. " * 60)
            prefill = [w.address for w in cluster.workers if w.role == "prefill"][0]
            # the long prompt is being prefilled, chunk by chunk (polled, not spun: 2 cores)
            eventually(
                lambda: worker_info(prefill, "prefill").queue_depth > 0 or long.done(),
                120,
                interval=0.01,
                what="the long prompt in the prefill queue",
            )
            pool.submit(run, "short", "Hello there").result()
            long.result()
        assert finished == ["short", "long"]


def test_eviction_under_pressure_leaks_nothing(default_model) -> None:  # noqa: ANN001
    prompts = [f"Story number {i}: " + "the mill and the river and the sea " * 20 for i in range(12)]
    expected = _expected(default_model, prompts, 3)
    config = local_deployment(prefill=1, decode=1, threads_per_worker=1)
    with LocalCluster(config, LaunchOptions(prefill_args=("--kv-cache-mb", "8"))) as cluster:
        roles = [(w.role, w.address) for w in cluster.workers]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: generate(cluster.router_address, p, 3, ignore_eos=True), prompts))
        assert [r.token_ids for r in results] == expected
        infos = wait_idle(roles)
        prefill = [i for i in infos if i.kv_blocks_total and i.prefix_cache_blocks][0]
        assert prefill.prefix_cache_blocks <= prefill.kv_blocks_total and prefill.kv_blocks_used == 0


def test_layer_wise_streaming_gives_the_same_tokens(tiny_llama_dir: Path, tiny_llama: LoadedModel) -> None:
    prompts = [SHARED + "Tell me about the sea.", "Hello", "The capital of France is " * 30]
    expected = _expected(tiny_llama, prompts, 6)
    config = local_deployment(model=str(tiny_llama_dir), prefill=1, decode=1, threads_per_worker=1)
    options = LaunchOptions(
        prefill_args=("--kv-streaming", "layer", "--prefill-chunk-tokens", "64"), decode_args=("--kv-backend", "grpc")
    )
    with LocalCluster(config, options) as cluster:
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda p: generate(cluster.router_address, p, 6, ignore_eos=True), prompts))
        assert [r.token_ids for r in results] == expected
        roles = [(w.role, w.address) for w in cluster.workers]
        wait_idle(roles)
        address = dict(roles)
        sent = worker_info(address["prefill"], "prefill").kv_bytes_sent
        assert sent > 0 and sent == worker_info(address["decode"], "decode").kv_bytes_received


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize(("backend", "streaming"), [("shm", "request"), ("grpc", "layer")])
def test_decode_worker_receives_only_the_blocks_it_lacks(
    tiny_llama_dir: Path, tiny_llama: LoadedModel, backend: str, streaming: str
) -> None:
    prompts = [SHARED + "What is a river?", SHARED + "Name a sea, please."]
    ids = [encode_text(tiny_llama.tokenizer, p) for p in prompts]
    expected = _expected(tiny_llama, prompts, 6)
    block_bytes = tiny_llama.kv_shape(16).bytes_per_block
    config = local_deployment(model=str(tiny_llama_dir), prefill=1, decode=1, threads_per_worker=1)
    options = LaunchOptions(prefill_args=("--kv-streaming", streaming), decode_args=("--kv-backend", backend))
    with LocalCluster(config, options) as cluster:
        roles = [(w.role, w.address) for w in cluster.workers]
        decode = dict(roles)["decode"]
        received = []
        for prompt in prompts:
            before = worker_info(decode, "decode").kv_bytes_received
            result = generate(cluster.router_address, prompt, 6, ignore_eos=True)
            received.append((result.token_ids, worker_info(decode, "decode").kv_bytes_received - before))
        assert [tokens for tokens, _ in received] == expected
        reused = min(_common_prefix(ids[0], ids[1]) // 16, (len(ids[1]) - 1) // 16)
        assert reused >= 8
        assert received[0][1] == blocks_for_tokens(len(ids[0]), 16) * block_bytes
        assert received[1][1] == (blocks_for_tokens(len(ids[1]), 16) - reused) * block_bytes
        assert worker_info(decode, "decode").prefix_cache_hit_blocks == reused
        wait_idle(roles)
