"""bfloat16 against float32 on this machine, every ratio measured in the same run.

Three measurements (pick with --only; default all), each repeated --repeats times with the two
dtypes interleaved (fp32, bf16, fp32, bf16, ...) so both see the same machine load; each prints
the median and the spread (min-max) and the bf16/fp32 ratio of the medians:

  served   two colocated clusters (one worker each, --threads threads) serve the OpenAI chat API at
           the same time, one per dtype; each repeat sends --num-prompts chat prompts x
           --max-tokens output tokens (EOS ignored, greedy) all at once and counts output tok/s.
  prefill  the engine in this process prefills one --prefill-tokens prompt: prompt tok/s.
  matmul   one linear layer of the model's shapes (576 -> 1536) for --rows rows: GFLOP/s.
  decode   the batch-1 decode step: step time, bytes read per step (weights + the context's K/V)
           against a same-run measured read bandwidth (a 256 MiB sum), the torch profiler's top
           operators for one bf16 step, and the step with `torch.compile`d MLPs (--compile).

  python benchmarks/dtype_bench.py --only served prefill decode --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_fetch import resolve_model
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.engine.sampling_params import SamplingParams

DTYPES = ("float32", "bfloat16")
TOPICS = (
    "the sea",
    "a mountain",
    "the city at night",
    "an old library",
    "a train journey",
    "winter",
    "a garden",
    "the desert",
)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f}  ({min(values):.2f}-{max(values):.2f})"


def report(title: str, unit: str, results: dict[str, list[float]]) -> float:
    """Print both dtypes' median and spread and return the bf16/fp32 ratio of the medians."""
    print(f"\n{title} [{unit}], median (min-max) of {len(results['float32'])}")
    for dtype in DTYPES:
        print(f"  {dtype:9s} {summary(results[dtype])}")
    ratio = statistics.median(results["bfloat16"]) / statistics.median(results["float32"])
    print(f"  bf16/fp32 {ratio:.2f}x")
    return ratio


def interleaved(repeats: int, measure: Callable[[str], float]) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {d: [] for d in DTYPES}
    for _ in range(repeats):
        for dtype in DTYPES:
            results[dtype].append(measure(dtype))
    return results


# --- served ---------------------------------------------------------------------------------------


def chat_request(url: str, model: str, prompt: str, max_tokens: int) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as resp:  # noqa: S310 - loopback URL we built
        return int(json.loads(resp.read())["usage"]["completion_tokens"])


def served_burst(http_address: str, model: str, num_prompts: int, max_tokens: int) -> float:
    """Send every prompt at once; output tokens per second of wall time until the last answer."""
    url = f"http://{http_address}/v1/chat/completions"
    prompts = [f"Write a short poem about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(num_prompts)]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=num_prompts) as pool:
        tokens = sum(pool.map(lambda p: chat_request(url, model, p, max_tokens), prompts))
    return tokens / (time.perf_counter() - start)


def run_served(args: argparse.Namespace) -> float:
    from pdserve.cluster.launch import LaunchOptions, local_deployment
    from pdserve.cluster.local import LocalCluster

    clusters = {}
    try:
        for dtype in DTYPES:
            config = local_deployment(
                prefill=0,
                decode=0,
                colocated=1,
                threads_per_worker=args.threads,
                device="cpu",
                dtype=dtype,
                http_port=0,
                kv_cache_mb=args.kv_cache_mb,
                model=args.model,
            )
            options = LaunchOptions(decode_args=("--max-num-seqs", str(args.num_prompts)))
            clusters[dtype] = LocalCluster(config, options).__enter__()
        name = clusters["float32"].config.model.served_name
        for dtype in DTYPES:  # warm-up: first passes allocate and load lazily
            served_burst(clusters[dtype].http_address, name, 2, 4)
        results = interleaved(
            args.repeats, lambda d: served_burst(clusters[d].http_address, name, args.num_prompts, args.max_tokens)
        )
    finally:
        for cluster in clusters.values():
            cluster.stop()
    return report(
        f"served: {args.num_prompts} chat prompts x {args.max_tokens} tokens at once, "
        f"colocated, {args.threads} threads",
        "output tok/s",
        results,
    )


# --- matmul ---------------------------------------------------------------------------------------


def linear_gflops(rows: int, dtype: str, repeats: int = 5) -> float:
    x = torch.randn(rows, 576).to(getattr(torch, dtype))
    w = torch.randn(1536, 576).to(getattr(torch, dtype))
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    return 2 * rows * 576 * 1536 / statistics.median(times) / 1e9


def run_matmul(args: argparse.Namespace) -> None:
    for rows in args.rows:
        results = interleaved(args.repeats, functools.partial(linear_gflops, rows))
        report(f"linear 576 -> 1536, {rows} rows", "GFLOP/s", results)


# --- in-process engine ----------------------------------------------------------------------------


def load(dtype: str, model: str | None) -> LoadedModel:
    config = EngineConfig(dtype=dtype)
    return load_model(resolve_model(model), config.torch_dtype, config.device)


def prefill_rate(loaded: LoadedModel, tokens: int) -> float:
    engine = LLMEngine(
        loaded,
        EngineConfig(
            dtype=str(loaded.model.dtype).removeprefix("torch."),
            num_blocks=tokens // 16 + 8,
            max_num_batched_tokens=tokens,
        ),
    )
    prompt = [100 + (7 * i) % 5000 for i in range(tokens)]
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1))
    return tokens / (time.perf_counter() - start)


