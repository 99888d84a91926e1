"""Fault injection for reliability tests: break the KV stream of the next N transfers on purpose.

`corrupt` flips one byte of a frame after its checksum was computed (what a bad link would do);
`stall` sends the first frame and then nothing until the receiver gives up. Off unless the worker
is started with `PDSERVE_INJECT_KV_FAULT` set (engine/fault_injection.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from pdserve.engine.fault_injection import KV_FAULT_MODES as FAULT_MODES
from pdserve.v1.kv_pb2 import KvFrame

FrameFilter = Callable[[Iterator[KvFrame]], Iterator[KvFrame]]


def corrupt(frames: Iterator[KvFrame]) -> Iterator[KvFrame]:
    for index, frame in enumerate(frames):
        if index == 0 and frame.data:
            frame.data = bytes([frame.data[0] ^ 0x5A]) + frame.data[1:]
        yield frame


def stall(frames: Iterator[KvFrame], seconds: float = 3600.0) -> Iterator[KvFrame]:
    yield next(frames)
    time.sleep(seconds)  # the receiver's deadline cancels the stream long before this ends


class FaultInjector:
    """Hands out the fault filter for the next `count` transfers, then None."""

    def __init__(self, mode: str | None, count: int) -> None:
        if mode is not None and mode not in FAULT_MODES:
            raise ValueError(f"KV fault must be one of {FAULT_MODES}, got {mode!r}")
        self._filter: FrameFilter | None = {"corrupt": corrupt, "stall": stall}.get(mode or "")
        self._left = count if mode else 0
        self._lock = threading.Lock()

    def next_filter(self) -> FrameFilter | None:
        with self._lock:
            if self._left <= 0:
                return None
            self._left -= 1
            return self._filter
