"""One linear-kernel table per deployment: which kernel serves each weight shape at each row count.

`engine.fast_forward.LinearFactory` chooses, per weight shape and row count, the fastest of the
kernels a machine has (pdserve's native kernel, `F.linear`, oneDNN's packed linear) by timing them.
Timing is per process, so two workers of one deployment could choose differently (a busy machine,
another thread count), and in bfloat16 another kernel's summation order changes tokens. So a
launcher times once and hands every worker the same `KernelTable`:

- `python -m pdserve.engine.kernel_table --model DIR --dtype D --threads N` times the model's linear
  shapes (from its config.json, on random weights: no model load) at the workers' thread count and
  keeps the table in pdserve's cache folder (`kernel-tables/<key>.json`, keyed by the model's shapes,
  dtype, thread count, CPU identity, torch version and the native kernels' source), so a later
  deployment on the same machine reads it in milliseconds;
- `deployment_table` is the launcher's side (local and Ray): the cached table, else that command in
  a subprocess; the table's JSON goes into every worker's config (`model.kernel_table`);
- a worker whose CPU identity differs from the table's (another node model) times its own and says
  so (`KernelTable.describe_use`, shown by `pdserve status`).

Torch-free at import: the launcher builds a table's cache key without importing torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TABLE_VERSION = 1
#: CPU flags that decide which kernels a machine has and how they compute.
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "avx_ne_convert")
_NATIVE_SOURCE = Path(__file__).with_name("native.cpp")

Bands = tuple[tuple[str, int], ...]
#: The linear kernels a band may name (engine.fast_forward.Linear).
KERNELS = ("native", "plain", "packed")


def cpu_identity() -> str:
    """The CPU model, its kernel-relevant flags and the torch version: what a kernel choice depends on
    besides the thread count (torch-free)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    present = "+".join(f for f in _CPU_FLAGS if f in flags) or "baseline"
    return f"{model}|{present}|torch {torch_version}"


def as_bands(value: Any) -> Bands | None:  # noqa: ANN401 - a JSON value
    """A JSON list of [kernel, from_rows] (rows ascending from 1, known kernels) as bands, or None."""
    if not isinstance(value, list) or not value:
        return None
    try:
        bands = tuple((str(kernel), int(rows)) for kernel, rows in value)
    except (TypeError, ValueError):
        return None
    ok = bands[0][1] == 1 and all(a[1] < b[1] for a, b in zip(bands, bands[1:], strict=False))
    return bands if ok and all(kernel in KERNELS for kernel, _ in bands) else None


@dataclass(frozen=True)
class KernelTable:
    """Kernel bands per weight entry ("KxN|layout|kernels", LinearFactory.entry_key), timed on `cpu`
    at `threads` threads in `dtype`."""

    cpu: str
    threads: int
    dtype: str
    entries: dict[str, Bands] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": TABLE_VERSION,
                "cpu": self.cpu,
                "threads": self.threads,
                "dtype": self.dtype,
                "entries": {k: [list(b) for b in v] for k, v in sorted(self.entries.items())},
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> KernelTable:
        """The table in `text` (ValueError naming what is wrong)."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kernel table: not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
            raise ValueError(f"kernel table: expected an object of version {TABLE_VERSION}")
        entries = data.get("entries")
        if not isinstance(entries, dict):
            raise ValueError("kernel table: 'entries' must be an object")
        bands = {str(k): as_bands(v) for k, v in entries.items()}
        bad = [k for k, v in bands.items() if v is None]
        if bad:
            raise ValueError(f"kernel table: entry {bad[0]!r} is not a list of [kernel, from_rows]")
        if not isinstance(data.get("threads"), int) or not isinstance(data.get("cpu"), str):
            raise ValueError("kernel table: 'cpu' (string) and 'threads' (integer) are required")
        return cls(
            cpu=data["cpu"],
            threads=data["threads"],
            dtype=str(data.get("dtype")),
            entries={k: v for k, v in bands.items() if v is not None},
        )

    @classmethod
    def load(cls, value: str) -> KernelTable:
        """A table from its JSON text or from a file holding it."""
        text = value if value.lstrip().startswith("{") else Path(value).read_text()
        return cls.from_json(text)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]


def linear_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """(N, K) of every distinct linear the fast forward builds for a Llama-family config.json:
    fused q/k/v, o, fused gate/up, down, and the LM head."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    shapes = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inter, hidden),
        (hidden, inter),
        (vocab, hidden),
    ]
    return list(dict.fromkeys(shapes))


