"""Layer-wise KV streaming: ship a request's K/V layer by layer while the forward pass that
completes its prompt is still running, so the transfer overlaps the rest of the prefill.

The loop thread copies each finished layer of the request's blocks into `buffer` and calls
`layer_done`; a transfer thread builds frames from `buffer` as layers become ready
(`kv_transfer.framing.encode_frames_as_ready`). The first token is known only after the pass, so
frames carry 0 and the token travels in the PrefillResponse.
"""

from __future__ import annotations

import threading

import torch


class LayerStream:
    def __init__(self, buffer: torch.Tensor, timeout_s: float) -> None:
        self.buffer = buffer  # [L, 2, n_blocks, block_size, heads, dim], filled layer by layer
        self.timeout_s = timeout_s
        self._ready = 0
        self._error: BaseException | None = None
        self._first_token: int | None = None
        self._cond = threading.Condition()

    def layer_done(self, layer: int) -> None:
        with self._cond:
            self._ready = layer + 1
            self._cond.notify_all()

    def finish(self, first_token: int) -> None:
        with self._cond:
            self._first_token = first_token
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait_layers(self, count: int) -> None:
        """Block until `count` layers are ready; raise if the pass failed or took too long."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready >= count or self._error is not None, self.timeout_s):
                raise TimeoutError(f"layer {count - 1} not ready after {self.timeout_s} s")
            if self._error is not None:
                raise RuntimeError(f"prefill failed while streaming: {self._error}")

    def first_token(self) -> int:
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._first_token is not None or self._error is not None, self.timeout_s
            ):
                raise TimeoutError("no first token")
            if self._error is not None:
                raise RuntimeError(f"prefill failed: {self._error}")
            return self._first_token  # type: ignore[return-value]
