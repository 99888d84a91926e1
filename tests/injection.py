"""Fault injection for tests: the PDSERVE_INJECT_* variables (pdserve.engine.fault_injection) set
while a worker starts. A worker reads them once, at start; the local launcher passes its
environment on to the processes it starts, so the same works for whole clusters."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from pdserve.engine.fault_injection import InjectedFaults


@contextmanager
def injected(**faults: object) -> Iterator[None]:
    """Set the variables of InjectedFaults(**faults) for the block, then restore the environment."""
    env = InjectedFaults(**faults).env()  # type: ignore[arg-type]
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
