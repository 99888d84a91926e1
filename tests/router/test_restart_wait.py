"""The router waits for a restarting worker (worker_restart_wait_s) instead of failing at once, against
in-process fake workers: a dead decode worker stays registered (as a Ray actor being restarted does),
requests stall until a worker of that role serves again, and the wait is bounded and counted. A worker
that leaves the pool for good (its restarts used up) ends the wait at once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from router_fakes import SCRIPT, FakeDecode, FakePrefill
from waiting import eventually

from pdserve.router.config import RouterConfig
from pdserve.router.worker_pool import WorkerEndpoint
from pdserve.v1 import common_pb2, router_pb2

REQUEST = router_pb2.GenerateRequest(prompt="Hello", params=common_pb2.SamplingParams(max_tokens=3))
DEAD = "127.0.0.1:1"  # registered, never answers: a worker whose process is gone


def _waits(server, stage: str) -> float:  # noqa: ANN001
    return server.metrics.prom.registry.get_sample_value("pdserve_worker_waits_total", {"stage": stage}) or 0.0


def _wait_time_count(server, outcome: str) -> float:  # noqa: ANN001
    return (
        server.metrics.prom.registry.get_sample_value("pdserve_worker_wait_seconds_count", {"outcome": outcome}) or 0.0
    )


def test_requests_wait_for_a_restarted_decode_worker(fake_server, start_router) -> None:
    prefill = fake_server(FakePrefill())
    server, stub = start_router(
        RouterConfig(prefill=(prefill,), decode=(DEAD,), worker_restart_wait_s=30.0, poll_interval_s=0.2)
    )
    with ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(lambda: list(stub.Generate(REQUEST, timeout=60))) for _ in range(3)]
        eventually(lambda: _waits(server, "decode") == 3, 30.0, what="all three requests waiting for a decode worker")
        assert not any(c.done() for c in calls)  # a stall, not an error
        # the "restarted" worker registers on a new port, then the dead address is dropped (the controller's order)
        restarted = fake_server(FakeDecode())
        server.pool.add(WorkerEndpoint(restarted, "decode"))
        server.pool.remove(DEAD)
        for call in calls:
            assert [list(r.token_ids) for r in call.result(timeout=30)] == [[10], [11], [12]]
    assert _waits(server, "decode") == 3
    assert _wait_time_count(server, "served") == 3 and _wait_time_count(server, "gave_up") == 0
    # with a healthy worker nobody waits
    assert [r.text for r in stub.Generate(REQUEST, timeout=10)] == [r.text for r in SCRIPT]
    assert _waits(server, "decode") == 3


def test_the_wait_is_bounded(fake_server, start_router) -> None:
    prefill = fake_server(FakePrefill())
    server, stub = start_router(RouterConfig(prefill=(prefill,), decode=(DEAD,), worker_restart_wait_s=1.0))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(REQUEST, timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy decode worker" in info.value.details() and "none served again within" in info.value.details()
    assert 1.0 <= time.monotonic() - started < 10
    assert _wait_time_count(server, "gave_up") == 1


def test_the_wait_ends_within_the_request_deadline(fake_server, start_router) -> None:
    prefill = fake_server(FakePrefill())
    server, stub = start_router(RouterConfig(prefill=(prefill,), decode=(DEAD,), worker_restart_wait_s=60.0))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(REQUEST, timeout=1.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the router stops waiting too: the call ends at the deadline, or it gives up at the deadline itself
    while _wait_time_count(server, "gave_up") + _wait_time_count(server, "cancelled") < 1:
        assert time.monotonic() - started < 10, "the router kept waiting past the request's deadline"
        time.sleep(0.05)
    assert server.metrics.in_flight == 0


def test_a_worker_gone_for_good_ends_the_wait(fake_server, start_router) -> None:
    prefill = fake_server(FakePrefill())
    server, stub = start_router(RouterConfig(prefill=(prefill,), decode=(DEAD,), worker_restart_wait_s=60.0))
    errors: list[grpc.RpcError] = []

    def call() -> None:
        try:
            list(stub.Generate(REQUEST, timeout=60))
        except grpc.RpcError as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 10
    while _waits(server, "decode") < 1:
        assert time.monotonic() < deadline, "the request never started waiting"
        time.sleep(0.05)
    removed = time.monotonic()
    server.pool.remove(DEAD)  # the controller forgets a worker whose restarts are used up
    thread.join(15)
    assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker configured" in errors[0].details()
    assert time.monotonic() - removed < 5


def test_a_missing_prefill_worker_is_waited_for_too(fake_server, start_router) -> None:
    decode = fake_server(FakeDecode())
    server, stub = start_router(
        RouterConfig(prefill=(DEAD,), decode=(decode,), worker_restart_wait_s=30.0, poll_interval_s=0.2)
    )
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(lambda: list(stub.Generate(REQUEST, timeout=60)))
        eventually(lambda: _waits(server, "prefill") == 1, 30.0, what="the request waiting for a prefill worker")
        assert not call.done()
        server.pool.add(WorkerEndpoint(fake_server(FakePrefill()), "prefill"))
        assert len(call.result(timeout=30)) == len(SCRIPT)
    assert _waits(server, "prefill") == 1


def test_without_restarts_a_dead_pool_fails_at_once(fake_server, start_router) -> None:
    prefill = fake_server(FakePrefill())
    _, stub = start_router(RouterConfig(prefill=(prefill,), decode=(DEAD,)))  # worker_restart_wait_s 0
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(REQUEST, timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 3
