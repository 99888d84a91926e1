"""Child processes that announce readiness with a PDSERVE_READY line (workers and the router).

Protocol: a pdserve process prints exactly one line ``PDSERVE_READY {json}`` to stdout once serving
(json has at least "address", "worker_id", "pid"; extra keys are ignored); logs go to stderr.

Invariants: a ManagedProcess's stderr and any other stdout lines go to its log file; stdout is drained
by a daemon thread so the child never blocks on a full pipe; ``stop`` is idempotent and leaves no
running child (SIGTERM, then SIGKILL after the grace period).
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from pdserve.serving import READY_PREFIX  # the one definition, shared by every process

STDERR_TAIL_BYTES = 4000


class ProcessStartError(RuntimeError):
    """A child exited or timed out before its READY line; the message holds its stderr tail."""


def parse_ready_line(line: str) -> dict[str, object] | None:
    """The JSON payload of a READY line, or None if ``line`` is not one."""
    if not line.startswith(READY_PREFIX):
        return None
    payload = json.loads(line[len(READY_PREFIX) :].strip())
    if not isinstance(payload, dict) or "address" not in payload:
        raise ValueError(f"malformed READY line: {line.strip()!r}")
    return payload


class ManagedProcess:
    """One child process with its log file and its READY announcement."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._ready: queue.Queue[dict[str, object] | None] = queue.Queue()
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=False,
        )
        self._reader = threading.Thread(target=self._drain_stdout, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain_stdout(self) -> None:
        assert self.proc.stdout is not None
        announced = False
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace")
            ready = None if announced else _try_parse(line)
            if ready is not None:
                announced = True
                self._ready.put(ready)
            else:
                self._log.write(raw)
                self._log.flush()
        self._ready.put(None)

    def wait_ready(self, timeout_s: float) -> dict[str, object]:
        """Block until the READY line (its payload) ; ProcessStartError on exit or timeout."""
        try:
            ready = self._ready.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            raise ProcessStartError(
                f"{self.name} not ready after {timeout_s:.0f} s (log: {self.log_path})\n{self.stderr_tail()}"
            ) from None
        if ready is None:
            code = self._wait_exit(5.0)
            raise ProcessStartError(
                f"{self.name} exited with code {code} before it was ready (log: {self.log_path})\n{self.stderr_tail()}"
            )
        return ready

    def _wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stderr_tail(self) -> str:
        """The last few KB of this process's log."""
        self._log.flush()
        data = self.log_path.read_bytes()[-STDERR_TAIL_BYTES:]
        return data.decode("utf-8", errors="replace")

    def terminate(self) -> None:
        """Send SIGTERM if still running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        """Wait until ``deadline`` (monotonic) for exit, then SIGKILL; close the log."""
        if self._wait_exit(max(0.0, deadline - time.monotonic())) is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=1.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def _try_parse(line: str) -> dict[str, object] | None:
    try:
        return parse_ready_line(line)
    except ValueError:
        return None


def stop_all(processes: Sequence[ManagedProcess], grace_s: float) -> None:
    """SIGTERM every process, give them ``grace_s`` seconds together, SIGKILL the rest."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.finish(deadline)
