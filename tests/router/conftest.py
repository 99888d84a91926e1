"""Fixtures for router tests: in-process fake workers (see router_fakes.py) and a real router against them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
from router_fakes import FakePrefill

from pdserve.v1 import worker_pb2_grpc


def _start(add: Callable[[grpc.Server], None]) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def fake_server() -> Iterator[Callable[[object], str]]:
    """Start a fake worker servicer on 127.0.0.1:0; returns its address. All are stopped after the test."""
    servers: list[grpc.Server] = []

    def start(servicer: object) -> str:
        if isinstance(servicer, FakePrefill):
            server, address = _start(lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, s))
        else:
            server, address = _start(lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s))
        servers.append(server)
        return address

    yield start
    for server in servers:
        server.stop(None)
