"""What the KV cache buys: per-token latency with the paged KV cache against recomputing everything.

Both paths run the engine's own forward (`ModelRunner.forward`, the pass every worker runs) on the
same weights and sample greedily (argmax of the logits):

- **cached**: one pass over the prompt fills the paged cache, then each step feeds only the newest
  token and reads the K/V of all earlier ones from the cache (what serving does);
- **no cache**: each step runs a pass over the whole sequence so far with nothing cached
  (`num_cached=0`), i.e. recomputes the K/V of every earlier token, then samples the next one.

Per-token latency of output token n = wall time of the pass (and argmax) that produced it. The
cached run generates all N tokens, one timed step each (the blue line of the plot). The no-cache
path costs O(n) per token (O(n^2) in all), so it is measured:
- densely for output tokens 1..--dense: it generates them itself from the prompt, and its tokens
  must equal the cached run's (checked: identical sequences);
- at --positions and --report-at: a pass over the cached run's first n-1 output tokens (the
  prefix the no-cache run has if its tokens up to there match), and the token it samples must be
  the cached run's token n (checked at each position).
Ratios come from paired measurements, because a shared machine's load changes over a run: at each
measured position the cached step that produces token n (one token in, the K/V of the n-1 before it
read from the cache; it rewrites the same K/V) and the no-cache pass alternate --repeats times;
the ratio is median(no cache) / median(cached) of those pairs.

    python benchmarks/kv_cache_effect.py                  # default model, N=1024: about 5 minutes on this CPU
    python benchmarks/kv_cache_effect.py --max-tokens 256 --dense 64 --positions 64 128 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_fetch import resolve_model
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.engine.model_runner import StepInput
from pdserve.engine.runners import build_runner

PROMPT = "The history of the city of Jinan, told from its springs to its winters:"


@dataclass
class Result:
    prompt_tokens: int
    cached_tokens: list[int]  # output tokens 1..N
    cached_s: list[float]  # latency of output token n (index n-1)
    dense_tokens: list[int]  # the no-cache path's own output tokens 1..dense
    dense_s: list[float]
    sparse_s: dict[int, float]  # output position n -> median no-cache latency (paired runs)
    paired_cached_s: dict[int, float]  # n -> median latency of the cached step for token n (paired runs)
    sparse_match: dict[int, bool]  # n -> both passes sampled the cached run's token n again

    @property
    def identical(self) -> bool:
        dense = self.dense_tokens == self.cached_tokens[: len(self.dense_tokens)]
        return dense and all(self.sparse_match.values())

    def ratio(self, n: int) -> float:
        return self.sparse_s[n] / self.paired_cached_s[n]


class Runner:
    """The engine's ModelRunner over a private paged cache, with one block table per path."""

    def __init__(self, loaded: LoadedModel, max_len: int, block_size: int = 16) -> None:
        per_path = blocks_for_tokens(max_len + 1, block_size)
        self.runner = build_runner(loaded, KVCache(loaded.kv_shape(block_size), 2 * per_path))
        self.tables = {"cached": list(range(per_path)), "no_cache": list(range(per_path, 2 * per_path))}

    def pass_(self, path: str, new_ids: list[int], num_cached: int) -> tuple[int, float]:
        """One forward pass and greedy sampling; (token, seconds)."""
        start = time.perf_counter()
        logits = self.runner.forward([StepInput(new_ids, num_cached, self.tables[path])])
        token = int(torch.argmax(logits[0]))
        return token, time.perf_counter() - start


