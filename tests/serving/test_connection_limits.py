"""Issue 29: idle and unfinished gRPC connections are closed, on the router's public port and on a
worker's internal port, and the connection timers never cut a stream that keeps sending. Real
servers on loopback, raw TCP sockets and real grpc channels.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import eventually

from pdserve.router.config import RouterConfig
from pdserve.serving import CallLimits
from pdserve.v1 import common_pb2, router_pb2
from pdserve.worker.runtime import add_health, make_server

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # length 0, type SETTINGS, no flags, stream 0
GOAWAY = 0x7
SERVING = health_pb2.HealthCheckResponse.SERVING


def _closed_within(sock: socket.socket, timeout_s: float) -> tuple[bool, bytes]:
    """(whether the server closed `sock` within `timeout_s`, the bytes it sent before)."""
    sock.settimeout(timeout_s)
    received = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return True, received
            received += chunk
    except TimeoutError:
        pass
    except ConnectionResetError:
        return True, received
    return False, received


def _frame_types(data: bytes) -> list[int]:
    """The HTTP/2 frame types in `data` (9-byte headers: length, type, flags, stream)."""
    types, at = [], 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at : at + 3], "big")
        types.append(data[at + 3])
        at += 9 + length
    return types


def _connect(port: int, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if send:
        sock.sendall(send)
    return sock


def _assert_idle_connections_are_closed(port: int, cap_s: float) -> None:
    """A socket that sends nothing, one that sends half the preface, one that finishes the HTTP/2
    handshake and opens no stream, and an unused grpc channel: each is closed after the cap; the channel
    works again on its next call."""
    silent, half, handshaken = _connect(port), _connect(port, PREFACE[:10]), _connect(port, PREFACE + EMPTY_SETTINGS)
    try:
        for sock in (silent, half):
            closed, _ = _closed_within(sock, cap_s + 15)
            assert closed, "a connection that never finished its handshake was kept open"
        closed, received = _closed_within(handshaken, cap_s + 15)
        assert closed, "a connection without calls was kept open"
        assert GOAWAY in _frame_types(received), _frame_types(received)
    finally:
        for sock in (silent, half, handshaken):
            sock.close()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
        states: list[grpc.ChannelConnectivity] = []
        channel.subscribe(states.append)
        # the server's GOAWAY takes the channel from READY back to IDLE (its connection is gone)
        eventually(
            lambda: states[-1:] == [grpc.ChannelConnectivity.IDLE],
            timeout=cap_s + 15,
            what="the idle channel's connection to be closed by the server",
        )
        assert grpc.ChannelConnectivity.READY in states
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING


def test_a_connection_is_kept_open_without_the_cap(start_colocated, start_router) -> None:  # noqa: ANN001
    """The control: with the default cap (60 s) an unused connection is still open seconds later, so
    the closures below are the setting's doing."""
    worker = start_colocated()
    server, _stub = start_router(RouterConfig(colocated=(worker.address,), port=0))
    sock = _connect(int(server.address.rsplit(":", 1)[1]), PREFACE + EMPTY_SETTINGS)
    try:
        closed, _ = _closed_within(sock, 3.0)
        assert not closed
    finally:
        sock.close()


def test_router_closes_idle_and_unfinished_connections(start_colocated, start_router) -> None:  # noqa: ANN001
    worker = start_colocated()
    server, _stub = start_router(RouterConfig(colocated=(worker.address,), port=0, grpc_connection_idle_s=1.0))
    _assert_idle_connections_are_closed(int(server.address.rsplit(":", 1)[1]), cap_s=1.0)


