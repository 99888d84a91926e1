"""KV hand-offs that take a profile's modelled time (the simulated engine's transfer model).

`install_modelled_links(profile, speedup)` wraps the sender of every registered backend in this
process: each send first waits ``profile.transfer_s(backend, tokens) / speedup`` (tokens: those of
the blocks actually shipped, i.e. after a cached prefix) and then ships through the real backend,
so framing, validation, acknowledgement and block freeing all run as usual. Only sim prefill
workers call it; their placeholder K/V is 4 bytes per token, the modelled time is that of
``kv_bytes_per_token`` bytes per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.kv_transfer.base import KvSender, KvSpec, LayerSource, get_backend, register_backend

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache
    from pdserve.engine.sim_profile import Profile
    from pdserve.v1.kv_pb2 import KvAck

DelayFn = Callable[[KvSpec], float]


def shipped_tokens(spec: KvSpec) -> int:
    """Tokens whose K/V a payload carries (those after the receiver's cached prefix)."""
    return spec.num_tokens - spec.block_offset * spec.block_size


class ModelledLinkSender(KvSender):
    """Waits the modelled hand-off time, then sends through `inner`."""

    def __init__(self, inner: KvSender, delay_s: DelayFn, sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self._sleep = sleep
        self.supports_layer_streaming = inner.supports_layer_streaming

    def _wait(self, spec: KvSpec) -> None:
        delay = self.delay_s(spec)
        if delay > 0:
            self._sleep(delay)

    def send(self, spec: KvSpec, kv: torch.Tensor, first_token_id: int, timeout_s: float) -> KvAck:
        self._wait(spec)
        return self.inner.send(spec, kv, first_token_id, timeout_s)

    def send_blocks(
        self,
        spec: KvSpec,
        cache: KVCache,
        block_ids: list[int],
        first_token_id: int,
        timeout_s: float,
        checksum: str = "",
    ) -> KvAck:
        self._wait(spec)
        return self.inner.send_blocks(spec, cache, block_ids, first_token_id, timeout_s, checksum)

    def send_layers(self, spec: KvSpec, source: LayerSource, timeout_s: float) -> KvAck:
        self._wait(spec)
        return self.inner.send_layers(spec, source, timeout_s)

    def close(self) -> None:
        self.inner.close()


def install_modelled_links(
    profile: Profile, speedup: float, backends: tuple[str, ...] = ("grpc", "shm", "ray")
) -> None:
    """Make every send through `backends` in this process take the profile's time / speedup."""
    for name in backends:
        backend = get_backend(name)

        def factory(
            target: str, inner_factory: Callable[[str], KvSender] = backend.sender_factory, link: str = name
        ) -> KvSender:
            return ModelledLinkSender(
                inner_factory(target), lambda spec: profile.transfer_s(link, shipped_tokens(spec)) / speedup
            )

        register_backend(name, factory)
