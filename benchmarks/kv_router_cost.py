"""The router's CPU per request for KV-aware routing: tokenizing the prompt, hashing its blocks and
looking it up in the KV index, at a given prompt length, with the index holding a given number of
workers' caches. Prints the CPU model and flags with the figures.

    python benchmarks/kv_router_cost.py [--model DIR] [--tokens 2000] [--workers 8] [--repeat 200]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from pdserve.model_cache import default_model_dir
from pdserve.router.kv_index import KvIndex, PromptKeys
from pdserve.v1 import common_pb2, router_pb2


def cpu() -> str:
    model, flags = platform.processor(), set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model or 'unknown CPU'} (flags: {' '.join(wanted) or 'none of avx2/avx512/amx'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--blocks-per-worker", type=int, default=20000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    keys = PromptKeys.load(args.model)
    rng = random.Random(0)
    words = "river mill boat flour water salt yeast morning bank count bread kitchen warm".split()
    text = ""
    while len(keys.tokenizer.encode(text, add_special_tokens=False)) < args.tokens:
        text += " ".join(rng.choice(words) for _ in range(50)) + ". "
    request = router_pb2.GenerateRequest(prompt=text, params=common_pb2.SamplingParams(max_tokens=1))
    prompt_keys, tokens = keys.keys(request, args.block_size)
    index = KvIndex()
    for w in range(args.workers):  # each worker caches random blocks, and one holds this prompt's
        held = [rng.getrandbits(64) for _ in range(args.blocks_per_worker)]
        index.replace(f"w{w}", held + (prompt_keys if w == 0 else []))
    tokenize, lookup = [], []
    for _ in range(args.repeat):
        t0 = time.process_time()
        prompt_keys, _ = keys.keys(request, args.block_size)
        t1 = time.process_time()
        overlap = index.overlap(prompt_keys)
        t2 = time.process_time()
        tokenize.append(t1 - t0)
        lookup.append(t2 - t1)
    assert overlap == {"w0": len(prompt_keys)}
    total = [a + b for a, b in zip(tokenize, lookup, strict=True)]
    print(f"CPU: {cpu()}")
    print(f"prompt: {tokens} tokens, {len(prompt_keys)} blocks of {args.block_size}; index: {len(index):,} entries "
          f"over {args.workers} workers")
    print(f"router CPU per request (median of {args.repeat}): "
          f"tokenize + hash {statistics.median(tokenize) * 1e3:.3f} ms, "
          f"index lookup {statistics.median(lookup) * 1e3:.3f} ms, total {statistics.median(total) * 1e3:.3f} ms "
          f"(p90 {sorted(total)[int(0.9 * len(total))] * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
