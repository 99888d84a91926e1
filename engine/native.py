"""pdserve's own float32 / bfloat16 CPU kernels (native.cpp), compiled once per machine, as torch ops.

- **linear**: a batch-1 decode step reads every weight once, so its speed is the rate at which its
  GEMVs read memory. MKL's GEMV and the packed oneDNN kernel read at 14-24 GB/s on the AVX2 EPYC of
  docs/performance.md where a plain tensor sum reads at about 30 GB/s; this kernel streams each
  weight row-major, four rows at a time across both cores, at 23-28 GB/s
  (`python benchmarks/gemv_layout.py --rows 1 2 4`). `LinearFactory` (engine/fast_forward.py)
  times it against the other kernels per weight shape and row count and uses it where it wins.
- **rms_norm**: torch's `F.rms_norm` runs as seven ops on the CPU (about 45 us for one row of 576);
  this is one pass per row.
- **decode_attention**: the decoding sequences' attention reading each key and value where it lies
  in the paged cache (vLLM's CPU build does the same in C++), instead of gathering every
  sequence's whole context into a contiguous copy per layer per step (engine/attention.py).

They are built on first use with torch's C++ extension builder (g++ and ninja; about 15 s), into
torch's extension folder (`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) under a
name that changes with the source, so a restarted worker loads it in milliseconds and concurrent
builders wait on torch's lock. `./run setup` builds it ahead. Where it cannot be used (not x86-64,
no AVX2/FMA, a dtype other than float32 or bfloat16, no compiler, `PDSERVE_NATIVE=0`), `native_unavailable()` says why
and the engine runs torch's kernels (MKL, oneDNN) as before.

Exactness: each dot product (a linear's output, a norm's sum of squares, an attention score) is
summed in eight lanes then across them, so results differ from MKL's and torch's in the last
bits, as two BLAS libraries do; greedy fp32 tokens are held identical to transformers' `generate`
(tests/engine/test_fast_forward.py, tests/engine/test_hf_equivalence.py). Threads split outputs,
never a sum, so an output's bits do not depend on the thread count or on the other rows of the
batch (tests/engine/test_native.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NATIVE_ENV = "PDSERVE_NATIVE"
SOURCE = Path(__file__).with_name("native.cpp")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")  # OpenMP: the same libgomp as torch's (one pool)


def _disabled() -> bool:
    return os.environ.get(NATIVE_ENV, "").strip().lower() in ("0", "false", "no", "off")


def _library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]
    return f"pdserve_native_{digest}"


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; a venv's ninja (the `ninja` package, a pdserve
    dependency) is not on it when the venv's python runs without the venv activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # type: ignore[import-not-found]
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


@functools.cache
def _load() -> str | None:
    """Build (first time on this machine) and load the kernel; None when loaded, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU has no AVX2 ({torch.backends.cpu.get_cpu_capability()})"
    start = time.perf_counter()
    _ninja_on_path()
    try:
        from torch.utils.cpp_extension import load

        load(
            _library_name(),
            [str(SOURCE)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a read-only cache, ...
        lines = str(e).strip().splitlines()
        return f"building it failed ({type(e).__name__}: {lines[-1] if lines else 'no message'})"
    took = time.perf_counter() - start
    if took > 1.0:
        log.info("native kernels built in %.1f s", took)

    # their shapes, for graphs that torch.compile traces through them (engine/compiled_layer.py)
    @torch.library.register_fake("pdserve_native::linear")
    def _linear_shape(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("pdserve_native::rms_norm")
    def _norm_shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x.new_empty(x.shape)

    return None


def native_unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the native kernels cannot serve tensors of this dtype and device (None when they can);
    the first call on a machine builds them."""
    if _disabled():
        return f"{NATIVE_ENV}=0"
    if device.type != "cpu":
        return f"device {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 and bfloat16 only)"
    return _load()


def native_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """residual + (x weight^T + bias): x [M, K], weight [N, K] contiguous -> [M, N] (the kernel
    must be loaded: `native_unavailable` returned None)."""
    return torch.ops.pdserve_native.linear(x, weight, bias, residual)


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2, -1) + eps)) over x [M, K] (rows contiguous) -> [M, K]."""
    return torch.ops.pdserve_native.rms_norm(x, weight, eps)


def native_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [B, Hq, D] against each sequence's first context_lens[b] cached keys and values,
    read in place from one layer's key_cache / value_cache [num_blocks, block_size, Hkv, D]
    through block_tables [B, max_blocks] -> [B, Hq, D]."""
    return torch.ops.pdserve_native.decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)


def main() -> None:
    """`python -m pdserve.engine.native`: build the kernels now (./run setup does) and say whether
    they run here."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = native_unavailable(torch.float32, torch.device("cpu"))
    print("ready" if reason is None else f"not used ({reason}); torch's kernels serve instead")


if __name__ == "__main__":
    main()
