"""End to end, real processes on loopback: router + prefill pool + decode pool on the real model."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from pdserve.cluster.launch import local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_text
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from e2e_helpers import generate, generate_many, mixed_prompts, wait_idle, worker_info

NUM_REQUESTS = 32


def _start(prefill: int, decode: int, colocated: int = 0) -> LocalCluster:
    return LocalCluster(
        local_deployment(model=None, prefill=prefill, decode=decode, colocated=colocated, threads_per_worker=1)
    )


def _roles(cluster: LocalCluster) -> list[tuple[str, str]]:
    return [(w[0], w[2]) for w in cluster.workers]


def _penalties(i: int) -> dict[str, float]:
    """Every fourth request carries penalties (the first token is sampled on the prefill worker,
    the rest on decode: both must apply them alike)."""
    return {"repetition_penalty": 1.25, "frequency_penalty": 0.3, "presence_penalty": 0.2} if i % 4 == 0 else {}


@pytest.fixture(scope="module")
def workload(default_model) -> tuple[list[str], list[int], list[list[int]]]:  # noqa: ANN001
    """32 prompts of mixed lengths and their greedy outputs from the engine in this process
    (every fourth with penalties)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    prompts = mixed_prompts(NUM_REQUESTS, seed=5)
    rng = random.Random(9)
    max_tokens = [rng.randint(2, 16) for _ in prompts]
    engine = LLMEngine(default_model, EngineConfig(num_blocks=1024))
    ids = [encode_text(default_model.tokenizer, p) for p in prompts]
    expected = engine.generate(ids, [SamplingParams(max_tokens=m, **_penalties(i)) for i, m in enumerate(max_tokens)])
    engine.pool.assert_all_free()
    return prompts, max_tokens, expected


@pytest.fixture(scope="module")
def one_p_one_d(default_1p1d: LocalCluster) -> LocalCluster:
    """The session's default-model 1P1D cluster (tests/conftest.py), the same as `_start(1, 1)`."""
    return default_1p1d


@pytest.mark.parametrize("topology", ["1p1d", "2p2d", "colocated"])
def test_outputs_identical_to_engine_in_one_process(topology: str, workload, one_p_one_d) -> None:  # noqa: ANN001
    prompts, max_tokens, expected = workload
    cluster = one_p_one_d if topology == "1p1d" else _start(*{"2p2d": (2, 2), "colocated": (0, 0, 1)}[topology])
    try:
        results = generate_many(
            cluster.router_address, prompts, max_tokens, [_penalties(i) for i in range(len(prompts))]
        )
        for i, (result, want) in enumerate(zip(results, expected, strict=True)):
            assert result.token_ids == want, f"request {i}: {prompts[i][:40]!r}"
        infos = wait_idle(_roles(cluster))
        if topology == "2p2d":  # both pools took part
            assert all(i.requests_finished > 0 for i in infos)
    finally:
        if cluster is not one_p_one_d:
            cluster.stop()


def test_decode_never_prefills_and_kv_goes_worker_to_worker(one_p_one_d) -> None:  # noqa: ANN001
    before = {role: worker_info(address, role) for role, address in _roles(one_p_one_d)}
    result = generate(one_p_one_d.router_address, "Tell me about the river and the old mill " * 20, 8)
    assert len(result.token_ids) == 8
    after = {role: worker_info(address, role) for role, address in _roles(one_p_one_d)}
    assert after["decode"].prefill_tokens_computed == 0  # decode never ran a pass over a prompt
    assert after["prefill"].prefill_tokens_computed > before["prefill"].prefill_tokens_computed + 100
    sent = after["prefill"].kv_bytes_sent - before["prefill"].kv_bytes_sent
    received = after["decode"].kv_bytes_received - before["decode"].kv_bytes_received
    assert sent == received > 0  # the bytes went from P to D; the router has no KV path at all


def test_cancelled_stream_frees_blocks_on_both_sides(one_p_one_d) -> None:  # noqa: ANN001
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(one_p_one_d.router_address))
    request = router_pb2.GenerateRequest(
        prompt="Write a very long story about the sea. " * 30,
        params=common_pb2.SamplingParams(max_tokens=2000, ignore_eos=True),
    )
    call = stub.Generate(request, timeout=120)
    received = [next(call) for _ in range(3)]
    decode = [a for r, a in _roles(one_p_one_d) if r == "decode"][0]
    assert worker_info(decode, "decode").kv_blocks_used > 0  # it really holds blocks mid-stream
    call.cancel()
    assert len(received) == 3
    wait_idle(_roles(one_p_one_d))
    # and the service still serves
    assert generate(one_p_one_d.router_address, "Hello", 3).token_ids


def test_concurrent_cancellations_leak_nothing(one_p_one_d) -> None:  # noqa: ANN001
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(one_p_one_d.router_address))

    def cancel_after(delay: float) -> None:
        call = stub.Generate(
            router_pb2.GenerateRequest(
                prompt="Count to one hundred: one, two, three",
                params=common_pb2.SamplingParams(max_tokens=300, ignore_eos=True),
            ),
            timeout=120,
        )
        time.sleep(delay)
        call.cancel()

    threads = [threading.Thread(target=cancel_after, args=(0.05 * i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_idle(_roles(one_p_one_d))


@pytest.mark.parametrize(
    "request_kwargs,field",
    [
        ({"token_ids": common_pb2.TokenIds(ids=[5] * 9000)}, "context"),  # longer than the model's context
        ({"token_ids": common_pb2.TokenIds(ids=[5, 10**7])}, "token ids"),  # outside the vocabulary
        ({"messages": common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="robot", content="hi")])}, "role"),
    ],
)
def test_inputs_only_a_worker_can_check_are_refused_cleanly(request_kwargs, field, one_p_one_d) -> None:  # noqa: ANN001
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(one_p_one_d.router_address))
    request = router_pb2.GenerateRequest(params=common_pb2.SamplingParams(max_tokens=4), **request_kwargs)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    assert generate(one_p_one_d.router_address, "Hello", 2).token_ids  # everyone else is still served
    wait_idle(_roles(one_p_one_d))


def test_penalties_and_biases_cross_the_hand_off(one_p_one_d, default_model) -> None:  # noqa: ANN001
    """The prefill worker samples the first token and the decode worker the rest: with every
    penalty, a bias and min_tokens set, 1P1D gives the tokens of one engine in one process."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    prompt = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
    ids = encode_text(default_model.tokenizer, prompt)
    engine = LLMEngine(default_model, EngineConfig(num_blocks=256))
    first = engine.generate([ids], [SamplingParams(max_tokens=1)])[0][0]
    params = {
        "repetition_penalty": 1.3,
        "presence_penalty": 0.4,
        "frequency_penalty": 0.3,
        "min_tokens": 12,
        "logit_bias": {first: -100.0},
    }
    expected = engine.generate([ids], [SamplingParams(max_tokens=14, **{**params, "logit_bias": ((first, -100.0),)})])[
        0
    ]
    result = generate(one_p_one_d.router_address, prompt, 14, **params)
    assert result.token_ids == expected
    assert result.token_ids[0] != first and len(result.token_ids) >= 12  # the bias and min_tokens held
