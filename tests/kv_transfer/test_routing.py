"""kv_transfer.routing: the one place that picks the backend of a transfer from the decode worker's
`--kv-backend` and what it knows of the peer, and what the intake then asks of the receiver."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache import segment_prefix
from pdserve.kv_transfer import ExpectOptions, KvTransferError
from pdserve.kv_transfer.routing import KvRoute, PeerFacts, choose_route, migration_route, same_host, wants_shm

OWN = "decode-host:7001"
PREFIX = segment_prefix()


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("127.0.0.1:7000", True),
        ("localhost:7000", True),
        ("[::1]:7000", True),
        ("decode-host:7010", True),
        ("other-host:7000", False),
        ("10.0.0.2:7000", False),
    ],
)
def test_same_host(peer: str, expected: bool) -> None:
    assert same_host(peer, OWN) is expected


@pytest.mark.parametrize(
    ("configured", "peer", "expected"),
    [
        ("auto", PeerFacts("127.0.0.1:7000", PREFIX), KvRoute("shm", PREFIX, "xxh3")),
        ("auto", PeerFacts("127.0.0.1:7000", ""), KvRoute("grpc")),  # reports no prefix: gRPC
        ("auto", PeerFacts("127.0.0.1:7000", "pdserve-kv-"), KvRoute("grpc")),  # the shared stem is no prefix
        ("auto", PeerFacts("other-host:7000"), KvRoute("grpc")),
        ("shm", PeerFacts("other-host:7000", PREFIX), KvRoute("shm", PREFIX, "xxh3")),
        ("grpc", PeerFacts("127.0.0.1:7000", PREFIX), KvRoute("grpc")),
        ("ray", PeerFacts("127.0.0.1:7000", PREFIX), KvRoute("ray")),
    ],
)
def test_choose_route(configured: str, peer: PeerFacts, expected: KvRoute) -> None:
    assert choose_route(configured, OWN, peer, checksum="xxh3") == expected


def test_forced_shm_without_a_prefix_is_the_peers_failure() -> None:
    with pytest.raises(KvTransferError, match="cannot bind its shm segments: GetInfo failed"):
        choose_route("shm", OWN, PeerFacts("127.0.0.1:7000", why="GetInfo failed: UNAVAILABLE: down"))
    with pytest.raises(ValueError, match="kv_backend"):
        wants_shm("rdma", "127.0.0.1:7000", OWN)


def test_the_route_says_what_the_intake_asks() -> None:
    assert KvRoute("shm", PREFIX, "crc32").expect_options(3.0) == ExpectOptions(
        3.0, in_place=True, shm_segment_prefix=PREFIX, require_checksum="crc32"
    )
    assert KvRoute("grpc").expect_options(3.0) == ExpectOptions(3.0)
    assert migration_route("shm") == migration_route("auto") == KvRoute("grpc")
    assert migration_route("ray") == KvRoute("ray")
