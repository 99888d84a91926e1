"""The pass log: one CSV line per engine pass, for fitting a profile to what serving really costs.

Set ``PDSERVE_PASS_LOG=DIR`` in a worker's environment (workers started by `pdserve serve`,
`bench` or `sweep` inherit it) and each engine writes ``DIR/passes-<pid>-<n>.csv``: the wall time
of every `LLMEngine.step` that ran a pass (scheduling, forward pass, sampling and applying the
tokens; what the worker's loop thread is busy with per pass), with the pass's composition in the
terms of the profile's pass model (`engine.sim_profile`):

    seconds, decode_batch, decode_context, prefill_tokens, prefill_attention

``decode_context`` is the decoding sequences' context tokens in total (this pass's token
included) and ``prefill_attention`` is sum(new_i * (cached_i + new_i)) over prompt chunks, as the
simulated engine counts them. `pdserve plan fit --pass-log DIR` fits a profile to these
lines (`capacity.profiler.fit_pass_log`): mixed passes, sampling, scheduling and the contention of
the workers that ran beside it are then in the fit, as measured while serving.

Lines are written as passes end (line-buffered), so a worker that is killed loses at most the
pass it was in. Nothing is logged when the variable is unset.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import TextIO

ENV_VAR = "PDSERVE_PASS_LOG"
COLUMNS = ("start_s", "seconds", "decode_batch", "decode_context", "prefill_tokens", "prefill_attention")
_counter = itertools.count()  # next() on it is atomic: engines built on two threads get two files


class PassLog:
    """Appends one line per pass to a CSV file of this process's own."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("w", buffering=1, encoding="utf-8")
        self._file.write(",".join(COLUMNS) + "\n")

    @classmethod
    def from_env(cls) -> PassLog | None:
        """A log in ``$PDSERVE_PASS_LOG`` (a directory), or None when it is unset or empty."""
        folder = os.environ.get(ENV_VAR, "")
        if not folder:
            return None
        return cls(Path(folder) / f"passes-{os.getpid()}-{next(_counter)}.csv")

    def write(
        self,
        start_s: float,
        seconds: float,
        decode_batch: int,
        decode_context: int,
        prefill_tokens: int,
        prefill_attention: int,
    ) -> None:
        self._file.write(
            f"{start_s:.6f},{seconds:.6f},{decode_batch},{decode_context},{prefill_tokens},{prefill_attention}\n"
        )

    def close(self) -> None:
        self._file.close()


def read_pass_logs(paths: list[Path]) -> list[dict[str, float]]:
    """Every line of the given pass-log files (a ValueError names a file that is not one)."""
    rows: list[dict[str, float]] = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        if not lines or tuple(lines[0].split(",")) != COLUMNS:
            raise ValueError(f"{path}: not a pass log (its first line must be {','.join(COLUMNS)})")
        for number, line in enumerate(lines[1:], start=2):
            fields = line.split(",")
            if len(fields) != len(COLUMNS):
                if number == len(lines):  # the last line of a killed worker may be cut short
                    break
                raise ValueError(f"{path}:{number}: expected {len(COLUMNS)} fields, got {len(fields)}")
            rows.append(dict(zip(COLUMNS, (float(f) for f in fields), strict=True)))
    return rows
