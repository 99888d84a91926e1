"""Where one decode step of the default model spends its time, and how close it is to memory bandwidth.

For batch sizes --batch (default 1 16 64): median wall time of a decode step (context ~64 tokens),
and the torch profiler's top operators by self CPU time for one step. Then, at batch 1, the bytes a
step must read (every weight once, plus the K/V of the context) divided by the step time, as a
ratio against a same-run measured memory read bandwidth (a large tensor sum).

  python benchmarks/decode_profile.py --batch 1 16 64
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    loaded = load_model(resolve_model(None))
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    with torch.inference_mode():
        with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use set-up
            torch.ones(8).sum()
        for batch in args.batch:
            engine = running_engine(loaded, batch, args.context)
            step_time(engine, 2)
            median = step_time(engine, args.steps)
            with profile(activities=[ProfilerActivity.CPU]):
                engine.step()  # warm the profiled path too
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.step()
            print(f"\nbatch {batch}: {median * 1e3:.1f} ms per decode step, {batch / median:.0f} tokens/s")
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


if __name__ == "__main__":
    main()
