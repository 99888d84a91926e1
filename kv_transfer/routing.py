"""Which backend one transfer takes, from the decode worker's configured `--kv-backend` and facts
about the peer: the one place that decides it (the decode side names the result in every
PrefillRequest / MigrateOutRequest; the sending side obeys it).

- `auto`: when the prefill worker runs on this host (loopback, or our host name) and reports a
  segment prefix of its own: CUDA IPC ("cuda_ipc", device to device) when this worker's KV cache is
  on CUDA, else shared memory (with a log line, once); the gRPC stream otherwise. A prefill worker
  whose own cache is not on CUDA sends a cuda_ipc transfer over shm itself (kv_transfer/cuda_ipc_backend.py);
- `shm`: shared memory, or the prefill side's failure when its segments cannot be bound;
- `grpc`, `ray`: that backend.

A migration always ships over gRPC (or Ray under `ray`): the source's cache is not in a segment the
target could bind to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.constants import KV_BACKENDS  # the values of `--kv-backend`
from pdserve.engine.kv_cache import SHM_PREFIX
from pdserve.kv_transfer.base import ExpectOptions, KvTransferError
from pdserve.kv_transfer.cuda_ipc_backend import IN_PLACE_BACKENDS, ipc_unavailable_reason, log_fallback

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def same_host(peer_address: str, own_address: str) -> bool:
    """True when `peer_address` names this host: loopback, or the host part of our own address."""
    host = _host(peer_address)
    return host in LOCAL_HOSTS or host == _host(own_address)


def wants_shm(configured: str, peer_address: str, own_address: str) -> bool:
    """Whether a transfer from `peer_address` would take shared memory or CUDA IPC (and so needs its
    segment prefix: it names the prefill worker whose segments and device pool the intake accepts)."""
    if configured not in KV_BACKENDS:
        raise ValueError(f"kv_backend: {configured!r} is not one of {', '.join(KV_BACKENDS)}")
    return configured == "shm" or (configured == "auto" and same_host(peer_address, own_address))


def is_segment_prefix(prefix: str) -> bool:
    """True for a per-process segment prefix (`engine.kv_cache.segment_prefix`), not the shared stem."""
    return prefix.startswith(SHM_PREFIX) and len(prefix) > len(SHM_PREFIX)


@dataclass(frozen=True)
class PeerFacts:
    """What the decode side knows of the prefill worker it calls: its address and, when shared memory
    or CUDA IPC is wanted, the segment prefix it reported ("" when it reported none; `why` then says why)."""

    address: str
    segment_prefix: str = ""
    why: str = ""


@dataclass(frozen=True)
class KvRoute:
    """How one request's K/V travel to this decode worker: the backend the sender uses, and what the
    receiver asks of the intake (`expect_options`)."""

    backend: str
    shm_segment_prefix: str = ""
    checksum: str = ""  # asked of the sender ("shm", "cuda_ipc": the gRPC stream checksums every frame)

    @property
    def in_place(self) -> bool:
        """The blocks are copied straight out of the prefill worker's memory (shared memory, or its
        device pool) into the decode cache."""
        return self.backend in IN_PLACE_BACKENDS

    def expect_options(self, deadline_s: float) -> ExpectOptions:
        return ExpectOptions(
            deadline_s,
            in_place=self.in_place,
            shm_segment_prefix=self.shm_segment_prefix,
            require_checksum=self.checksum,
        )


def same_host_backend(configured: str, device: torch.device | str) -> str:
    """The in-place backend of a same-host transfer into a KV cache on `device`: `auto` takes CUDA
    IPC when the cache is on CUDA, else shared memory (logged once, never silently)."""
    if configured != "auto":
        return configured
    reason = ipc_unavailable_reason(device)
    if reason:
        log_fallback(f"auto: {reason}, so same-host prefill workers ship by shm")
        return "shm"
    return "cuda_ipc"


def choose_route(
    configured: str, own_address: str, peer: PeerFacts, checksum: str = "", device: torch.device | str = "cpu"
) -> KvRoute:
    """The route of one prefill hand-off into a decode KV cache on `device`. KvTransferError when
    `shm` is forced and the peer's segments cannot be bound (under `auto` that falls back to gRPC)."""
    if not wants_shm(configured, peer.address, own_address):
        return KvRoute("grpc" if configured == "auto" else configured)
    if is_segment_prefix(peer.segment_prefix):
        return KvRoute(same_host_backend(configured, device), peer.segment_prefix, checksum)
    if configured == "auto":
        return KvRoute("grpc")
    why = peer.why or f"it reports no shared-memory segment prefix ({peer.segment_prefix!r})"
    raise KvTransferError(f"cannot bind its shm segments: {why}")


def migration_route(configured: str) -> KvRoute:
    """The route of a live migration's K/V (the source's cache is not in shared memory)."""
    return KvRoute("ray" if configured == "ray" else "grpc")