def run_prefill(args: argparse.Namespace, models: dict[str, LoadedModel]) -> float:
    for dtype in DTYPES:
        prefill_rate(models[dtype], 64)  # warm-up
    results = interleaved(args.repeats, lambda d: prefill_rate(models[d], args.prefill_tokens))
    return report(
        f"prefill of one {args.prefill_tokens}-token prompt, {torch.get_num_threads()} threads", "prompt tok/s", results
    )


def decode_engine(loaded: LoadedModel, context: int) -> LLMEngine:
    engine = LLMEngine(loaded, EngineConfig(dtype=str(loaded.model.dtype).removeprefix("torch."), num_blocks=64))
    engine.add_request("0", [100 + j for j in range(context)], SamplingParams(max_tokens=100_000, ignore_eos=True))
    engine.step()  # the prefill
    return engine


def step_ms(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def read_bandwidth() -> float:
    big = torch.ones(256 * 2**20 // 4)
    big.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - start)
    return big.numel() * 4 / statistics.median(times)


def step_bytes(engine: LLMEngine) -> int:
    weights = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    seq = next(iter(engine.sequences.values()))
    return weights + seq.num_tokens * engine.kv_cache.shape.bytes_per_block // engine.kv_cache.shape.block_size


def profile_step(engine: LLMEngine, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def compile_mlps(loaded: LoadedModel) -> None:
    for layer in loaded.model.model.layers:
        layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True)


def run_decode(args: argparse.Namespace, models: dict[str, LoadedModel]) -> None:
    engines = {d: decode_engine(models[d], args.context) for d in DTYPES}
    for engine in engines.values():
        step_ms(engine, 3)
    bandwidths: list[float] = []

    def measure(dtype: str) -> float:
        bandwidths.append(read_bandwidth())
        return step_ms(engines[dtype], args.steps)

    results = interleaved(args.repeats, measure)
    report(f"batch-1 decode step, context {args.context}", "ms", results)
    bw = statistics.median(bandwidths)
    print(
        f"  read bandwidth {bw / 1e9:.1f} GB/s (median of {len(bandwidths)}, "
        f"{min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f})"
    )
    for dtype in DTYPES:
        nbytes = step_bytes(engines[dtype])
        limit_ms = nbytes / bw * 1e3
        print(
            f"  {dtype:9s} reads {nbytes / 2**20:.0f} MiB per step: limit {limit_ms:.1f} ms, "
            f"fraction of the limit {limit_ms / statistics.median(results[dtype]):.2f}"
        )
    print("\nbf16 batch-1 step, top operators by self CPU time:")
    profile_step(engines["bfloat16"], args.top)
    if args.compile:
        for dtype in DTYPES:
            compile_mlps(models[dtype])
            step_ms(engines[dtype], 3)  # compiles
        compiled = interleaved(args.repeats, lambda d: step_ms(engines[d], args.steps))
        for dtype in DTYPES:
            print(
                f"  {dtype:9s} compiled MLPs: {summary(compiled[dtype])} ms against eager "
                f"{statistics.median(results[dtype]):.2f} ms"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only",
        nargs="+",
        choices=("served", "matmul", "prefill", "decode"),
        default=["served", "matmul", "prefill", "decode"],
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads"
    )
    if "served" in args.only:
        run_served(args)
    if "matmul" in args.only:
        run_matmul(args)
    if {"prefill", "decode"} & set(args.only):
        models = {d: load(d, args.model) for d in DTYPES}
        with torch.inference_mode():
            if "prefill" in args.only:
                run_prefill(args, models)
            if "decode" in args.only:
                run_decode(args, models)


if __name__ == "__main__":
    main()