@pytest.fixture
def worker_server() -> Iterator[int]:
    """A worker's internal server as every worker makes it (`make_server`), with a 1 s idle cap."""
    server = make_server(control_threads=4, name="idle-test", limits=CallLimits(connection_idle_s=1.0))
    add_health(server).set("", SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(None)


def test_worker_port_closes_idle_and_unfinished_connections(worker_server: int) -> None:
    _assert_idle_connections_are_closed(worker_server, cap_s=1.0)


def test_a_long_stream_that_keeps_sending_is_not_cut(
    start_colocated,
    start_router,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 1 s idle cap and a 1 s age cap: a Generate stream that keeps sending for several seconds
    (50 ms per decode step) ends with all its tokens, on the connection it started on."""
    monkeypatch.setenv("PDSERVE_INJECT_STEP_DELAY_MS", "50")
    worker = start_colocated()
    server, stub = start_router(
        RouterConfig(
            colocated=(worker.address,),
            port=0,
            grpc_connection_idle_s=1.0,
            grpc_connection_age_s=1.0,
            max_stream_timeout_s=60.0,
        )
    )
    params = common_pb2.SamplingParams(max_tokens=80, ignore_eos=True)
    started = time.monotonic()
    answers = list(stub.Generate(router_pb2.GenerateRequest(prompt="keep sending", params=params), timeout=60))
    lasted = time.monotonic() - started
    assert sum(len(a.token_ids) for a in answers) == 80
    assert lasted > 3.0, f"the stream lasted {lasted:.1f} s: not beyond both caps, so it proves nothing"
    # the aged connection is replaced: the next call on the same channel is served
    answers = list(stub.Generate(router_pb2.GenerateRequest(prompt="again", params=params), timeout=60))
    assert sum(len(a.token_ids) for a in answers) == 80


def test_age_grace_outlasts_the_stream_deadline_cap() -> None:
    """The router's aged connections keep their calls until the stream deadline cap has passed."""
    from pdserve.router.server import call_limits

    limits = call_limits(RouterConfig(max_stream_timeout_s=600.0, grpc_connection_age_s=3600.0))
    options = dict(limits.options())
    assert options["grpc.max_connection_age_ms"] == 3_600_000
    assert options["grpc.max_connection_age_grace_ms"] > 600_000
    assert "grpc.max_connection_age_ms" not in dict(CallLimits().options())  # workers: no age cap


def test_connections_over_the_cap_are_closed_at_once() -> None:
    """`CallLimits.connections` (a quarter of the file-descriptor limit by default): with a cap of 2, two
    handshaken connections stay open and a third is closed at once; once one leaves, a new one stays."""
    server = make_server(control_threads=4, name="cap-test", limits=CallLimits(connections=2))
    add_health(server).set("", SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    held = [_connect(port, PREFACE + EMPTY_SETTINGS) for _ in range(2)]
    try:
        assert not any(_closed_within(sock, 1.0)[0] for sock in held)
        with _connect(port, PREFACE + EMPTY_SETTINGS) as over:
            assert _closed_within(over, 10.0)[0], "a connection over the cap was kept"
        held.pop().close()

        def admitted() -> bool:
            with _connect(port, PREFACE + EMPTY_SETTINGS) as sock:
                return not _closed_within(sock, 1.0)[0]

        eventually(admitted, timeout=15, what="a connection to be admitted again")
    finally:
        for sock in held:
            sock.close()
        server.stop(None)


def test_a_client_that_pings_without_calls_is_told_to_calm_down() -> None:
    """Ping abuse (gRPC's server defaults, stated in pdserve.limits): a channel pinging every 200 ms
    without calls is sent GOAWAY "too_many_pings" long before the idle cap would close it."""
    options = [
        ("grpc.keepalive_time_ms", 200),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    server = make_server(control_threads=4, name="ping-test", limits=CallLimits(connection_idle_s=600.0))
    add_health(server).set("", SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            states: list[grpc.ChannelConnectivity] = []
            channel.subscribe(states.append)
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
            eventually(
                lambda: grpc.ChannelConnectivity.READY in states and states[-1] != grpc.ChannelConnectivity.READY,
                timeout=30,
                what="the pinging channel's connection to be closed",
            )
    finally:
        server.stop(None)
