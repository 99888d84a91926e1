"""Which backend one transfer takes, from the decode worker's configured `--kv-backend` and facts
about the peer: the one place that decides it (the decode side names the result in every
PrefillRequest / MigrateOutRequest; the sending side obeys it).

- `auto`: shared memory when the prefill worker runs on this host (loopback, or our host name) and
  reports a segment prefix of its own, the gRPC stream otherwise;
- `shm`: shared memory, or the prefill side's failure when its segments cannot be bound;
- `grpc`, `ray`: that backend.

A migration always ships over gRPC (or Ray under `ray`): the source's cache is not in a segment the
target could bind to.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.constants import KV_BACKENDS  # the values of `--kv-backend`
from pdserve.engine.kv_cache import SHM_PREFIX
from pdserve.kv_transfer.base import ExpectOptions, KvTransferError

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def same_host(peer_address: str, own_address: str) -> bool:
    """True when `peer_address` names this host: loopback, or the host part of our own address."""
    host = _host(peer_address)
    return host in LOCAL_HOSTS or host == _host(own_address)


def wants_shm(configured: str, peer_address: str, own_address: str) -> bool:
    """Whether a transfer from `peer_address` would take shared memory (and so needs its segment prefix)."""
    if configured not in KV_BACKENDS:
        raise ValueError(f"kv_backend: {configured!r} is not one of {', '.join(KV_BACKENDS)}")
    return configured == "shm" or (configured == "auto" and same_host(peer_address, own_address))


def is_segment_prefix(prefix: str) -> bool:
    """True for a per-process segment prefix (`engine.kv_cache.segment_prefix`), not the shared stem."""
    return prefix.startswith(SHM_PREFIX) and len(prefix) > len(SHM_PREFIX)


@dataclass(frozen=True)
class PeerFacts:
    """What the decode side knows of the prefill worker it calls: its address and, when shared memory
    is wanted, the segment prefix it reported ("" when it reported none; `why` then says why)."""

    address: str
    segment_prefix: str = ""
    why: str = ""


@dataclass(frozen=True)
class KvRoute:
    """How one request's K/V travel to this decode worker: the backend the sender uses, and what the
    receiver asks of the intake (`expect_options`)."""

    backend: str
    shm_segment_prefix: str = ""
    checksum: str = ""  # asked of the sender ("shm" only: the gRPC stream checksums every frame)

    @property
    def in_place(self) -> bool:
        """Shared-memory blocks are copied straight into the decode cache."""
        return self.backend == "shm"

    def expect_options(self, deadline_s: float) -> ExpectOptions:
        return ExpectOptions(deadline_s, in_place=self.in_place, shm_segment_prefix=self.shm_segment_prefix,
                             require_checksum=self.checksum)


def choose_route(configured: str, own_address: str, peer: PeerFacts, checksum: str = "") -> KvRoute:
    """The route of one prefill hand-off. KvTransferError when `shm` is forced and the peer's segments
    cannot be bound (under `auto` that falls back to gRPC)."""
    if not wants_shm(configured, peer.address, own_address):
        return KvRoute("grpc" if configured == "auto" else configured)
    if is_segment_prefix(peer.segment_prefix):
        return KvRoute("shm", peer.segment_prefix, checksum)
    if configured == "auto":
        return KvRoute("grpc")
    why = peer.why or f"it reports no shared-memory segment prefix ({peer.segment_prefix!r})"
    raise KvTransferError(f"cannot bind its shm segments: {why}")


def migration_route(configured: str) -> KvRoute:
    """The route of a live migration's K/V (the source's cache is not in shared memory)."""
    return KvRoute("ray" if configured == "ray" else "grpc")
