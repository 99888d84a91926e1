"""The device check: one command on a bare CUDA machine (`bash benchmarks/gpu_check.sh`), under 8
minutes on one H200; `--device cpu` is the same script on tiny shapes, run by the test suite
(tests/test_gpu_check.py) so that it cannot rot between device runs.

No weights travel: each model is built where it runs, random weights seeded, on a real config
(`SHAPES`: the default model's, a Llama-3.2-1B and a Llama-3.1-8B shape, a Qwen2-0.5B shape; on the
CPU `TINY`). Only the default model's tokenizer files are carried (`--tokenizer`, made by
benchmarks/device_prepare.sh). Every figure is a ratio against a baseline measured in the same run:

  env        versions (torch, transformers, grpcio, protobuf) and the device
  exactness  fp32 (TF32 off): pdserve's greedy tokens equal transformers' `generate` on the same
             weights, for the 7 exactness prompts, batched and alone. bf16: logprob-close (vLLM's
             rule: where the tokens first differ, each side's token is in the other's top 5)
  decode     bf16 engine tok/s against transformers' static-batch `generate` (same weights, same
             prompts and lengths), at batch 1, 32 and 128, on each `--decode-shapes` shape
  floor      batch-1 decode step against the memory floor: bytes read per step (weights + K/V) /
             (step time x a same-run device-to-device copy bandwidth)
  prefill    prompt tok/s at 2,048 tokens, as achieved FLOP/s over a same-run GEMM's FLOP/s
  profile    the torch profiler's top ops of one decode step at batch 32 on the largest shape
  serving    1P1D against one colocated worker on the default shape (worker processes): TTFT, ITL
  kv         K/V hand-off bandwidth (gather to pinned host, scatter back, CUDA IPC to a process)

  python benchmarks/gpu_check.py --out DIR                       # on the device (gpu_check.sh)
  python benchmarks/gpu_check.py --device cpu --out DIR          # the dry run
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

Row = dict[str, object]
ROOT = Path(__file__).resolve().parents[1]

# Real model configurations (dimensions only; rope scaling left out): the default model (SmolLM2-135M),
# Llama-3.2-1B, Llama-3.1-8B, Qwen2-0.5B.
SHAPES: dict[str, dict[str, Any]] = {
    "default": {
        "family": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    "llama-1b": {
        "family": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama-8b": {
        "family": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "qwen2-0.5b": {
        "family": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}
TINY: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "family": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 49152,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "tiny-qwen2": {
        "family": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 49152,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}
PARAGRAPH = (
    "The river ran quietly past the old mill, carrying leaves and the last light of the evening. "
    "Children who had played on its banks all afternoon went home one by one, and the miller, "
    "an old man with flour in his beard, counted the sacks he would carry to market at dawn. "
)
EXACTNESS_PROMPTS = [  # tests/engine/test_hf_equivalence.py's 7 cases
    ("text", "Hello"),
    ("text", "济南的冬天"),
    ("text", "The capital of France is"),
    ("chat", "What is the capital of France?"),
    ("chat", "Write a short poem about the sea."),
    ("text", "def fibonacci(n):\n    "),
    ("text", PARAGRAPH * 9 + "Summarize the story above in one sentence:"),
]


# ----- models --------------------------------------------------------------------------------------
def shape_config(name: str, dims: dict[str, Any]) -> Any:  # noqa: ANN401 - a transformers config
    from transformers import LlamaConfig, Qwen2Config

    dims = dict(dims)
    family, theta = dims.pop("family"), dims.pop("rope_theta")
    cls = LlamaConfig if family == "llama" else Qwen2Config
    config = cls(
        **dims,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    config.name_or_path = name
    return config


def build(
    name: str,
    dims: dict[str, Any],
    dtype: torch.dtype,
    device: str,
    tokenizer: Any,  # noqa: ANN401
    seed: int = 0,
) -> Any:  # noqa: ANN401 - a LoadedModel
    """A LoadedModel of random weights (seeded; transformers' own init) built on `device`."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine import attention
    from pdserve.engine.model_loader import LoadedModel

    attention.register()
    torch.manual_seed(seed)
    config = shape_config(name, dims)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=Path(name),
        fingerprint=f"random-{name}-{seed}-{dtype}",
        eos_token_ids=frozenset(),
        max_model_len=8192,
    )


