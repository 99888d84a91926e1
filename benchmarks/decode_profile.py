"""Where one decode step of the default model spends its time, and how close it is to memory bandwidth.

For batch sizes --batch (default 1 16 64): median wall time of a decode step (context ~64 tokens),
and the torch profiler's top operators by self CPU time for one step. Then, at batch 1, the bytes a
step must read (every weight once, plus the K/V of the context) divided by the step time, as a
ratio against a same-run measured memory read bandwidth (a large tensor sum).

With --forwards fast hf, each batch size runs with both forwards (engine/model_runner.py) in the
same process, one after another, and the fast/hf step-time ratio is printed.

With --compile off on, each batch size runs with the eager and the compiled decode layer
(engine/compiled_layer.py) in the same process, alternating for --rounds rounds; the compiled
side's first steps (its compiles) are timed apart and printed as the compile time.

With --dtypes float32 bfloat16, the model is loaded in both dtypes and their engines' steps alternate
for --rounds rounds in one process, per batch size.

With --baseline REV, the engine of git revision REV (exported to a temporary folder) and the
working tree's engine take turns, one fresh process each per round (--rounds), so both see the
same load on a shared machine; each process measures its own read bandwidth, and the best and
median over the rounds are printed per side.

  python benchmarks/decode_profile.py --batch 1 16 64
  python benchmarks/decode_profile.py --batch 1 32 --forwards fast hf
  python benchmarks/decode_profile.py --batch 1 32 --baseline HEAD~3 --rounds 5
  python benchmarks/decode_profile.py --batch 1 --compile off on --rounds 3 --steps 16 --top 0
  python benchmarks/decode_profile.py --batch 1 32 --dtypes float32 bfloat16 --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
        engine.add_request(
            str(i), [100 + (i + j) % 1000 for j in range(context)], SamplingParams(max_tokens=10_000, ignore_eos=True)
        )
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
    ap.add_argument("--top", type=int, default=8, help="profiler rows per batch (0: no profile)")
    ap.add_argument(
        "--forwards",
        nargs="+",
        default=[None],
        choices=("fast", "hf"),
        help="run each batch with these forwards (default: the engine's own choice)",
    )
    ap.add_argument(
        "--compile",
        nargs="+",
        choices=("off", "on"),
        help="run each batch eagerly and/or with the compiled decode layer, alternating --rounds times",
    )
    ap.add_argument(
        "--dtypes",
        nargs="+",
        choices=("float32", "bfloat16"),
        help="load the model in each dtype and alternate their engines for --rounds rounds",
    )
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="the profiled model's dtype (default float32)"
    )
    ap.add_argument("--baseline", metavar="REV", help="compare against the engine of this git revision")
    ap.add_argument("--current", metavar="REV", help="with --baseline: this revision, not the working tree")
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: processes per side")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = ap.parse_args()
    if args.baseline:
        compare(args)
        return
    if args.dtypes:
        compare_dtypes(args)
        return
    loaded = load_model(resolve_model(None), dtype=getattr(torch, args.dtype or "float32"))
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    figures: dict[str, float] = {}
    with torch.inference_mode():
        with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use set-up
            torch.ones(8).sum()
        if args.compile:
            compare_compile(loaded, weight_bytes, args, figures)
        else:
            for batch in args.batch:
                medians = {}
                for forward in args.forwards:
                    medians[forward] = profile_batch(loaded, batch, forward, weight_bytes, args, figures)
                if len(medians) == 2:
                    print(
                        f"batch {batch}: fast/hf step time {medians['fast'] / medians['hf']:.2f} "
                        f"(fast is {medians['hf'] / medians['fast']:.2f}x the tokens/s)"
                    )
    if args.json:
        print(json.dumps(figures))


def _export(root: Path, revision: str, folder: Path) -> Path:
    """The tree of `revision` written out to `folder` (a fresh folder)."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def compare(args: argparse.Namespace) -> None:
    """Baseline and working tree in alternating fresh processes; best and median per figure."""
    root = Path(__file__).resolve().parent.parent
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory(prefix="decode-profile-") as tmp:
        trees = {
            "baseline": _export(root, args.baseline, Path(tmp) / "baseline"),
            "current": _export(root, args.current, Path(tmp) / "current") if args.current else root,
        }
        for _ in range(args.rounds):
            for side, tree in trees.items():
                command = [
                    sys.executable,
                    __file__,
                    "--json",
                    "--top",
                    "0",
                    "--context",
                    str(args.context),
                    "--steps",
                    str(args.steps),
                    "--batch",
                    *map(str, args.batch),
                    "--dtype",
                    args.dtype or "float32",
                ]
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "proto")])}
                out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
                runs[side].append(json.loads(out.strip().splitlines()[-1]))
                print(side, runs[side][-1], flush=True)
    print(
        f"\n{args.rounds} rounds, baseline {args.baseline} vs {args.current or 'the working tree'} "
        "(best / median over rounds):"
    )
    for key in runs["current"][0]:
        pick = min if key.startswith("step_ms") else max  # best: the fastest step, the highest rate
        best = {side: pick(r[key] for r in rs) for side, rs in runs.items()}
        median = {side: statistics.median(r[key] for r in rs) for side, rs in runs.items()}
        print(
            f"  {key}: baseline {best['baseline']:.3f} / {median['baseline']:.3f}, "
            f"current {best['current']:.3f} / {median['current']:.3f}"
        )


