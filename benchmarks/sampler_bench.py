"""The batched sampler (engine/sampler.py `sample`) against the row-by-row sampler it replaced (kept
here, verbatim in behaviour, as the baseline), same logits, same process, alternating runs.

    python benchmarks/sampler_bench.py [--rows 32] [--vocab 49152] [--repeats 30]

Prints the CPU model and flags, then per setting the median milliseconds per call of each and the
ratio (old / new: above 1 means the batched sampler is faster)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from peer_vllm import cpu_description  # benchmarks/ is the script's own folder

from pdserve.engine.sampler import sample, step_seed
from pdserve.engine.sampling_params import SamplingParams


def _old_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _old_sample_one(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    raw = logits.float().cpu()
    logits = _old_filter(raw / params.temperature, params.top_k, params.top_p)
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return int(torch.argmax(raw))
    generator = torch.Generator().manual_seed(step_seed(params.seed, step)) if params.seed is not None else None
    return int(torch.multinomial(probs, 1, generator=generator))


def old_sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    return [_old_sample_one(logits[i], p, s) for i, (p, s) in enumerate(zip(params, steps, strict=True))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    print(f"{cpu_description()}; threads {torch.get_num_threads()}, torch {torch.__version__}")
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab) * 3
    settings = {
        "temperature 0.8": SamplingParams(temperature=0.8),
        "temperature 0.8, seeded": SamplingParams(temperature=0.8, seed=7),
        "top_p 0.95, seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=7),
        "top_k 50, seeded": SamplingParams(temperature=0.8, top_k=50, seed=7),
        "top_k 50 + top_p 0.9 + min_p 0.05": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    }
    results = []
    for name, params in settings.items():
        rows = [params] * args.rows
        steps = list(range(args.rows))
        old_times: list[float] = []
        new_times: list[float] = []
        for _ in range(args.repeats):
            for fn, times in ((old_sample, old_times), (sample, new_times)):
                start = time.perf_counter()
                fn(logits, rows, steps)
                times.append(time.perf_counter() - start)
        old_ms, new_ms = statistics.median(old_times) * 1e3, statistics.median(new_times) * 1e3
        results.append(
            {"setting": name, "rows": args.rows, "old_ms": old_ms, "new_ms": new_ms, "speedup": old_ms / new_ms}
        )
        print(f"{name:38s} row by row {old_ms:8.2f} ms   batched {new_ms:8.2f} ms   {old_ms / new_ms:5.2f}x")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": cpu_description(), "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