def use_attention(loaded: Any, which: str) -> None:  # noqa: ANN401
    """Switch the model between pdserve's paged attention ("pdserve") and transformers' ("sdpa")."""
    from pdserve.engine import attention

    name = attention.ATTN_IMPLEMENTATION if which == "pdserve" else "sdpa"
    setter = getattr(loaded.model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:
        loaded.model.config._attn_implementation = name


def engine_for(loaded: Any, device: str, dtype: str, num_blocks: int, max_num_seqs: int = 256) -> Any:  # noqa: ANN401
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    use_attention(loaded, "pdserve")
    return LLMEngine(
        loaded,
        EngineConfig(
            device=device, dtype=dtype, num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=16384
        ),
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate(
    loaded: Any,
    prompts: list[list[int]],
    max_tokens: int,
    device: str,  # noqa: ANN401
    scores: bool = False,
) -> Any:  # noqa: ANN401
    """transformers' greedy `generate` on a static batch (left-padded when lengths differ)."""
    use_attention(loaded, "sdpa")
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        return loaded.model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=scores,
        )


def encode(loaded: Any, kind: str, text: str) -> list[int]:  # noqa: ANN401
    from pdserve.tokenization import encode_chat, encode_text

    return encode_chat(loaded.tokenizer, [("user", text)]) if kind == "chat" else encode_text(loaded.tokenizer, text)


# ----- steps ---------------------------------------------------------------------------------------
def step_env(args: argparse.Namespace) -> list[Row]:
    from importlib import metadata

    rows: list[Row] = [
        {"step": "env", "what": "device", "value": args.device_name, "ok": True},
        {"step": "env", "what": "python", "value": platform.python_version(), "ok": True},
    ]
    for name in ("torch", "transformers", "grpcio", "protobuf"):
        rows.append({"step": "env", "what": name, "value": metadata.version(name), "ok": True})
    return rows


def step_exactness(args: argparse.Namespace) -> list[Row]:
    from pdserve.engine.sampling_params import SamplingParams

    rows: list[Row] = []
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape = args.exact_shape
    dims = (TINY if args.tiny else SHAPES)[shape]
    loaded = build(shape, dims, torch.float32, args.device, args.tok)
    prompts = [encode(loaded, kind, text) for kind, text in EXACTNESS_PROMPTS]
    ref = [hf_generate(loaded, [p], args.exact_tokens, args.device).sequences[0, len(p) :].tolist() for p in prompts]
    engine = engine_for(loaded, args.device, "float32", num_blocks=512)
    params = SamplingParams(max_tokens=args.exact_tokens, ignore_eos=True)
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    for label, ours in (("batched", batched), ("alone", alone)):
        same = sum(a == b for a, b in zip(ours, ref, strict=True))
        rows.append(
            {
                "step": "exactness",
                "what": f"fp32 {shape} greedy = HF generate, {label}",
                "value": f"{same}/{len(prompts)}",
                "ok": same == len(prompts),
            }
        )
    del engine, loaded
    # bf16: logprob-close
    loaded = build(shape, dims, torch.bfloat16, args.device, args.tok)
    out = hf_generate(loaded, prompts[:1], args.exact_tokens, args.device, scores=True)  # warm
    diverged, ok = 0, True
    engine = engine_for(loaded, args.device, "bfloat16", num_blocks=512)
    for p in prompts:
        ours = engine_greedy_with_top(engine, p, args.exact_tokens)
        out = hf_generate(loaded, [p], args.exact_tokens, args.device, scores=True)
        theirs_ids = out.sequences[0, len(p) :].tolist()
        theirs_top = [set(torch.log_softmax(s[0].float(), -1).topk(5).indices.tolist()) for s in out.scores]
        use_attention(loaded, "pdserve")
        for pos, (a, b) in enumerate(zip(ours[0], theirs_ids, strict=False)):
            if a != b:
                diverged += 1
                ok = ok and a in theirs_top[pos] and b in ours[1][pos]
                break
    rows.append(
        {
            "step": "exactness",
            "what": f"bf16 {shape} logprob-close to HF (prompts that diverged)",
            "value": f"{diverged}/{len(prompts)}",
            "ok": ok,
        }
    )
    return rows


def engine_greedy_with_top(engine: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[set[int]]]:  # noqa: ANN401
    from pdserve.engine.sampling_params import SamplingParams

    engine.add_request("top", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=5))
    ids: list[int] = []
    tops: list[set[int]] = []
    while engine.has_work:
        for out in engine.step():
            if out.token_id >= 0:
                ids.append(out.token_id)
                tops.append({t for t, _ in out.logprob.top} if out.logprob else set())
    return ids, tops


