"""A worker's prefix-cache changes as numbered events, for the router's KV index (KV-aware routing).

Every block the block pool registers in its prefix cache is a *stored* event, and every cached block
it evicts a *removed* event. Each event carries a 64-bit key (the first 8 bytes of the block's
chained sha256 prefix hash, `pdserve.prefix_hashing`) and a sequence number; nothing else (no token
ids, no text). Subscribers (`KvEvents.Subscribe`) read the events after the last sequence number
they saw; one that fell behind the retained window, or that starts fresh, gets a snapshot of every
key cached now instead.

Invariants:
- Sequence numbers are consecutive from 1 within one log; `epoch` (random) names the log, so a new
  engine (a role switch re-purposes the KV memory, every block starting free) is never mistaken for
  the old one's continuation.
- `keys()` is exactly the set the events since the start imply (stored minus removed), so a
  snapshot and the events after its sequence number give the same state as every event in order.
- Thread-safe: the engine thread appends, gRPC handlers read, under one lock; appending is O(1).
- Memory: at most `retain` events (default 65,536, ~5 MB) plus one int per cached block.

A truncated key can collide; the router uses it only to choose a worker, and the worker itself
matches full hashes, so a collision costs at most a recompute, never a wrong K/V.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass

#: Events kept for subscribers that fall behind; older ones get a snapshot instead.
DEFAULT_RETAIN = 65_536


def event_key(prefix_hash: bytes) -> int:
    """The 64-bit key of a block's prefix hash (its first 8 bytes, little-endian)."""
    return int.from_bytes(prefix_hash[:8], "little")


@dataclass(frozen=True)
class EventBatch:
    """What a subscriber reads: events `first_seq..last_seq` in order (`stored[i]` tells whether
    `keys[i]` was stored or removed), or with `snapshot` every key cached as of `last_seq`."""

    epoch: int
    first_seq: int
    last_seq: int
    keys: tuple[int, ...]
    stored: tuple[bool, ...]
    snapshot: bool


class KvEventLog:
    """The numbered stored/removed events of one block pool's prefix cache (see the module doc)."""

    def __init__(self, retain: int = DEFAULT_RETAIN) -> None:
        if retain < 1:
            raise ValueError(f"retain must be >= 1, got {retain}")
        self.epoch = int.from_bytes(os.urandom(8), "little") or 1
        self._lock = threading.Lock()
        self._events: deque[tuple[int, bool]] = deque(maxlen=retain)
        self._last_seq = 0
        self._keys: set[int] = set()
        self._changed = threading.Condition(self._lock)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._last_seq

    def stored(self, prefix_hash: bytes) -> None:
        self._append(event_key(prefix_hash), True)

    def removed(self, prefix_hash: bytes) -> None:
        self._append(event_key(prefix_hash), False)

    def _append(self, key: int, stored: bool) -> None:
        with self._lock:
            self._last_seq += 1
            self._events.append((key, stored))
            if stored:
                self._keys.add(key)
            else:
                self._keys.discard(key)
            self._changed.notify_all()

    def keys(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._keys)

    def read(self, after_seq: int, max_events: int = 4096) -> EventBatch | None:
        """Events after `after_seq` (at most `max_events`), a snapshot when they are no longer all
        retained (or `after_seq` is 0, or from the future: another epoch), or None when there is
        nothing new."""
        with self._lock:
            first_retained = self._last_seq - len(self._events) + 1
            if after_seq <= 0 or after_seq > self._last_seq or after_seq + 1 < first_retained:
                return EventBatch(
                    self.epoch,
                    self._last_seq + 1,
                    self._last_seq,
                    tuple(self._keys),
                    (True,) * len(self._keys),
                    snapshot=True,
                )
            if after_seq == self._last_seq:
                return None
            start = after_seq + 1 - first_retained
            count = min(max_events, self._last_seq - after_seq)
            events = [self._events[start + i] for i in range(count)]
        return EventBatch(
            self.epoch,
            after_seq + 1,
            after_seq + count,
            tuple(k for k, _ in events),
            tuple(s for _, s in events),
            snapshot=False,
        )

    def wait(self, after_seq: int, timeout_s: float) -> bool:
        """Block until an event after `after_seq` exists or `timeout_s` passes; whether one does."""
        with self._lock:
            return self._changed.wait_for(lambda: self._last_seq > after_seq, timeout=timeout_s)

    def lookup(self, keys: list[int]) -> int:
        """How many of `keys`, from the first, are cached now (the longest cached prefix, in blocks)."""
        with self._lock:
            for count, key in enumerate(keys):
                if key not in self._keys:
                    return count
            return len(keys)
