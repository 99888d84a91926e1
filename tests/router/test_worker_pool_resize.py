"""Changing the router's worker set at runtime: WorkerPool.add / remove (used by the Ray controller)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from router_fakes import FakeDecode, FakePrefill

from pdserve.router.config import RouterConfig
from pdserve.router.policies import DECODE, PREFILL
from pdserve.router.worker_pool import WorkerEndpoint, WorkerPool
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc


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


class SwitchingWorker(worker_pb2_grpc.PrefillWorkerServicer, worker_pb2_grpc.DecodeWorkerServicer):
    """An elastic worker switching from prefill to decode (both services on one port). The GetInfo
    that comes while `hold` is set is answered only once `release` is set, with what the worker said
    during the switch (unhealthy, "switching to decode"); every other one, as the decode worker it is
    after the switch (healthy)."""

    def __init__(self) -> None:
        self.hold, self.holding, self.release = threading.Event(), threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def GetInfo(self, request, context):  # noqa: ANN001, ANN201, N802
        with self._lock:
            held = self.hold.is_set()
            self.hold.clear()
        if held:
            self.holding.set()
            self.release.wait(10)
            return common_pb2.WorkerInfo(healthy=False, unhealthy_reason="switching to decode")
        return common_pb2.WorkerInfo(healthy=True, kv_address="ray:switched", max_running_requests=4)

    def SetKvTargets(self, request, context):  # noqa: ANN001, ANN201, N802
        return worker_pb2.KvTargetsAck(num_targets=len(request.targets))


def test_a_poll_answer_from_before_a_role_switch_does_not_undo_it(fake_server) -> None:  # noqa: ANN001
    """A poll that asked a worker before it switched roles, and hears back after the switch, does not
    overwrite what the switch recorded: the worker stays healthy in its new role (it used to be
    taken out of rotation until the next poll, so the first requests after a switch missed it)."""
    worker = SwitchingWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(worker, server)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    pool = WorkerPool([WorkerEndpoint(fake_server(FakePrefill()), PREFILL), WorkerEndpoint(address, PREFILL)])
    try:
        pool.poll_once()
        worker.hold.set()
        poll = threading.Thread(target=pool.poll_once)
        poll.start()  # its GetInfo reaches the worker while it switches...
        assert worker.holding.wait(10)
        assert pool.set_role(address, DECODE).healthy  # ...the switch completes and polls it itself...
        worker.release.set()  # ...and only then is that first answer heard
        poll.join(10)
        switched = next(w for w in pool.snapshot() if w.address == address)
        assert switched.role == common_pb2.WORKER_ROLE_DECODE and switched.healthy
        assert switched.kv_address == "ray:switched"
    finally:
        worker.release.set()
        pool.close()
        server.stop(None)