def timed(fn: Any, device: str, repeats: int = 3) -> float:  # noqa: ANN401
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_decode(args: argparse.Namespace) -> list[Row]:
    from pdserve.engine.sampling_params import SamplingParams

    rows: list[Row] = []
    table = TINY if args.tiny else SHAPES
    for shape in args.decode_shapes:
        loaded = build(shape, table[shape], args.torch_dtype, args.device, args.tok, seed=1)
        for batch in args.batches:
            prompts = [[100 + (i * 31 + j * 7) % 20000 for j in range(args.decode_prompt)] for i in range(batch)]
            blocks = batch * math.ceil((args.decode_prompt + args.decode_tokens) / 16) + 64
            engine = engine_for(loaded, args.device, args.dtype, num_blocks=blocks, max_num_seqs=max(batch, 1))
            params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
            ours = timed(
                lambda e=engine, p=prompts, s=params: e.generate(p, s),
                args.device,  # type: ignore[misc]
                repeats=args.repeats,
            )
            del engine
            hf = timed(
                lambda p=prompts, m=loaded: hf_generate(m, p, args.decode_tokens, args.device),  # type: ignore[misc]
                args.device,
                repeats=args.repeats,
            )
            tokens = batch * args.decode_tokens
            rows.append(
                {
                    "step": "decode",
                    "what": f"{shape} {args.dtype} batch {batch} engine tok/s",
                    "value": round(tokens / ours, 1),
                    "ok": True,
                }
            )
            rows.append(
                {
                    "step": "decode",
                    "what": f"{shape} {args.dtype} batch {batch} engine / HF static",
                    "value": round(hf / ours, 2),
                    "ok": True,
                }
            )
        del loaded
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=5)
    return 2 * nbytes / seconds


def running(engine: Any, batch: int, context: int) -> None:  # noqa: ANN401
    from pdserve.engine.sampling_params import SamplingParams

    for i in range(batch):
        engine.add_request(
            f"r{i}", [100 + (i + j) % 1000 for j in range(context)], SamplingParams(max_tokens=100_000, ignore_eos=True)
        )
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()


def step_floor(args: argparse.Namespace) -> list[Row]:
    shape = args.decode_shapes[-1]
    loaded = build(shape, (TINY if args.tiny else SHAPES)[shape], args.torch_dtype, args.device, args.tok, seed=2)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    engine = engine_for(loaded, args.device, args.dtype, num_blocks=64, max_num_seqs=1)
    running(engine, 1, 64)
    step = timed(engine.step, args.device, repeats=10)
    kv = engine.kv_cache.shape
    kv_bytes = 2 * kv.num_layers * 80 * kv.num_kv_heads * kv.head_dim * loaded.model.dtype.itemsize
    bandwidth = copy_bandwidth(args.device, min(2**30, 4 * weight_bytes))
    floor = (weight_bytes + kv_bytes) / bandwidth
    return [
        {"step": "floor", "what": f"{shape} batch-1 step ms", "value": round(step * 1e3, 3), "ok": True},
        {
            "step": "floor",
            "what": f"{shape} bytes per step / copy bandwidth ms",
            "value": round(floor * 1e3, 3),
            "ok": True,
        },
        {
            "step": "floor",
            "what": f"{shape} batch-1 step / memory floor (goal >= 0.5)",
            "value": round(floor / step, 3),
            "ok": True,
        },
    ]


def step_prefill(args: argparse.Namespace) -> list[Row]:
    from pdserve.engine.sampling_params import SamplingParams

    shape = args.decode_shapes[-1]
    dims = (TINY if args.tiny else SHAPES)[shape]
    loaded = build(shape, dims, args.torch_dtype, args.device, args.tok, seed=3)
    tokens = args.prefill_tokens
    engine = engine_for(loaded, args.device, args.dtype, num_blocks=math.ceil(tokens / 16) * 3 + 8, max_num_seqs=4)
    prompt = [100 + (j * 13) % 20000 for j in range(tokens)]
    seconds = timed(lambda: engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True)), args.device)
    params = sum(p.numel() for n, p in loaded.model.named_parameters() if "embed" not in n)
    achieved = 2 * params * tokens / seconds
    h, f = dims["hidden_size"], dims["intermediate_size"]
    a = torch.randn(tokens, h, dtype=args.torch_dtype, device=args.device)
    b = torch.randn(h, f, dtype=args.torch_dtype, device=args.device)
    gemm = 2 * tokens * h * f / timed(lambda: a @ b, args.device, repeats=10)
    return [
        {
            "step": "prefill",
            "what": f"{shape} {tokens}-token prompt tok/s",
            "value": round(tokens / seconds, 1),
            "ok": True,
        },
        {
            "step": "prefill",
            "what": f"{shape} achieved TFLOP/s / same-run GEMM TFLOP/s",
            "value": round(achieved / gemm, 3),
            "ok": True,
        },
    ]