def run_cached(runner: Runner, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    token, seconds = runner.pass_("cached", prompt, 0)  # prefill: fills the cache, samples token 1
    tokens, times = [token], [seconds]
    while len(tokens) < n:
        token, seconds = runner.pass_("cached", [tokens[-1]], len(prompt) + len(tokens) - 1)
        tokens.append(token)
        times.append(seconds)
    return tokens, times


def run_no_cache(runner: Runner, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Generate n tokens, each with a pass over the whole sequence so far (nothing reused)."""
    tokens: list[int] = []
    times = []
    while len(tokens) < n:
        token, seconds = runner.pass_("no_cache", prompt + tokens, 0)
        tokens.append(token)
        times.append(seconds)
    return tokens, times


def measure(
    loaded: LoadedModel,
    prompt: list[int],
    max_tokens: int,
    dense: int,
    positions: list[int],
    repeats: int,
    progress: bool = False,
) -> Result:
    runner = Runner(loaded, len(prompt) + max_tokens)
    runner.pass_("no_cache", prompt, 0)  # warm-up
    log = (lambda msg: print(msg, flush=True)) if progress else (lambda msg: None)
    cached_tokens, cached_s = run_cached(runner, prompt, max_tokens)
    log(f"cached: {max_tokens} tokens in {sum(cached_s):.1f} s")
    dense_tokens, dense_s = run_no_cache(runner, prompt, min(dense, max_tokens))
    log(f"no cache, dense: {len(dense_tokens)} tokens in {sum(dense_s):.1f} s")
    sparse_s, paired_s, sparse_match = {}, {}, {}
    for n in sorted({p for p in positions if 2 <= p <= max_tokens}):
        context = prompt + cached_tokens[: n - 1]
        cached_runs, no_cache_runs = [], []
        for _ in range(repeats):  # alternate, so both see the same machine load
            cached_runs.append(runner.pass_("cached", [context[-1]], len(context) - 1))
            no_cache_runs.append(runner.pass_("no_cache", context, 0))
        sparse_s[n] = statistics.median(seconds for _, seconds in no_cache_runs)
        paired_s[n] = statistics.median(seconds for _, seconds in cached_runs)
        sparse_match[n] = all(token == cached_tokens[n - 1] for token, _ in cached_runs + no_cache_runs)
        log(
            f"n={n}: cached {paired_s[n] * 1e3:.0f} ms, no cache {sparse_s[n] * 1e3:.0f} ms, "
            f"same token: {sparse_match[n]}"
        )
    return Result(len(prompt), cached_tokens, cached_s, dense_tokens, dense_s, sparse_s, paired_s, sparse_match)


def plot(result: Result, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(
        range(1, len(result.cached_s) + 1),
        [s * 1e3 for s in result.cached_s],
        lw=0.8,
        label="paged KV cache (every token)",
    )
    ax.plot(
        range(1, len(result.dense_s) + 1),
        [s * 1e3 for s in result.dense_s],
        lw=0.8,
        label="no cache, generating (every token)",
    )
    sparse = sorted(result.sparse_s)
    ax.plot(
        sparse,
        [result.sparse_s[n] * 1e3 for n in sparse],
        "o--",
        ms=4,
        label="no cache at measured positions (median of paired runs)",
    )
    ax.plot(
        sparse,
        [result.paired_cached_s[n] * 1e3 for n in sparse],
        "s--",
        ms=4,
        label="cached step at the same positions (paired)",
    )
    for n in sparse:
        ax.annotate(
            f"{result.ratio(n):.0f}x",
            (n, result.sparse_s[n] * 1e3),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    ax.set_xlabel("output token n (the pass that produced it)")
    ax.set_ylabel("latency of the pass (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local Hugging Face folder (default: the default model)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="N: output tokens of the cached run")
    ap.add_argument("--dense", type=int, default=64, help="output tokens the no-cache path generates itself")
    ap.add_argument(
        "--positions",
        type=int,
        nargs="+",
        default=[16, 128, 384, 512, 768],
        help="output positions where both paths are measured in pairs (besides --report-at)",
    )
    ap.add_argument("--report-at", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=3, help="paired passes per measured position (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared 2-core machine)")
    ap.add_argument("--plot", type=Path, default=Path("benchmarks/reports/kv-cache-effect/kv_cache_effect.png"))
    ap.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    ap.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="only redraw the plot from a --json file of an earlier run",
    )
    args = ap.parse_args(argv)
    if args.replot:
        raw = json.loads(args.replot.read_text())
        for key in ("sparse_s", "paired_cached_s", "sparse_match"):
            raw[key] = {int(n): v for n, v in raw[key].items()}
        title = raw.pop("title", "replot")
        plot(Result(**raw), args.plot, title)
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_model(resolve_model(args.model))
    prompt = list(loaded.tokenizer(PROMPT).input_ids)
    started = time.perf_counter()
    result = measure(
        loaded, prompt, args.max_tokens, args.dense, args.positions + args.report_at, args.repeats, progress=True
    )
    print(
        f"prompt {result.prompt_tokens} tokens, {args.max_tokens} output tokens, {args.threads} threads, "
        f"run took {time.perf_counter() - started:.0f} s"
    )
    print(
        f"tokens identical: {result.identical} (no-cache generation 1..{len(result.dense_tokens)}: "
        f"{result.dense_tokens == result.cached_tokens[: len(result.dense_tokens)]}; measured positions: "
        f"{sum(result.sparse_match.values())}/{len(result.sparse_match)})"
    )
    print(f"{'n':>6} {'cached ms':>10} {'no cache ms':>12} {'ratio':>7}")
    for n in sorted(result.sparse_s):
        mark = "  <-" if n in args.report_at else ""
        print(
            f"{n:>6} {result.paired_cached_s[n] * 1e3:>10.1f} {result.sparse_s[n] * 1e3:>12.1f} "
            f"{result.ratio(n):>6.1f}x{mark}"
        )
    dense = len(result.dense_s)
    print(
        f"cached run: {sum(result.cached_s):.1f} s for {args.max_tokens} tokens; no cache, tokens "
        f"1..{dense}: {sum(result.dense_s):.1f} s (cached: {sum(result.cached_s[:dense]):.1f} s)"
    )
    title = f"{loaded.path.name}, CPU fp32, {args.threads} threads, batch 1: latency per output token"
    plot(result, args.plot, title)
    print(f"plot: {args.plot}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**asdict(result), "title": title}))
    return 0 if result.identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
