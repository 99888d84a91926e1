"""Issue 29: per-peer and total caps on open gRPC calls (`pdserve.serving.PeerCallLimiter`), on the
router's public port and on a worker's internal port, with real servers on loopback.

The servers bind ``localhost`` (127.0.0.1 and ::1), so one process can be two peers: calls through
127.0.0.1 come from host ``ipv4:127.0.0.1``, calls through [::1] from ``ipv6:[::1]``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import eventually

from pdserve.router.config import RouterConfig
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _has_ipv6_loopback(), reason="needs ::1 to be a second peer host")

LONG = common_pb2.SamplingParams(max_tokens=5000, ignore_eos=True)
SHORT = common_pb2.SamplingParams(max_tokens=3, ignore_eos=True)


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def _held(calls: list[Iterator]) -> None:
    """Each streaming call has answered once: it is open at the server."""
    for call in calls:
        next(call)


def _refused(call: Iterator) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    return err.value


def test_router_refuses_a_peer_over_its_cap_and_serves_another(start_colocated, start_router) -> None:  # noqa: ANN001
    worker = start_colocated("--max-num-seqs", "8")
    server, _stub = start_router(
        RouterConfig(host="localhost", colocated=(worker.address,), grpc_calls_per_peer=3, grpc_calls_total=5)
    )
    port = _port(server.address)
    with open_channel(f"127.0.0.1:{port}") as v4, open_channel(f"[::1]:{port}") as v6:
        greedy, other = router_pb2_grpc.RouterStub(v4), router_pb2_grpc.RouterStub(v6)
        held = [
            greedy.Generate(router_pb2.GenerateRequest(prompt=f"hold {i}", params=LONG), timeout=120) for i in range(3)
        ]
        try:
            _held(held)
            # the fourth call from the same host is refused, naming the host and the setting
            error = _refused(greedy.Generate(router_pb2.GenerateRequest(prompt="one more", params=SHORT), timeout=30))
            assert "ipv4:127.0.0.1" in error.details() and "grpc_calls_per_peer" in error.details()
            with pytest.raises(grpc.RpcError) as err:
                greedy.GetStatus(router_pb2.StatusRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # health checks are never counted
            assert (
                health_pb2_grpc.HealthStub(v4).Check(health_pb2.HealthCheckRequest(), timeout=10).status
                == health_pb2.HealthCheckResponse.SERVING
            )
            # another client is still served, to the end of its stream
            answers = list(other.Generate(router_pb2.GenerateRequest(prompt="honest", params=SHORT), timeout=60))
            assert sum(len(a.token_ids) for a in answers) == 3
            assert other.GetStatus(router_pb2.StatusRequest(), timeout=10).in_flight_requests == 3
            # the total cap (5): two more open calls from ::1 fill it, the next one is refused
            more = [
                other.Generate(router_pb2.GenerateRequest(prompt=f"more {i}", params=LONG), timeout=120)
                for i in range(2)
            ]
            held += more
            _held(more)
            error = _refused(other.Generate(router_pb2.GenerateRequest(prompt="over", params=SHORT), timeout=30))
            assert "limit of 5" in error.details()
        finally:
            for call in held:
                call.cancel()
        # cancelled calls give their places back
        eventually(lambda: server.core.status().in_flight_requests == 0, timeout=30)
        answers = list(greedy.Generate(router_pb2.GenerateRequest(prompt="again", params=SHORT), timeout=60))
        assert sum(len(a.token_ids) for a in answers) == 3


def test_worker_refuses_a_peer_over_its_cap_and_serves_another(start_colocated) -> None:  # noqa: ANN001
    """The worker's --grpc-calls-per-peer (deployment: security.internal_grpc_calls_per_peer), on a real
    decode worker: streaming calls (Generate) and control-pool calls (GetInfo) are counted alike."""
    worker = start_colocated("--max-num-seqs", "8", "--host", "localhost", "--grpc-calls-per-peer", "2")
    port = _port(worker.address)
    with open_channel(f"127.0.0.1:{port}") as v4, open_channel(f"[::1]:{port}") as v6:
        greedy, other = worker_pb2_grpc.DecodeWorkerStub(v4), worker_pb2_grpc.DecodeWorkerStub(v6)
        held = [
            greedy.Generate(
                worker_pb2.DecodeRequest(request_id=f"hold-{i}", prompt=f"hold {i}", params=LONG), timeout=120
            )
            for i in range(2)
        ]
        try:
            _held(held)
            error = _refused(
                greedy.Generate(worker_pb2.DecodeRequest(request_id="more", prompt="more", params=SHORT), timeout=30)
            )
            assert "at most 2 per peer" in error.details()
            with pytest.raises(grpc.RpcError) as err:
                greedy.GetInfo(worker_pb2.InfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert other.GetInfo(worker_pb2.InfoRequest(), timeout=10).running_requests == 2
            answers = list(
                other.Generate(worker_pb2.DecodeRequest(request_id="honest", prompt="honest", params=SHORT), timeout=60)
            )
            assert sum(len(a.token_ids) for a in answers) == 3
        finally:
            for call in held:
                call.cancel()
        eventually(lambda: other.GetInfo(worker_pb2.InfoRequest(), timeout=10).running_requests == 0, timeout=30)
        assert greedy.GetInfo(worker_pb2.InfoRequest(), timeout=10).worker_id
