"""The event-loop serving core with real workers (tiny model) and a real router, on loopback:
duplicate client ids, the control plane under 1,000 open streams, a dead engine loop, log-safe ids."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from injection import injected

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.tokenization import encode_text
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, kv_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

PROMPTS = [
    "The river runs",
    "Once upon a time in a city",
    "Winter light on the lake",
    "A poem about flour",
    "The market at dawn",
    "Children by the sea",
]


def _expected(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    loaded = load_model(model_dir)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=512))
    out = engine.generate(
        [encode_text(loaded.tokenizer, p) for p in prompts], SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    engine.pool.assert_all_free()
    return out


def _generate(
    stub: router_pb2_grpc.RouterStub, prompt: str, max_tokens: int, request_id: str = ""
) -> list[router_pb2.GenerateResponse]:
    request = router_pb2.GenerateRequest(
        request_id=request_id, prompt=prompt, params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    return list(stub.Generate(request, timeout=120))


def _ids(responses: list[router_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def _info(address: str) -> common_pb2.WorkerInfo:
    with open_channel(address) as channel:
        return worker_pb2_grpc.DecodeWorkerStub(channel).GetInfo(worker_pb2.InfoRequest(), timeout=10)


def _wait_idle(address: str, timeout_s: float = 30) -> common_pb2.WorkerInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        info = _info(address)
        if info.kv_blocks_used == 0 and info.running_requests == 0 and info.queue_depth == 0:
            return info
        assert time.monotonic() < deadline, f"worker not idle: {info}"
        time.sleep(0.1)


def test_two_in_flight_requests_with_the_same_client_id_both_complete_correctly(
    tiny_llama_dir, start_colocated, start_router
) -> None:  # noqa: ANN001
    worker = start_colocated()
    _server, stub = start_router(RouterConfig(colocated=(worker.address,)))
    prompts = PROMPTS[:2]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: _generate(stub, p, 24, request_id="dup1"), prompts))
    assert [_ids(r) for r in results] == _expected(tiny_llama_dir, prompts, 24)
    assert all(resp.request_id == "dup1" for r in results for resp in r)
    _wait_idle(worker.address)


def test_control_plane_answers_with_1000_streams_open(start_colocated, start_router) -> None:  # noqa: ANN001
    """1,000 streams held open at the router and 1,000 straight at a decode worker: health, GetInfo,
    GetStatus, Abort and PushKv still answer (each within a 10 s deadline), and when the clients
    leave every KV block is free again."""
    worker = start_colocated("--max-num-seqs", "8")
    server, stub = start_router(RouterConfig(colocated=(worker.address,), max_concurrent_streams=64))
    params = common_pb2.SamplingParams(max_tokens=5000, ignore_eos=True)
    with open_channel(server.address) as router_channel, open_channel(worker.address) as worker_channel:
        router_stub = router_pb2_grpc.RouterStub(router_channel)
        worker_stub = worker_pb2_grpc.DecodeWorkerStub(worker_channel)
        calls = [
            router_stub.Generate(router_pb2.GenerateRequest(prompt=f"stream {i}", params=params), timeout=600)
            for i in range(1000)
        ]
        calls += [
            worker_stub.Generate(
                worker_pb2.DecodeRequest(request_id=f"direct-{i}", prompt=f"direct {i}", params=params), timeout=600
            )
            for i in range(1000)
        ]
        try:
            deadline = time.monotonic() + 300
            while (
                router_stub.GetStatus(router_pb2.StatusRequest(), timeout=10).in_flight_requests < 1000
                or _info(worker.address).queue_depth + _info(worker.address).running_requests < 1000
            ):
                assert time.monotonic() < deadline, "the streams did not all open"
                time.sleep(0.2)
            seconds = _control_calls(router_channel, worker_channel)
            status = router_stub.GetStatus(router_pb2.StatusRequest(), timeout=10)
            assert status.in_flight_requests == 1000 and status.queued_requests > 900
        finally:
            for call in calls:
                call.cancel()
    assert set(seconds) == {"router health", "router status", "worker health", "worker info", "abort", "push_kv"}
    assert _wait_idle(worker.address, timeout_s=120).kv_blocks_used == 0


def _control_calls(router_channel: grpc.Channel, worker_channel: grpc.Channel) -> dict[str, float]:
    """Each control-plane call once, with a 10 s deadline; the seconds each took."""
    calls = {
        "router health": lambda: health_pb2_grpc.HealthStub(router_channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        ),
        "router status": lambda: router_pb2_grpc.RouterStub(router_channel).GetStatus(
            router_pb2.StatusRequest(), timeout=10
        ),
        "worker health": lambda: health_pb2_grpc.HealthStub(worker_channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        ),
        "worker info": lambda: worker_pb2_grpc.DecodeWorkerStub(worker_channel).GetInfo(
            worker_pb2.InfoRequest(), timeout=10
        ),
        "abort": lambda: worker_pb2_grpc.DecodeWorkerStub(worker_channel).Abort(
            worker_pb2.AbortRequest(request_id="direct-999"), timeout=10
        ),
        "push_kv": lambda: kv_pb2_grpc.KvTransferStub(worker_channel).PushKv(iter(()), timeout=10),
    }
    seconds = {}
    for name, call in calls.items():
        start = time.monotonic()
        answer = call()
        seconds[name] = time.monotonic() - start
        if name == "push_kv":
            assert answer.error == "empty KV stream"  # the intake answered, it did not just time out
    return seconds


def test_a_dead_engine_loop_turns_unhealthy_and_its_requests_fail_over(
    tiny_llama_dir, start_colocated, start_router
) -> None:  # noqa: ANN001
    with injected(loop_death_after_steps=6):
        dying = start_colocated()
    healthy = start_colocated()
    server, stub = start_router(RouterConfig(colocated=(dying.address, healthy.address), poll_interval_s=0.1))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: _generate(stub, p, 20), PROMPTS))
    assert [_ids(r) for r in results] == _expected(tiny_llama_dir, PROMPTS, 20)
    info = _info(dying.address)
    assert not info.healthy and "engine loop died" in info.unhealthy_reason
    with open_channel(dying.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert server.metrics.prom.failovers._value.get() >= 1  # noqa: SLF001 - the counter's own value
    router_view = {w.address: w.healthy for w in stub.GetStatus(router_pb2.StatusRequest(), timeout=10).workers}
    assert router_view == {dying.address: False, healthy.address: True}
    assert [_ids(_generate(stub, p, 20)) for p in PROMPTS[:2]] == _expected(tiny_llama_dir, PROMPTS[:2], 20)
    _wait_idle(healthy.address)


def test_client_ids_are_escaped_in_logs_and_refused(
    start_colocated, start_router, caplog: pytest.LogCaptureFixture
) -> None:  # noqa: ANN001
    worker = start_colocated()
    _server, stub = start_router(RouterConfig(colocated=(worker.address,)))
    caplog.set_level(logging.INFO)
    forged = "x\nGenerate finish request_id=victim status=OK"
    with pytest.raises(grpc.RpcError) as refused:  # the router validates before its first log line
        _generate(stub, "hi", 2, request_id=forged)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in refused.value.details()
    with open_channel(worker.address) as channel:  # a worker logs ids as they come: escaped
        list(
            worker_pb2_grpc.DecodeWorkerStub(channel).Generate(
                worker_pb2.DecodeRequest(
                    request_id=forged, prompt="hi", params=common_pb2.SamplingParams(max_tokens=2)
                ),
                timeout=60,
            )
        )
    lines = [r.getMessage() for r in caplog.records]
    assert any("request_id=x\\nGenerate finish" in line for line in lines)
    assert not any("\n" in line for line in lines)