def step_profile(args: argparse.Namespace) -> list[Row]:
    from torch.profiler import ProfilerActivity, profile

    shape = args.decode_shapes[-1]
    loaded = build(shape, (TINY if args.tiny else SHAPES)[shape], args.torch_dtype, args.device, args.tok, seed=4)
    batch = 32 if not args.tiny else 4
    engine = engine_for(loaded, args.device, args.dtype, num_blocks=batch * 8 + 16, max_num_seqs=batch)
    running(engine, batch, 64)
    engine.step()
    on_gpu = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        engine.step()
        sync(args.device)
    key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1
    print(prof.key_averages().table(sort_by=key, row_limit=12))
    return [
        {
            "step": "profile",
            "what": f"{shape} batch {batch} step: {e.key[:48]}",
            "value": f"{100 * getattr(e, key) / total:.1f}%",
            "ok": True,
        }
        for e in events[:8]
    ]


def save_default(args: argparse.Namespace, folder: Path) -> Path:
    """The default shape with random weights as a model folder (worker processes load it)."""
    shape = "tiny-llama" if args.tiny else "default"
    loaded = build(shape, (TINY if args.tiny else SHAPES)[shape], torch.float32, "cpu", args.tok, seed=5)
    loaded.model.save_pretrained(folder)
    args.tok.save_pretrained(folder)
    return folder


