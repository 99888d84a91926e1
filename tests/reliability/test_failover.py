"""Worker failures with real processes: every accepted request completes with the tokens of an
undisturbed run, and every pool is full again afterwards.

Where the failure is a worker's death or a broken transfer, the workers serve a tiny random Llama (the
point is the failover path, not the model) and decode workers sleep before each step
(PDSERVE_INJECT_STEP_DELAY_MS) so that streams are still running when the test acts: the default
model's load and compute in every process made these tests the suite's slowest. The overload test runs
so too: with the step delay a request of 4 tokens stays in flight for 160 ms or more, far longer than
its 40 requests take to arrive, so the router's slots and queue fill as they did with the default model.
The prefill-kill test keeps the default model: its prefill passes are what keep prompts queued long
enough to kill a prefill worker holding them."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from injection import injected

from pdserve.cluster.deploy_config import DeploymentConfig
from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_text

from e2e_helpers import generate, mixed_prompts, wait_idle, worker_info

#: Every other request of the decode-kill test carries penalties: their state must be rebuilt
#: exactly from the tokens on the worker that takes the request over.
PENALTIES = {"repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2}
#: The decode workers' sleep before each step with the tiny model: a 40-token stream lasts 1.6 s or more.
STEP_DELAY_MS = 40


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def _tiny_deployment(tiny_llama_dir: Path, prefill: int = 1, decode: int = 1) -> DeploymentConfig:
    return local_deployment(model=str(tiny_llama_dir), prefill=prefill, decode=decode, threads_per_worker=1)


def _penalties(i: int, penalized: bool) -> dict[str, float]:
    return PENALTIES if penalized and i % 2 == 0 else {}


_EXPECTED: dict[tuple[object, ...], list[list[int]]] = {}


def _expected(loaded: LoadedModel, prompts: list[str], max_tokens: int, penalized: bool = False) -> list[list[int]]:
    """The engine's outputs in this process; computed once per module for the same arguments (both
    router transports of the decode-kill test compare with the same run)."""
    key = (id(loaded), tuple(prompts), max_tokens, penalized)
    if key not in _EXPECTED:
        _EXPECTED[key] = _compute_expected(loaded, prompts, max_tokens, penalized)
    return [list(tokens) for tokens in _EXPECTED[key]]


def _compute_expected(loaded: LoadedModel, prompts: list[str], max_tokens: int, penalized: bool) -> list[list[int]]:
    engine = LLMEngine(loaded, EngineConfig(num_blocks=1024))
    ids = [encode_text(loaded.tokenizer, p) for p in prompts]
    out = engine.generate(
        ids,
        [
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, **_penalties(i, penalized))
            for i in range(len(prompts))
        ],
    )
    engine.pool.assert_all_free()
    return out


def _live(cluster: LocalCluster, dead: set[int] = frozenset()) -> list[tuple[str, str]]:  # type: ignore[assignment]
    return [(w.role, w.address) for w in cluster.workers if w.pid not in dead]


def _run_all(address: str, prompts: list[str], max_tokens: int, penalized: bool = False) -> list:  # noqa: ANN401
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(
                lambda ip: generate(address, ip[1], max_tokens, ignore_eos=True, **_penalties(ip[0], penalized)),
                enumerate(prompts),
            )
        )


@pytest.mark.parametrize("router_args", [(), ("--decode-mux",)], ids=["generate", "mux"])
def test_decode_worker_killed_mid_stream(
    tiny_llama_dir: Path, tiny_llama: LoadedModel, router_args: tuple[str, ...]
) -> None:
    # with --decode-mux the victim's GenerateMux stream carries all its requests: its end fails them
    # all over at once
    prompts = mixed_prompts(20, seed=21)
    expected = _expected(tiny_llama, prompts, 40, penalized=True)
    with (
        injected(step_delay_ms=STEP_DELAY_MS),
        LocalCluster(_tiny_deployment(tiny_llama_dir, decode=2), LaunchOptions(router_args=router_args)) as cluster,
    ):
        victim = [w for w in cluster.workers if w.role == "decode"][0]
        with ThreadPoolExecutor(1) as bg:
            pending = bg.submit(_run_all, cluster.router_address, prompts, 40, True)
            deadline = time.monotonic() + 120
            while worker_info(victim.address, "decode").running_requests < 3:  # mid-stream, holding requests
                assert time.monotonic() < deadline and not pending.done()
                time.sleep(0.05)
            os.kill(victim.pid, signal.SIGKILL)
            results = pending.result(timeout=600)
        assert [r.token_ids for r in results] == expected
        wait_idle(_live(cluster, {victim.pid}))


def test_prefill_worker_killed_during_prefill(default_model) -> None:  # noqa: ANN001
    prompts = [p + " and the long story goes on" * 40 for p in mixed_prompts(8, seed=4)]
    expected = _expected(default_model, prompts, 6)
    with LocalCluster(local_deployment(prefill=2, decode=1, threads_per_worker=1)) as cluster:
        victim = [w for w in cluster.workers if w.role == "prefill"][0]
        with ThreadPoolExecutor(1) as bg:
            pending = bg.submit(_run_all, cluster.router_address, prompts, 6)
            deadline = time.monotonic() + 120
            while worker_info(victim.address, "prefill").queue_depth < 1:  # prompts queued there
                assert time.monotonic() < deadline and not pending.done()
                time.sleep(0.02)
            os.kill(victim.pid, signal.SIGKILL)
            results = pending.result(timeout=600)
        assert [r.token_ids for r in results] == expected
        wait_idle(_live(cluster, {victim.pid}))


@pytest.mark.parametrize("fault", ["stall", "corrupt"])
def test_broken_kv_transfer_is_prefilled_again(fault: str, tiny_llama_dir: Path, tiny_llama: LoadedModel) -> None:
    prompts = mixed_prompts(4, seed=8)
    expected = _expected(tiny_llama, prompts, 8)
    config = _tiny_deployment(tiny_llama_dir)
    options = LaunchOptions(decode_args=("--kv-timeout-s", "4", "--kv-backend", "grpc"))
    with injected(kv_fault=fault, kv_fault_count=2), LocalCluster(config, options) as cluster:
        results = _run_all(cluster.router_address, prompts, 8)
        assert [r.token_ids for r in results] == expected
        wait_idle(_live(cluster))


def test_no_decode_worker_left_gives_unavailable_not_a_hang(tiny_llama_dir: Path) -> None:
    with LocalCluster(_tiny_deployment(tiny_llama_dir)) as cluster:
        decode = [w for w in cluster.workers if w.role == "decode"][0]
        os.kill(decode.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            generate(cluster.router_address, "Hello", 4, timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_overload_queues_then_sheds_beyond_the_bounded_queue(tiny_llama_dir: Path, tiny_llama: LoadedModel) -> None:
    capacity, queued = 4, 8
    prompts = mixed_prompts(10 * capacity, seed=13)
    expected = _expected(tiny_llama, prompts, 4)
    config = _tiny_deployment(tiny_llama_dir)
    options = LaunchOptions(
        router_args=("--max-concurrent-streams", str(capacity), "--max-queued-requests", str(queued))
    )
    with injected(step_delay_ms=STEP_DELAY_MS), LocalCluster(config, options) as cluster:

        def attempt(i: int) -> object:
            try:
                return generate(cluster.router_address, prompts[i], 4, ignore_eos=True)
            except grpc.RpcError as exc:
                return exc

        with ThreadPoolExecutor(len(prompts)) as pool:
            outcomes = list(pool.map(attempt, range(len(prompts))))
        refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
        served = [(i, o) for i, o in enumerate(outcomes) if not isinstance(o, grpc.RpcError)]
        assert refused and len(served) >= capacity + queued  # the queue absorbed what did not fit at once
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in e.details() for e in refused)
        assert all(o.token_ids == expected[i] for i, o in served)  # type: ignore[attr-defined]
        wait_idle(_live(cluster))


def test_sigterm_drains_a_decode_worker(tiny_llama_dir: Path, tiny_llama: LoadedModel) -> None:
    prompt = "Tell me a story about the old mill by the river"
    expected = _expected(tiny_llama, [prompt], 40)[0]
    with injected(step_delay_ms=STEP_DELAY_MS), LocalCluster(_tiny_deployment(tiny_llama_dir)) as cluster:
        decode = [w for w in cluster.workers if w.role == "decode"][0]
        with ThreadPoolExecutor(1) as bg:
            pending = bg.submit(generate, cluster.router_address, prompt, 40, 300, ignore_eos=True)
            deadline = time.monotonic() + 60
            while worker_info(decode.address, "decode").running_requests < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(decode.pid, signal.SIGTERM)  # the only decode worker: only draining can finish it
            assert pending.result(timeout=120).token_ids == expected
