"""Names of devices and dtypes a worker accepts, without importing torch.

Shared by launcher and worker (it lives here, not in `engine`, so launchers stay free of torch). The
launchers (`cluster.local`, `cluster.ray_cluster`, the CLI) validate `--device` / `--dtype`
with these before starting any process, and pass them on with `worker_flags`; the engine
(`engine.config`) resolves "auto" to a concrete device and dtype inside each worker.
"""

from __future__ import annotations

import re

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DEVICE_HELP = "auto (CUDA when available, else CPU), cpu, cuda or cuda:N"
DTYPE_HELP = "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16"
_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(device: str) -> str:
    """`device` when well formed ("auto", "cpu", "cuda", "cuda:N"); ValueError otherwise.
    Says nothing about whether that device exists here."""
    if not isinstance(device, str) or not _DEVICE_PATTERN.fullmatch(device):
        raise ValueError(f"device must be one of auto, cpu, cuda, cuda:N; got {device!r}")
    return device


def check_dtype_name(dtype: str) -> str:
    """`dtype` when it is one of DTYPE_NAMES; ValueError otherwise."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {dtype!r}")
    return dtype


def worker_flags(device: str, dtype: str) -> list[str]:
    """The worker command-line flags that carry a device and dtype choice."""
    return ["--device", check_device_name(device), "--dtype", check_dtype_name(dtype)]
