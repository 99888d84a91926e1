"""Decode throughput: pdserve's engine against Hugging Face `generate`, in the same run.

Each of --num-seqs prompts asks for its own number of output tokens, drawn uniformly from
--min-tokens..--max-tokens (EOS ignored, greedy); with --min-tokens equal to --max-tokens every
request wants the same length. Only requested tokens count as output: a static batch keeps
stepping until its longest request is done, which is exactly what continuous batching avoids.
Prints output tokens/s for:
  hf-sequential   one `generate` call per prompt
  hf-static       one padded `generate` call for the whole batch (left padding)
  pdserve         our paged engine, all prompts submitted together (continuous batching)
and the ratios against both baselines. Each system runs --repeats times; the median is reported
with the spread (min-max).

--batch-size B (default: all of --num-seqs) caps how many requests run at once: HF runs the
requests as consecutive static batches of B, pdserve with max_num_seqs B (a finished request's
slot goes to the next waiting one). With --num-seqs equal to B this is one batch for both, and
the only difference is that pdserve's batch shrinks as requests finish. Usage:
  python benchmarks/decode_throughput.py --num-seqs 16 --min-tokens 16 --max-tokens 128
  python benchmarks/decode_throughput.py --num-seqs 96 --batch-size 32 --min-tokens 16 --max-tokens 128
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_fetch import resolve_model
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_text

WORDS = "the river ran past the old mill carrying leaves and light of evening while children played".split()


def make_prompts(tokenizer, n: int, min_words: int, max_words: int, seed: int) -> list[list[int]]:  # noqa: ANN001
    rng = random.Random(seed)
    return [encode_text(tokenizer, " ".join(rng.choices(WORDS, k=rng.randint(min_words, max_words)))) for _ in range(n)]


def hf_sequential(model, prompts: list[list[int]], lengths: list[int]) -> int:  # noqa: ANN001
    total = 0
    for p, n in zip(prompts, lengths, strict=True):
        out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        total += out.shape[1] - len(p)
    return total


def hf_static_batches(model, prompts: list[list[int]], lengths: list[int], batch: int) -> int:  # noqa: ANN001
    """Consecutive static batches of `batch` requests."""
    return sum(hf_static(model, prompts[i : i + batch], lengths[i : i + batch]) for i in range(0, len(prompts), batch))


def hf_static(model, prompts: list[list[int]], lengths: list[int]) -> int:  # noqa: ANN001
    width, longest = max(len(p) for p in prompts), max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=longest, min_new_tokens=longest, pad_token_id=0
    )
    return sum(min(n, out.shape[1] - width) for n in lengths)  # only what each request asked for


def pdserve(engine: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> int:
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    return sum(len(o) for o in outs)


def measure(fn: Callable[[], int], repeats: int) -> tuple[float, float, float]:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates), min(rates), max(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local HF folder (default: the default model)")
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=None, help="most requests at once (default: --num-seqs)")
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-words", type=int, default=4)
    ap.add_argument("--max-words", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-sequential", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    loaded = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    batch = args.batch_size or args.num_seqs
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=batch))
    prompts = make_prompts(loaded.tokenizer, args.num_seqs, args.min_words, args.max_words, args.seed)
    rng = random.Random(args.seed + 1)
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in prompts]
    print(
        f"model={path.name} seqs={args.num_seqs} batch={batch} output_tokens={args.min_tokens}-{args.max_tokens} "
        f"prompt_lens={min(map(len, prompts))}-{max(map(len, prompts))} threads={torch.get_num_threads()}"
    )
    systems: dict[str, Callable[[], int]] = {
        "hf-static": lambda: hf_static_batches(hf, prompts, lengths, batch),
        "pdserve": lambda: pdserve(engine, prompts, lengths),
    }
    if not args.skip_sequential:
        systems = {"hf-sequential": lambda: hf_sequential(hf, prompts, lengths), **systems}
    pdserve(engine, prompts[:2], [4, 4])  # warm-up
    hf_static(hf, prompts[:2], [4, 4])
    results = {}
    with torch.inference_mode():
        for name, fn in systems.items():
            results[name] = measure(fn, args.repeats)
            med, lo, hi = results[name]
            print(f"{name:14s} {med:9.1f} tok/s  (min {lo:.1f}, max {hi:.1f})", flush=True)
    ours = results["pdserve"][0]
    for base in [n for n in results if n != "pdserve"]:
        print(f"ratio pdserve / {base}: {ours / results[base][0]:.2f}x")
    engine.pool.assert_all_free()


if __name__ == "__main__":
    main()
