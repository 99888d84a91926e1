"""Engine configuration: one frozen dataclass, validated on construction.

Device and dtype: `device` is "auto", "cpu", "cuda" or "cuda:N"; `dtype` is "auto", "float32",
"bfloat16" or "float16". Both are resolved once, in `__post_init__`, so every consumer sees a
concrete value: "auto" device is "cuda" when CUDA is available, else "cpu"; "auto" dtype is
bfloat16 on CUDA and float32 on CPU (float32 on CPU keeps the token-for-token match with Hugging
Face). Weights, the KV pool, attention and sampling all follow the resolved pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.devices import check_device_name, check_dtype_name

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str, cuda_count: int | None = None) -> str:
    """ "auto" -> "cuda" when CUDA is available else "cpu"; "cuda[:N]" is checked against the
    visible GPUs (ValueError naming the problem). `cuda_count` overrides torch's count (tests)."""
    check_device_name(device)
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if device == "auto":
        return "cuda" if count > 0 else "cpu"
    if device.startswith("cuda"):
        if count == 0:
            raise ValueError(f"device {device!r}: CUDA is not available on this machine (use --device cpu)")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= count:
            raise ValueError(f"device {device!r}: only {count} CUDA device(s) visible")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """ "auto" -> "bfloat16" on a CUDA device, "float32" on CPU; other names are checked."""
    if check_dtype_name(dtype) == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return dtype


@dataclass(frozen=True)
class EngineConfig:
    """How one worker's engine runs.

    model: local Hugging Face folder, or None for the default model.
    dtype / device: as given ("auto" allowed); after construction always the resolved values
        (see the module docstring). The library default device is the CPU; the CLI's is "auto".
    kv_cache_memory_mb: memory budget of the KV cache; the block count is derived from it unless
        num_blocks is given.
    max_num_seqs: most sequences in one decode batch.
    max_num_batched_tokens: most tokens (prompt chunks plus one per decoding sequence) in one pass.
    prefill_chunk_tokens: most prompt tokens of one sequence in one pass (chunked prefill), or None
        for as many as the pass budget allows.
    compile: run decode passes through the torch.compile'd layer (engine/compiled_layer.py); also
        turned on by PDSERVE_COMPILE=1.
    deterministic: batch-invariant mode: a request's tokens do not depend on what else is in its
        batch, where its prompt was prefilled or how it was chunked (native kernels at every row
        count, per-row attention and sampling; docs/performance.md gives its cost).
    adapt_threads: let the engine compute a pass on one thread fewer when its own pass times show
        that to be faster (another program using a core; engine/thread_governor.py).
        PDSERVE_ADAPT_THREADS=0 turns it off too.
    kernel_table: the deployment's linear-kernel choices (engine/kernel_table.py; JSON text or a
        file), so every worker computes what the others compute; None: this process times its own.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_mb: int = 512
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    num_threads: int | None = None
    prefix_caching: bool = False
    prefill_chunk_tokens: int | None = None
    compile: bool = False
    deterministic: bool = False
    kernel_table: str | None = None
    adapt_threads: bool = True

    def __post_init__(self) -> None:
        device = resolve_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, device))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_mb <= 0:
            raise ValueError(f"kv_cache_memory_mb must be positive, got {self.kv_cache_memory_mb}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens <= 0:
            raise ValueError(f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
