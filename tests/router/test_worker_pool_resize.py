"""Changing the router's worker set at runtime: WorkerPool.add / remove (used by the Ray controller)."""

from __future__ import annotations

import grpc
import pytest
from router_fakes import FakeDecode, FakePrefill

from pdserve.router.config import RouterConfig
from pdserve.router.worker_pool import WorkerEndpoint
from pdserve.v1 import router_pb2


def test_add_routes_to_new_workers_and_remove_stops_it(fake_server, start_router) -> None:  # noqa: ANN001
    prefill, decode = fake_server(FakePrefill()), fake_server(FakeDecode())
    server, stub = start_router(RouterConfig(prefill=(prefill,), decode=(decode,)))
    second = FakeDecode()
    server.pool.add(WorkerEndpoint(fake_server(second), "decode"))
    assert len(server.pool.addresses()) == 3
    for _ in range(4):  # round robin over both decode workers (the new one was polled on add)
        list(stub.Generate(router_pb2.GenerateRequest(prompt="hi"), timeout=10))
    assert len(second.requests) == 2
    with pytest.raises(ValueError, match="already"):
        server.pool.add(WorkerEndpoint(decode, "decode"))
    assert server.pool.remove(decode) and not server.pool.remove(decode)
    for _ in range(2):
        list(stub.Generate(router_pb2.GenerateRequest(prompt="hi"), timeout=10))
    assert len(second.requests) == 4
    assert server.pool.in_flight_total() == 0


def test_lease_of_a_removed_worker_releases_quietly(fake_server, start_router) -> None:  # noqa: ANN001
    prefill, decode = fake_server(FakePrefill()), fake_server(FakeDecode())
    server, _ = start_router(RouterConfig(prefill=(prefill,), decode=(decode,)))
    from pdserve.router.policies import make_policy

    lease = server.pool.assign(make_policy("round_robin", "decode"), make_policy("round_robin", "prefill"), 5)
    server.pool.remove(decode)
    server.pool.remove(prefill)
    lease.release()  # the worker restarted elsewhere meanwhile: nothing to count down, no KeyError
    server.pool.poll_once()
    assert server.pool.addresses() == {}


def test_removed_worker_unreachable_gives_unavailable(fake_server, start_router) -> None:  # noqa: ANN001
    prefill, decode = fake_server(FakePrefill()), fake_server(FakeDecode())
    server, stub = start_router(RouterConfig(prefill=(prefill,), decode=(decode,), max_attempts=1))
    server.pool.remove(decode)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(router_pb2.GenerateRequest(prompt="hi"), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