def compare_compile(
    loaded,
    weight_bytes: int,
    args: argparse.Namespace,  # noqa: ANN001
    figures: dict[str, float],
) -> None:
    """Eager and compiled decode layers, alternating per round in this process (one FastForward,
    its compiled layer switched on and off); the compiled side's first run also reports how long
    its first steps took beyond a compiled step (the compiles)."""
    from pdserve.engine.fast_forward import fast_forward_for

    fast = fast_forward_for(loaded.model)
    assert fast is not None, "--compile needs the fast forward"
    fast.enable_compile()
    compiled, fast.compiled = fast.compiled, None
    for batch in args.batch:
        steps: dict[str, list[float]] = {mode: [] for mode in args.compile}
        for _ in range(args.rounds):
            for mode in args.compile:
                fast.compiled = compiled if mode == "on" else None
                engine = running_engine(loaded, batch, args.context)
                start = time.perf_counter()
                step_time(engine, 2)
                warm = time.perf_counter() - start
                median = step_time(engine, args.steps)
                if mode == "on" and compiled is not None and compiled.compile_s:
                    print(
                        f"batch {batch}: first 2 compiled steps took {warm:.1f} s "
                        f"({compiled.compile_s:.1f} s in calls that compiled a graph)"
                    )
                    figures[f"compile_s_batch{batch}"] = compiled.compile_s
                    compiled.compile_s = 0.0
                ratio = ""
                if batch == 1:
                    moved = _batch1_bytes(engine, weight_bytes, args.context) / median
                    ratio = f", floor ratio {moved / read_bandwidth():.3f}"
                print(f"batch {batch}, compile {mode}: {median * 1e3:.1f} ms per decode step{ratio}", flush=True)
                steps[mode].append(median * 1e3)
                _abort_all(engine)
        for mode, times in steps.items():
            figures[f"step_ms_batch{batch}_compile_{mode}"] = min(times)
            print(
                f"batch {batch}, compile {mode}: best {min(times):.1f} ms, median "
                f"{statistics.median(times):.1f} ms over {args.rounds} rounds"
            )
    fast.compiled = compiled


def compare_dtypes(args: argparse.Namespace) -> None:
    """The model loaded once per dtype in this process; per batch size, one engine per dtype, their
    steps alternating for --rounds rounds (a drifting machine weighs on every dtype alike)."""
    path = resolve_model(None)
    models = {dtype: load_model(path, dtype=getattr(torch, dtype)) for dtype in args.dtypes}
    with torch.inference_mode():
        for batch in args.batch:
            engines = {dtype: running_engine(m, batch, args.context) for dtype, m in models.items()}
            steps: dict[str, list[float]] = {dtype: [] for dtype in engines}
            for _ in range(args.rounds):
                for dtype, engine in engines.items():
                    steps[dtype].append(step_time(engine, args.steps) * 1e3)
            for dtype, engine in engines.items():
                times = steps[dtype]
                print(
                    f"batch {batch}, {dtype}: per round {', '.join(f'{t:.1f}' for t in times)} ms; best "
                    f"{min(times):.1f}, median {statistics.median(times):.1f} ms",
                    flush=True,
                )
                _abort_all(engine)
            if len(steps) == 2:
                first, second = (statistics.median(steps[d]) for d in args.dtypes)
                print(f"batch {batch}: {args.dtypes[1]} steps at {first / second:.2f}x the speed of {args.dtypes[0]}")


def profile_batch(
    loaded,
    batch: int,
    forward: str | None,
    weight_bytes: int,  # noqa: ANN001
    args: argparse.Namespace,
    figures: dict[str, float],
) -> float:
    """Median decode step of `batch` sequences with `forward`, and its profile; returns the median
    and adds it (and at batch 1 the floor ratio) to `figures`."""
    if forward is not None:
        os.environ["PDSERVE_FORWARD"] = forward
    engine = running_engine(loaded, batch, args.context)
    step_time(engine, 2)
    median = step_time(engine, args.steps)
    print(
        f"\nbatch {batch}, forward {getattr(engine.runner, 'forward_name', 'sim')}: "
        f"{median * 1e3:.1f} ms per decode step, "
        f"{batch / median:.0f} tokens/s"
    )
    figures[f"step_ms_batch{batch}"] = median * 1e3
    if args.top > 0:
        with profile(activities=[ProfilerActivity.CPU]):
            engine.step()  # warm the profiled path too
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if batch == 1:
        read = _batch1_bytes(engine, weight_bytes, args.context)
        bandwidth = read_bandwidth()
        moved = read / median
        print(
            f"batch 1: reads {read / 2**20:.0f} MiB per step -> "
            f"{moved / 1e9:.2f} GB/s; measured read bandwidth {bandwidth / 1e9:.2f} GB/s; "
            f"ratio {moved / bandwidth:.2f}"
        )
        figures["read_bandwidth_gbs"], figures["ratio_batch1"] = bandwidth / 1e9, moved / bandwidth
    _abort_all(engine)
    return median


def _batch1_bytes(engine, weight_bytes: int, context: int) -> int:  # noqa: ANN001
    """Bytes one batch-1 decode step reads: every weight plus the sequence's K/V (fp32, about
    `context` + 12 tokens over the measured steps)."""
    shape = engine.kv_cache.shape
    return weight_bytes + 2 * shape.num_layers * (context + 12) * shape.num_kv_heads * shape.head_dim * 4


def _abort_all(engine) -> None:  # noqa: ANN001
    """End every running sequence; every KV block is free again."""
    for rid in list(engine.sequences):
        engine.abort(rid)
    engine.pool.assert_all_free()


if __name__ == "__main__":
    main()
