"""Shared by the KV backend tests: a KvTransfer receiver served by a real gRPC server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pdserve.kv_transfer import KvTransferServicer, grpc_message_options
from pdserve.worker.runtime import make_server


@contextmanager
def served(servicer: KvTransferServicer) -> Iterator[tuple[KvTransferServicer, str]]:
    """(servicer, its loopback address) while a gRPC server with the KV frame limits serves it."""
    server = make_server(8, grpc_message_options())
    servicer.add_to_server(server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        yield servicer, address
    finally:
        servicer.close()
        server.stop(0)
