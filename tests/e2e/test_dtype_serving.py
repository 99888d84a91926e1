"""--dtype end to end, real processes on loopback with a tiny model: a bf16 1P1D deployment ships
bf16 K/V (half the bytes of fp32) and answers what a bf16 engine in this process answers; a
prefill worker whose dtype differs from its decode worker's is refused with the cause named."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_text

from e2e_helpers import generate, worker_info

PROMPTS = ["the river ran past the old mill " * 6, "hello", "children played on its banks until evening"]
MAX_TOKENS = 6


def _cluster(model: Path, dtype: str, prefill_args: tuple[str, ...] = ()) -> LocalCluster:
    return LocalCluster(
        local_deployment(model=str(model), prefill=1, decode=1, threads_per_worker=1, device="cpu", dtype=dtype),
        LaunchOptions(prefill_args=prefill_args, decode_args=("--kv-backend", "grpc")),
    )


@pytest.mark.slow
def test_bf16_1p1d_ships_bf16_kv_and_matches_the_engine(tiny_llama_dir: Path) -> None:
    """The in-process engine follows the deployment's kernel table, as both workers do: the same kernel
    at the same row count, so the same bf16 sums (without it, on a CPU that offers oneDNN's bf16
    kernel, timing per process chose differently and changed a token)."""
    with _cluster(tiny_llama_dir, "bfloat16") as cluster:
        table = cluster.config.model.kernel_table
        loaded = load_model(tiny_llama_dir, torch.bfloat16)
        engine = LLMEngine(loaded, EngineConfig(dtype="bfloat16", num_blocks=64, kernel_table=table))
        ids = [encode_text(loaded.tokenizer, p) for p in PROMPTS]
        expected = [engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS))[0] for p in ids]
        shape = loaded.kv_shape(16)
        got = [generate(cluster.router_address, p, MAX_TOKENS).token_ids for p in PROMPTS]
        infos = {w.role: worker_info(w.address, w.role) for w in cluster.workers}
        received = infos["decode"].kv_bytes_received
    assert table is not None
    assert engine.runner.kernels.startswith("deployment table")
    assert infos["prefill"].kernels == infos["decode"].kernels == engine.runner.kernels
    assert got == expected
    assert shape.dtype == torch.bfloat16
    assert received == sum(math.ceil(len(p) / 16) for p in ids) * shape.bytes_per_block  # 2 bytes a value


@pytest.mark.slow
def test_prefill_and_decode_of_different_dtypes_are_refused(tiny_llama_dir: Path) -> None:
    with _cluster(tiny_llama_dir, "float32", prefill_args=("--dtype", "bfloat16")) as cluster:
        with pytest.raises(grpc.RpcError) as err:
            generate(cluster.router_address, PROMPTS[0], MAX_TOKENS, timeout=60)
        assert "dtype" in (err.value.details() or "")