def _timing_method() -> str:
    # fast_forward.TIMING, read from its source: importing fast_forward would import torch
    text = Path(__file__).with_name("fast_forward.py").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("TIMING = ")), "TIMING = ?")
    return line.split("=", 1)[1].strip()


def cache_path(model_dir: Path, dtype: str, threads: int) -> Path:
    """Where the table of this model's shapes, dtype and thread count on this machine is kept."""
    from pdserve.model_cache import cache_root

    config = json.loads((model_dir / "config.json").read_text())
    native = hashlib.sha256(_NATIVE_SOURCE.read_bytes()).hexdigest() if _NATIVE_SOURCE.is_file() else ""
    parts = [
        str(TABLE_VERSION),
        json.dumps(linear_shapes(config)),
        dtype,
        str(threads),
        cpu_identity(),
        native,
        _timing_method(),
        os.environ.get("PDSERVE_NATIVE", ""),
    ]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
    return cache_root() / "kernel-tables" / f"{key}.json"


def time_table(model_dir: Path, dtype: str, threads: int) -> KernelTable:
    """Time the model's linear shapes on random weights at `threads` threads (the LinearFactory's own
    timing, which also reuses what this machine remembered) and return the table."""
    import torch

    from pdserve.engine.fast_forward import LinearFactory

    torch.set_num_threads(threads)
    config = json.loads((model_dir / "config.json").read_text())
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    factory = LinearFactory(torch_dtype, torch.device("cpu"), mode="auto")
    generator = torch.Generator().manual_seed(0)
    entries: dict[str, Bands] = {}
    for n, k in linear_shapes(config):
        weight = (torch.randn(n, k, generator=generator) * k**-0.5).to(torch_dtype)
        if factory.column_major:  # stored as the fast forward stores it
            weight = weight.t().contiguous().t()
        entries[factory.entry_key(k, n)] = factory(weight).bands
    return KernelTable(cpu=cpu_identity(), threads=threads, dtype=dtype, entries=entries)


def ensure_table(model_dir: Path, dtype: str, threads: int) -> Path:
    """The cached table's path, timing and writing it first if it is not there."""
    path = cache_path(model_dir, dtype, threads)
    if path.is_file():
        try:
            KernelTable.load(str(path))
            return path
        except (OSError, ValueError):
            pass  # a damaged file: time again
    table = time_table(model_dir, dtype, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(table.to_json())
    os.replace(tmp, path)
    return path


def deployment_table(
    model_dir: Path, dtype: str, threads: int, timeout_s: float = 300.0, env: dict[str, str] | None = None
) -> KernelTable:
    """The launcher's side: this machine's cached table, else timed by a subprocess (so the launcher
    imports no torch). RuntimeError with the subprocess's last words when timing fails."""
    path = cache_path(model_dir, dtype, threads)
    if path.is_file():
        try:
            return KernelTable.load(str(path))
        except (OSError, ValueError):
            pass
    print(
        f"pdserve: timing linear kernels once for this machine ({dtype}, {threads} threads)",
        file=sys.stderr,
        flush=True,
    )
    argv = [
        sys.executable,
        "-m",
        "pdserve.engine.kernel_table",
        "--model",
        str(model_dir),
        "--dtype",
        dtype,
        "--threads",
        str(threads),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"timing linear kernels failed: {done.stderr.strip()[-800:]}")
    return KernelTable.load(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.engine.kernel_table",
        description="Time the linear kernels for a model's shapes on this machine "
        "(once; cached) and print the table file's path.",
    )
    parser.add_argument("--model", default=None, help="local Hugging Face folder (default: the default model)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the workers' torch threads")
    parser.add_argument("--show", action="store_true", help="print the table itself too")
    args = parser.parse_args(argv)
    from pdserve.engine.model_fetch import resolve_model

    path = ensure_table(resolve_model(args.model), args.dtype, max(1, args.threads))
    if args.show:
        print(Path(path).read_text(), file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
