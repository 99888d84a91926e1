"""The prefill worker in process, on the shared engine, against a real gRPC KV receiver: what it
ships equals what a colocated engine computes, a failing forward pass under layer-wise streaming
frees every block exactly once, and a poisoned prompt fails alone."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
import torch

from pdserve.engine.block_pool import BlockPool, blocks_for_tokens
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.model_runner import StepInput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.base import ExpectOptions
from pdserve.kv_transfer.grpc_backend import KvTransferServicer, grpc_message_options
from pdserve.prefill_worker.worker import PrefillJob, PrefillWorker

GREEDY = SamplingParams(max_tokens=4)
PREFIX = list(range(10, 58))  # three full blocks of 16


@pytest.fixture
def receiver() -> Iterator[tuple[KvTransferServicer, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=grpc_message_options())
    servicer = KvTransferServicer()
    servicer.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.close()
    server.stop(grace=None)


class DoubleFreeSpy:
    """Wraps `pool.free` and records every double free it raised, whichever thread it ran on."""

    def __init__(self, pool: BlockPool) -> None:
        self.errors: list[str] = []
        self._free = pool.free
        pool.free = self  # type: ignore[method-assign]

    def __call__(self, blocks: list[int]) -> None:
        try:
            self._free(blocks)
        except ValueError as exc:
            self.errors.append(str(exc))
            raise


@pytest.fixture
def make_worker(tiny_llama: LoadedModel) -> Iterator[Callable[..., PrefillWorker]]:
    workers: list[PrefillWorker] = []

    def factory(**options: object) -> PrefillWorker:
        worker = PrefillWorker(tiny_llama, EngineConfig(num_blocks=64), transfer_timeout_s=20, **options)  # type: ignore[arg-type]
        workers.append(worker)
        return worker

    yield factory
    for worker in workers:
        worker.stop()


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir) -> LoadedModel:  # noqa: ANN001
    from pdserve.engine.model_loader import load_model

    return load_model(tiny_llama_dir)


def _reference(loaded: LoadedModel, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """The prompt's K/V blocks and greedy first token, from one whole-prompt pass of a plain engine.
    (Call it while no worker computes: the paged-attention context is one per process.)"""
    engine = LLMEngine(loaded, EngineConfig(num_blocks=16))
    blocks = engine.pool.allocate(blocks_for_tokens(len(prompt), 16))
    logits = engine.runner.forward([StepInput(prompt, 0, blocks)])
    return engine.kv_cache.gather(blocks), int(logits[0].argmax())


def _submit(worker: PrefillWorker, receiver: KvTransferServicer, address: str, request_id: str, prompt: list[int]):  # noqa: ANN202
    job = PrefillJob(request_id=request_id, prompt_ids=prompt, params=GREEDY, kv_target=address, kv_backend="grpc")
    pending = receiver.expect(worker.spec_for(job), ExpectOptions(30))
    return worker.submit(job), pending


def _wait_idle(worker: PrefillWorker) -> None:
    worker.loop.call(lambda: None).result(timeout=30)  # releases posted before this have run
    for _ in range(200):
        if worker.idle():
            return
        worker.loop.call(lambda: None).result(timeout=30)
    raise AssertionError("prefill worker not idle")


@pytest.mark.parametrize("streaming", ["request", "layer"])
def test_shipped_kv_and_first_tokens_match_a_whole_prompt_pass(
    make_worker, receiver, tiny_llama, streaming: str
) -> None:  # noqa: ANN001
    servicer, address = receiver
    prompts = {"a": PREFIX + [7, 8, 9], "b": PREFIX + [60, 61, 62, 63, 64], "c": list(range(200, 230))}
    expected = {rid: _reference(tiny_llama, prompt) for rid, prompt in prompts.items()}
    worker = make_worker(prefill_chunk_tokens=20, prefix_caching=True, kv_streaming=streaming)
    first = {"a": _submit(worker, servicer, address, "a", prompts["a"])}
    first["a"][0].result(timeout=60)  # "a"'s full blocks are cached before "b" arrives
    submitted = {**first, **{rid: _submit(worker, servicer, address, rid, prompts[rid]) for rid in ("b", "c")}}
    for rid, (future, pending) in submitted.items():
        result = future.result(timeout=60)
        kv, _ = pending.wait(timeout=30)
        expected_kv, expected_token = expected[rid]
        assert result.first_token_id == expected_token, rid
        torch.testing.assert_close(kv, expected_kv, rtol=1e-5, atol=1e-5)
    _wait_idle(worker)
    worker.pool.assert_all_free()
    assert worker.runner.num_prefill_tokens < sum(len(p) for p in prompts.values())  # "b" reused "a"'s blocks


def test_forward_failure_under_layer_streaming_frees_each_block_once(
    make_worker, receiver, tiny_llama, monkeypatch
) -> None:  # noqa: ANN001
    servicer, address = receiver
    prompt = PREFIX + [3, 4, 5]
    expected_kv, expected_token = _reference(tiny_llama, prompt)
    worker = make_worker(kv_streaming="layer")
    spy = DoubleFreeSpy(worker.pool)
    forward = worker.runner.forward
    calls = []

    def failing_forward(items: list[StepInput], on_layer_done=None) -> torch.Tensor:  # noqa: ANN001
        calls.append(len(items))
        if len(calls) == 1:  # the first pass: one layer streams out, then the pass breaks
            assert on_layer_done is not None, "the pass completing the prompt must stream layers"
            on_layer_done(0)
            raise RuntimeError("injected forward failure")
        return forward(items, on_layer_done=on_layer_done)

    monkeypatch.setattr(worker.runner, "forward", failing_forward)
    future, pending = _submit(worker, servicer, address, "broken", PREFIX + [1, 2])
    with pytest.raises(Exception, match="injected forward failure|prefill failed"):
        future.result(timeout=60)
    pending.cancel("prefill failed")  # what the decode worker does when its Prefill call fails
    # the blocks it held go round again: a later prompt uses them and ships correct K/V
    future, pending = _submit(worker, servicer, address, "after", prompt)
    assert future.result(timeout=60).first_token_id == expected_token
    torch.testing.assert_close(pending.wait(timeout=30)[0], expected_kv, rtol=1e-5, atol=1e-5)
    _wait_idle(worker)
    assert spy.errors == []
    worker.pool.assert_all_free()
    assert worker.engine.sequences == {} and not worker.engine.has_work


def test_a_poisoned_prompt_fails_alone_in_a_shared_pass(make_worker, receiver, tiny_llama, monkeypatch) -> None:  # noqa: ANN001
    servicer, address = receiver
    good = {"g1": list(range(20, 45)), "g2": list(range(300, 310)), "g3": PREFIX}
    expected = {rid: _reference(tiny_llama, prompt)[1] for rid, prompt in good.items()}
    worker = make_worker()
    forward = worker.runner.forward
    poison = [999] * 20

    def poisoned_forward(items: list[StepInput], on_layer_done=None) -> torch.Tensor:  # noqa: ANN001
        if any(item.token_ids[: len(poison)] == poison for item in items):
            raise RuntimeError("poisoned prompt")
        return forward(items, on_layer_done=on_layer_done)

    monkeypatch.setattr(worker.runner, "forward", poisoned_forward)
    # held until all are queued, so they share passes with the poisoned one
    gate = worker.loop.call(lambda: time.sleep(0.5))
    submitted = {rid: _submit(worker, servicer, address, rid, p) for rid, p in good.items()}
    bad_future, bad_pending = _submit(worker, servicer, address, "bad", poison)
    gate.result(timeout=30)
    with pytest.raises(RuntimeError, match="poisoned prompt"):
        bad_future.result(timeout=60)
    bad_pending.cancel("test over")
    for rid, (future, pending) in submitted.items():
        assert future.result(timeout=60).first_token_id == expected[rid], rid
        pending.wait(timeout=30)
    _wait_idle(worker)
    worker.pool.assert_all_free()
