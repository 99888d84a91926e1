"""How many threads the engine's passes compute on, chosen from the passes' own times.

A pass computes on a team of torch (OpenMP) threads, one per core it was given. Most of a pass's
time is in kernels that split their work evenly and wait at the end for every thread (oneDNN's
GEMMs among them), so when another program takes one of those cores (a tokenizer, the router, the
other pool's worker, a neighbour's job), the thread sharing that core runs at a fraction of its
speed and every kernel waits for it: measured with `benchmarks/busy_neighbour.py` on a 2-core
host, a batch-32 bf16 step took 3.9x its quiet time beside one spinning process, while a
1-thread step beside the same spinner took 1.6x. pdserve's own kernels take their tasks one at a
time (engine/native.cpp `share_tasks`) and lose less, but the GEMMs dominate a step.

So the engine measures. It runs at `threads` (the worker's setting) and, every `probe_every`
pure decode passes, runs one pass of the same batch size with one thread fewer. When two probes in
a row beat the recent passes at the current count by `margin`, it moves there (and logs why);
from then on it probes the other count the same way, so it moves back when the neighbour leaves.
A probe that loses waits twice as long before the next one (up to `max_probe_every`), so a quiet
machine pays about one slower pass in a few hundred; a pass `slowdown` times slower than the recent
ones at its count (a neighbour just started) probes at once.

Tokens do not change with the thread count: pdserve's kernels split outputs, never a sum, and the
engine turns this on only after checking that every linear kernel of the model gives the same bits
at both counts (`FastForward.thread_invariant`); deterministic mode and non-CPU devices keep their
count fixed. `PDSERVE_ADAPT_THREADS=0` (or EngineConfig.adapt_threads=False) turns it off.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections import deque

log = logging.getLogger(__name__)

ADAPT_ENV = "PDSERVE_ADAPT_THREADS"


def adapt_requested(setting: bool = True) -> bool:
    """The setting, unless PDSERVE_ADAPT_THREADS says 0/false/no/off."""
    return setting and os.environ.get(ADAPT_ENV, "").strip().lower() not in ("0", "false", "no", "off")


class ThreadGovernor:
    """Chooses each pass's thread count: `threads_for(key)` before a pass, `record(...)` after.

    `key` names passes whose times compare (the engine passes the batch size of a pure decode
    pass; None for any other pass, which runs at the current count and teaches nothing)."""

    def __init__(
        self,
        threads: int,
        probe_every: int = 16,
        max_probe_every: int = 512,
        margin: float = 0.9,
        wins_to_move: int = 2,
        history: int = 6,
        slowdown: float = 1.3,
    ) -> None:
        if threads < 2:
            raise ValueError("a thread governor needs at least two threads to choose between")
        self.counts = (threads, threads - 1)
        self.current = threads
        self.probe_every, self.base_probe_every, self.max_probe_every = probe_every, probe_every, max_probe_every
        self.margin, self.wins_to_move, self.slowdown = margin, wins_to_move, slowdown
        self._since_probe = 0
        self._wins = 0
        self._recent: dict[object, deque[float]] = {}
        self._history = history
        self.moves = 0  # how often the count changed (pdserve status / tests)

    @property
    def other(self) -> int:
        return self.counts[1] if self.current == self.counts[0] else self.counts[0]

    def threads_for(self, key: object | None) -> int:
        """The thread count of the next pass."""
        if key is None:
            return self.current
        self._since_probe += 1
        recent = self._recent.get(key)
        if self._since_probe >= self.probe_every and recent is not None and len(recent) >= 3:
            self._since_probe = 0
            return self.other
        return self.current

    def record(self, key: object | None, threads: int, seconds: float) -> None:
        """A pass of `key` ran on `threads` threads in `seconds`."""
        if key is None:
            return
        recent = self._recent.setdefault(key, deque(maxlen=self._history))
        if threads == self.current:
            if len(recent) >= 3 and seconds > self.slowdown * statistics.median(recent):
                self._since_probe = max(self._since_probe, self.probe_every)  # something changed: probe now
                self.probe_every = self.base_probe_every
            recent.append(seconds)
            return
        if not recent:  # a probe without a baseline (the count moved meanwhile)
            return
        baseline = statistics.median(recent)
        if seconds < self.margin * baseline:
            self._wins += 1
            self._since_probe = self.probe_every  # confirm with the next comparable pass
            if self._wins >= self.wins_to_move:
                log.info(
                    "engine threads %d -> %d: a pass of %s took %.1f ms on %d threads against %.1f ms on %d "
                    "(another program is using this worker's cores, or stopped)",
                    self.current,
                    threads,
                    key,
                    seconds * 1e3,
                    threads,
                    baseline * 1e3,
                    self.current,
                )
                self.current, self._wins, self.moves = threads, 0, self.moves + 1
                self.probe_every = self.base_probe_every
                self._recent.clear()  # the old count's times say nothing about the new one
                self._since_probe = 0
        else:
            self._wins = 0
            self.probe_every = min(self.max_probe_every, self.probe_every * 2)

    def describe(self) -> str:
        return f"{self.current} of {self.counts[0]} threads (adaptive; moved {self.moves} times)"
