"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """How one worker's engine runs.

    model: local Hugging Face folder, or None for the default model.
    kv_cache_memory_mb: memory budget of the KV cache; the block count is derived from it unless
        num_blocks is given.
    max_num_seqs: most sequences in one decode batch.
    max_num_batched_tokens: most tokens (prompt chunks plus one per decoding sequence) in one pass.
    prefill_chunk_tokens: most prompt tokens of one sequence in one pass (chunked prefill), or None
        for as many as the pass budget allows.
    """

    model: str | None = None
    dtype: str = "float32"
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

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
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
