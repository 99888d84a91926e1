"""Where one decode step of the default model spends its time, and how close it is to memory bandwidth.

For batch sizes --batch (default 1 16 64): median wall time of a decode step (context ~64 tokens),
and the torch profiler's top operators by self CPU time for one step. Then, at batch 1, the bytes a
step must read (every weight once, plus the K/V of the context) divided by the step time, as a
ratio against a same-run measured memory read bandwidth (a large tensor sum).

With --forwards fast hf, each batch size runs with both forwards (engine/model_runner.py) in the
same process, one after another, and the fast/hf step-time ratio is printed.

  python benchmarks/decode_profile.py --batch 1 16 64
  python benchmarks/decode_profile.py --batch 1 32 --forwards fast hf
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_fetch import resolve_model
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams


def running_engine(loaded, batch: int, context: int) -> LLMEngine:  # noqa: ANN001
    engine = LLMEngine(loaded, EngineConfig(num_blocks=2048, max_num_seqs=max(64, batch)))
    for i in range(batch):
        engine.add_request(str(i), [100 + (i + j) % 1000 for j in range(context)],
                           SamplingParams(max_tokens=10_000, ignore_eos=True))
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()  # prefills
    return engine


def step_time(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth() -> float:
    big = torch.ones(256 * 2**20 // 4)  # 256 MiB
    big.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - start)
    return big.numel() * 4 / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--forwards", nargs="+", default=[None], choices=("fast", "hf"),
                    help="run each batch with these forwards (default: the engine's own choice)")
    args = ap.parse_args()
    loaded = load_model(resolve_model(None))
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    with torch.inference_mode():
        with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use set-up
            torch.ones(8).sum()
        for batch in args.batch:
            medians = {}
            for forward in args.forwards:
                medians[forward] = profile_batch(loaded, batch, forward, weight_bytes, args)
            if len(medians) == 2:
                print(f"batch {batch}: fast/hf step time {medians['fast'] / medians['hf']:.2f} "
                      f"(fast is {medians['hf'] / medians['fast']:.2f}x the tokens/s)")


def profile_batch(loaded, batch: int, forward: str | None, weight_bytes: int,  # noqa: ANN001
                  args: argparse.Namespace) -> float:
    """Median decode step of `batch` sequences with `forward`, and its profile; returns the median."""
    if forward is not None:
        os.environ["PDSERVE_FORWARD"] = forward
    engine = running_engine(loaded, batch, args.context)
    step_time(engine, 2)
    median = step_time(engine, args.steps)
    with profile(activities=[ProfilerActivity.CPU]):
        engine.step()  # warm the profiled path too
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    print(f"\nbatch {batch}, forward {engine.runner.forward_name}: {median * 1e3:.1f} ms per decode step, "
          f"{batch / median:.0f} tokens/s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if batch == 1:
        shape = engine.kv_cache.shape
        kv_bytes = 2 * shape.num_layers * (args.context + 12) * shape.num_kv_heads * shape.head_dim * 4
        bandwidth = read_bandwidth()
        moved = (weight_bytes + kv_bytes) / median
        print(f"batch 1: reads {(weight_bytes + kv_bytes) / 2**20:.0f} MiB per step -> "
              f"{moved / 1e9:.2f} GB/s; measured read bandwidth {bandwidth / 1e9:.2f} GB/s; "
              f"ratio {moved / bandwidth:.2f}")
    for rid in list(engine.sequences):
        engine.abort(rid)
    engine.pool.assert_all_free()
    return median


if __name__ == "__main__":
    main()
