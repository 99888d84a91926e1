"""Waiting for a state in tests: poll a condition instead of sleeping a fixed time.

A fixed `time.sleep` is either too short (a flaky test on a loaded machine) or too long (every run pays
the worst case). `eventually` returns as soon as the condition holds and fails, naming what it waited
for, once the timeout has passed without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T], timeout: float = 30.0, interval: float = 0.02, what: str = "condition") -> T:
    """Call `condition()` until it returns a truthy value and return that value; AssertionError after
    `timeout` seconds without one. The condition is checked once more at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
