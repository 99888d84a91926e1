"""What --deterministic (batch-invariant mode) costs against the default mode, in one process.

The default model is loaded twice (once per mode) in --dtype; the two engines take turns for --rounds
rounds, so a passing load on the machine falls on both alike. Per round and mode: a batch of --batch
prompts of about 60 tokens, each generating --tokens tokens with continuous batching (output tok/s,
prefill included), and the prefill of one --prompt-tokens prompt alone (its time). Prints the median
of the rounds for each mode and the deterministic/default ratio, with the CPU model and flags.

  python benchmarks/deterministic_cost.py --dtype bfloat16 --batch 32 --tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kernel_table import cpu_identity
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_fetch import resolve_model
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams


def _round(engine: LLMEngine, prompts: list[list[int]], tokens: int, long_prompt: list[int]) -> tuple[float, float]:
    started = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    tok_s = sum(len(o) for o in outs) / (time.perf_counter() - started)
    started = time.perf_counter()
    engine.generate([long_prompt], SamplingParams(max_tokens=1))
    return tok_s, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"cpu: {cpu_identity()}; torch threads {torch.get_num_threads()}")
    path = resolve_model(None)
    engines = {}
    for mode in ("default", "deterministic"):
        loaded = load_model(path, getattr(torch, args.dtype))
        engines[mode] = LLMEngine(
            loaded, EngineConfig(dtype=args.dtype, num_blocks=2048, deterministic=mode == "deterministic")
        )
    tok = engines["default"].loaded.tokenizer
    prompts = [
        tok.encode(f"Question {i}: tell me about the history of the river valley and the mill " * 5)[:60]
        for i in range(args.batch)
    ]
    long_prompt = (tok.encode("the old mill by the river turned all winter " * 400))[: args.prompt_tokens]
    for engine in engines.values():  # warm-up
        _round(engine, prompts[:2], 4, long_prompt[:64])
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in engines}
    for r in range(args.rounds):
        for mode, engine in engines.items():
            results[mode].append(_round(engine, prompts, args.tokens, long_prompt))
            print(
                f"round {r + 1} {mode}: {results[mode][-1][0]:.1f} tok/s, prefill {results[mode][-1][1]:.2f} s",
                flush=True,
            )
    med = {m: (statistics.median(t for t, _ in v), statistics.median(p for _, p in v)) for m, v in results.items()}
    d, x = med["default"], med["deterministic"]
    print(
        f"{args.dtype}, {args.batch} prompts x {args.tokens} tokens: default {d[0]:.1f} tok/s, deterministic "
        f"{x[0]:.1f} tok/s ({x[0] / d[0]:.2f}x); {len(long_prompt)}-token prefill: default {d[1]:.2f} s, "
        f"deterministic {x[1]:.2f} s ({x[1] / d[1]:.2f}x the time)"
    )


if __name__ == "__main__":
    main()
