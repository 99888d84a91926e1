"""Where a finished prefill goes: the one thing that differs between worker roles.

An engine built without a connector keeps decoding what it prefilled (decode and colocated
workers). An engine built with one (a prefill worker) hands every finished prefill to it: the
engine samples the first token, calls `prefill_done`, and holds the sequence's blocks (status
HANDED_OFF) until the worker calls `LLMEngine.release_handoff` once the K/V left, successfully or
not. Only the engine frees blocks, on its own loop thread; a connector never touches the pool.

Every method runs on the engine's loop thread, inside `LLMEngine.step`, and must not block.
"""

from __future__ import annotations

import abc

from pdserve.engine.model_runner import LayerCallback
from pdserve.engine.sequence import Sequence


class KvConnector(abc.ABC):
    @abc.abstractmethod
    def layer_hook(self, completing: list[Sequence]) -> LayerCallback | None:
        """A pass is about to complete the prefill of `completing`: return a callback the model
        runner calls after each layer (layer-wise KV streaming), or None."""

    @abc.abstractmethod
    def pass_failed(self, completing: list[Sequence], error: Exception) -> list[Sequence]:
        """The pass announced by `layer_hook` raised. Return the sequences of `completing` that cannot
        be computed again because part of their K/V already left; the engine fails those and retries
        the others."""

    @abc.abstractmethod
    def prefill_done(self, seq: Sequence, first_token: int) -> None:
        """`seq`'s K/V are complete and its first token is sampled: ship them. Its blocks stay held
        until `LLMEngine.release_handoff(seq)`."""