def streamed(client: Any, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[float], int]:  # noqa: ANN401
    from pdserve.cluster.client import build_request, sampling_params

    request = build_request(token_ids=prompt_ids, params=sampling_params(max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    stamps, tokens = [], 0
    for response in client.generate(request):
        if response.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(response.token_ids)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return (stamps[0] - start if stamps else float("nan")), gaps, tokens


def burst(address: str, num_prompts: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    from pdserve.cluster.client import PdserveClient

    prompts = [[100 + (i * 31 + j * 7) % 20000 for j in range(prompt_len)] for i in range(num_prompts)]
    with PdserveClient(address, timeout_s=300) as client:
        streamed(client, prompts[0][:16], 2)  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=num_prompts) as pool:
            results = list(pool.map(lambda p: streamed(client, p, max_tokens), prompts))
        wall = time.perf_counter() - start
    if any(tokens != max_tokens for _, _, tokens in results):
        raise RuntimeError(f"a request ended early: {[t for _, _, t in results]}")
    ttfts = sorted(r[0] for r in results)
    gaps = sorted(g for r in results for g in r[1])
    return {
        "ttft_ms_median": statistics.median(ttfts) * 1e3,
        "itl_ms_median": statistics.median(gaps) * 1e3,
        "output_tok_s": num_prompts * max_tokens / wall,
    }


def step_serving(args: argparse.Namespace) -> list[Row]:
    from pdserve.cluster.launch import LaunchOptions, local_deployment
    from pdserve.cluster.local import LocalCluster
    from pdserve.transport import open_channel
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    model = str(save_default(args, Path(tempfile.mkdtemp(prefix="pdserve-check-model-"))))
    on_gpu = args.device == "cuda"
    first, second = ("cuda:0", "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0") if on_gpu else ("cpu", "cpu")
    topologies = {
        "1p1d": (
            local_deployment(prefill=1, decode=1, model=model, device=args.device, dtype=args.dtype),
            LaunchOptions(prefill_args=("--device", first), decode_args=("--device", second)),
        ),
        "colocated": (
            local_deployment(prefill=0, decode=0, colocated=1, model=model, device=args.device, dtype=args.dtype),
            LaunchOptions(),
        ),
    }
    rows: list[Row] = []
    figures = {}
    for name, (config, options) in topologies.items():
        with LocalCluster(config, options) as cluster:
            figures[name] = burst(cluster.router_address, args.num_prompts, args.prompt_len, args.max_tokens)
            if name == "1p1d":
                decode = next(w for w in cluster.workers if w[0] == "decode")
                info = worker_pb2_grpc.DecodeWorkerStub(open_channel(decode[2])).GetInfo(
                    worker_pb2.InfoRequest(), timeout=10
                )
                rows.append(
                    {
                        "step": "serving",
                        "what": "1p1d decode worker prefilled no prompt",
                        "value": int(info.prefill_tokens_computed),
                        "ok": info.prefill_tokens_computed == 0,
                    }
                )
        for key, value in figures[name].items():
            rows.append({"step": "serving", "what": f"{name} {key}", "value": round(value, 2), "ok": True})
    for key in ("ttft_ms_median", "itl_ms_median", "output_tok_s"):
        rows.append(
            {
                "step": "serving",
                "what": f"1p1d/colocated {key}",
                "value": round(figures["1p1d"][key] / figures["colocated"][key], 2),
                "ok": True,
            }
        )
    return rows


def _ipc_child(conn: Any) -> None:  # noqa: ANN401 - a multiprocessing connection; bytes only cross it
    from pdserve.kv_transfer import cuda_ipc

    data, shape, dtype = conn.recv_bytes(), json.loads(conn.recv_bytes()), conn.recv_bytes().decode()
    start = time.perf_counter()
    tensor = cuda_ipc.import_tensor(cuda_ipc.unpack(data), tuple(shape), dtype)
    local = tensor.clone()
    torch.cuda.synchronize()
    conn.send_bytes(json.dumps({"sum": float(local.float().sum()), "s": time.perf_counter() - start}).encode())


def step_kv(args: argparse.Namespace) -> list[Row]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.kv_cache import KVCache, host_empty
    from pdserve.kv_transfer import cuda_ipc

    config = EngineConfig(device=args.device, dtype=args.dtype)
    shape_name = "tiny-llama" if args.tiny else "default"
    dims = (TINY if args.tiny else SHAPES)[shape_name]
    shape = build(shape_name, dims, config.torch_dtype, "cpu", args.tok).kv_shape(16)
    blocks = -(-args.kv_tokens // 16)
    src, dst = KVCache(shape, blocks * 2, config.device), KVCache(shape, blocks * 2, config.device)
    src.kv.normal_()
    ids = list(range(0, 2 * blocks, 2))  # every other block: a real gather, not one slice
    payload = src.gather(ids)
    nbytes = payload.numel() * payload.element_size()
    raw_host = host_empty(tuple(payload.shape), payload.dtype)
    raw_dev = src.gather_on_device(ids)
    d2h_raw = timed(lambda: raw_host.copy_(raw_dev, non_blocking=True), args.device, repeats=10)
    h2d_raw = timed(lambda: raw_dev.copy_(raw_host, non_blocking=True), args.device, repeats=10)
    d2h = timed(lambda: src.gather(ids), args.device, repeats=10)
    h2d = timed(lambda: dst.scatter(ids, payload), args.device, repeats=10)
    rows: list[Row] = [{"step": "kv", "what": f"{args.kv_tokens}-token K/V bytes", "value": nbytes, "ok": True}]
    for what, ours, raw in (("gather device->pinned host", d2h, d2h_raw), ("scatter host->device", h2d, h2d_raw)):
        rows.append({"step": "kv", "what": f"{what} GB/s", "value": round(nbytes / ours / 1e9, 2), "ok": True})
        rows.append({"step": "kv", "what": f"{what} / raw copy", "value": round(raw / ours, 2), "ok": True})
    if args.device != "cuda":
        return rows
    device_copy = src.gather_on_device(ids)
    expected = float(device_copy.float().sum())
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_child, args=(child,))
    proc.start()
    parent.send_bytes(cuda_ipc.pack(cuda_ipc.export_tensor(device_copy)))
    parent.send_bytes(json.dumps(list(device_copy.shape)).encode())
    parent.send_bytes(str(device_copy.dtype).removeprefix("torch.").encode())
    answer = json.loads(parent.recv_bytes())
    proc.join(60)
    ok = abs(answer["sum"] - expected) <= 1e-3 * max(1.0, abs(expected))
    rows.append({"step": "kv", "what": "CUDA IPC to another process: same bytes", "value": ok, "ok": ok})
    rows.append(
        {"step": "kv", "what": "CUDA IPC import+clone GB/s", "value": round(nbytes / answer["s"] / 1e9, 2), "ok": True}
    )
    return rows


def run_steps(
    tag: str,
    args: argparse.Namespace,
    rows: list[Row],
    step_of: Callable[[str], Callable[[argparse.Namespace], list[Row]]],
) -> list[Row]:
    """Run each step named in `args.only` (`step_of(name)`), adding its rows to `rows`; a step that
    raises adds one failed row instead (one failed step must not hide the others' rows). Prints each
    step's time, then the table."""
    started = time.perf_counter()
    for name in args.only:
        step_start = time.perf_counter()
        try:
            rows += step_of(name)(args)
        except Exception as err:  # noqa: BLE001 - one failed step must not hide the others' rows
            rows.append({"step": name, "what": "failed", "value": f"{type(err).__name__}: {err}"[:300], "ok": False})
        print(f"{tag}: {name} done in {time.perf_counter() - step_start:.1f} s", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print_table(rows)
    print(f"{tag}: {time.perf_counter() - started:.0f} s in all")
    return rows


def print_table(rows: list[Row]) -> None:
    width = max(len(str(r["what"])) for r in rows)
    print(f"\n{'step':10s} {'what':{width}s} {'value':>14s}  ok")
    for r in rows:
        print(f"{r['step']!s:10s} {r['what']!s:{width}s} {r['value']!s:>14s}  {'yes' if r['ok'] else 'NO'}")


STEPS = ("env", "exactness", "decode", "floor", "prefill", "profile", "serving", "kv")


def load_tokenizer(path: str | None) -> Any:  # noqa: ANN401
    from transformers import AutoTokenizer

    if path is None:
        carried = ROOT / ".device" / "tokenizer"
        if carried.is_dir():
            path = str(carried)
        else:  # the dry run here: the cached default model's folder (./run setup made it)
            from pdserve.engine.model_fetch import default_model_dir

            path = str(default_model_dir())
    return AutoTokenizer.from_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the dry run on tiny shapes")
    ap.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--out", default=None, help="folder for gpu-check.json (default $OUT when set)")
    ap.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default .device/tokenizer, else the cached default model)"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--decode-shapes", nargs="+", default=None, help="default: llama-1b llama-8b (cpu: tiny-llama)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 32 128 (cpu: 1 4)")
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=None, help="default 64 (cpu: 8)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="default 2048 (cpu: 128)")
    ap.add_argument("--exact-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=None, help="serving: default 32 (cpu: 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="serving: default 512 (cpu: 32)")
    ap.add_argument("--max-tokens", type=int, default=None, help="serving: default 64 (cpu: 8)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="default 2048 (cpu: 256)")
    args = ap.parse_args()
    args.tiny = args.device == "cpu"
    pick = (lambda gpu, cpu: cpu) if args.tiny else (lambda gpu, cpu: gpu)  # noqa: E731
    args.decode_shapes = args.decode_shapes or pick(["llama-1b", "llama-8b"], ["tiny-llama", "tiny-qwen2"])
    args.exact_shape = pick("default", "tiny-llama")
    args.batches = args.batches or pick([1, 32, 128], [1, 4])
    args.decode_tokens = args.decode_tokens or pick(64, 8)
    args.prefill_tokens = args.prefill_tokens or pick(2048, 128)
    args.num_prompts = args.num_prompts or pick(32, 4)
    args.prompt_len = args.prompt_len or pick(512, 32)
    args.max_tokens = args.max_tokens or pick(64, 8)
    args.kv_tokens = args.kv_tokens or pick(2048, 256)
    args.torch_dtype = getattr(torch, args.dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (use --device cpu for the dry run)", file=sys.stderr)
        return 2
    args.device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU (dry run) {platform.machine()}"
    args.tok = load_tokenizer(args.tokenizer)
    out_dir = args.out or os.environ.get("OUT")
    print(f"gpu_check: {args.device_name}, torch {torch.__version__}, steps {' '.join(args.only)}", flush=True)
    started = time.perf_counter()
    rows = run_steps("gpu_check", args, [], lambda name: globals()[f"step_{name}"])
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        doc = {
            "device": args.device_name,
            "torch": torch.__version__,
            "seconds": time.perf_counter() - started,
            "rows": rows,
        }
        (Path(out_dir) / "gpu-check.json").write_text(json.dumps(doc, indent=1, default=str))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
