"""The cost of a second OpenMP pool in one process (pdserve/omp_pool.py), measured on the engine.

A worker loads its model on its main thread and runs its passes on its engine thread. With GNU
OpenMP (torch's on Linux), two threads that each ran a parallel region hold two helper pools, and
more pool threads than CPUs throttle every team's spin-wait: helpers sleep at each region. This runs
the default model's decode step (--batch sequences at ~--context tokens, --dtype), one fresh
process per mode and round, the modes interleaved:

  main      steps on the thread that loaded the model (one pool: the bare benchmarks' case)
  thread    steps on a second thread, the loading thread's pool kept (a worker before the fix)
  released  steps on a second thread after the loading thread's pool was released (a worker now)

Printed per mode: median ms per step over --rounds and the engine thread's voluntary context
switches (sleeps) per step, with the CPU model and flags.

  python benchmarks/omp_team.py --rounds 3
  python benchmarks/omp_team.py --dtype float32 --batch 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("main", "thread", "released")


def _switches() -> int:
    with open(f"/proc/self/task/{threading.get_native_id()}/status", encoding="utf-8") as status:
        return int(next(line for line in status if line.startswith("voluntary_ctxt_switches")).split()[1])


def one(mode: str, dtype: str, batch: int, context: int, steps: int) -> dict[str, float]:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from decode_profile import running_engine

    from pdserve.engine.model_fetch import resolve_model
    from pdserve.engine.model_loader import load_model
    from pdserve.omp_pool import release_thread_pool

    engine = running_engine(load_model(resolve_model(None), dtype=getattr(torch, dtype)), batch, context)
    for _ in range(3):
        engine.step()  # warm, on the loading thread: its pool exists from here on
    if mode == "released" and not release_thread_pool():
        raise SystemExit("release_thread_pool() did nothing here (no libgomp?)")
    result: dict[str, float] = {}

    def run() -> None:
        for _ in range(3):
            engine.step()
        before, start = _switches(), time.perf_counter()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        result["ms"] = statistics.median(times) * 1e3
        result["sleeps"] = (_switches() - before) / steps
        result["wall_s"] = time.perf_counter() - start

    if mode == "main":
        run()
    else:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child process's own mode
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.dtype, args.batch, args.context, args.steps)))
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from peer_vllm import cpu_description

    print(cpu_description(), flush=True)
    print(f"{args.dtype}, batch {args.batch}, context ~{args.context}, {args.steps} steps per round", flush=True)
    figures: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            argv = [sys.executable, __file__, "--one", mode, "--dtype", args.dtype, "--batch", str(args.batch)]
            argv += ["--context", str(args.context), "--steps", str(args.steps)]
            out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            figures[mode].append(got)
            print(f"round {r + 1} {mode:9} {got['ms']:6.1f} ms/step  {got['sleeps']:6.1f} sleeps/step", flush=True)
    base = statistics.median(f["ms"] for f in figures["main"])
    for mode in MODES:
        ms = statistics.median(f["ms"] for f in figures[mode])
        sleeps = statistics.median(f["sleeps"] for f in figures[mode])
        print(f"{mode:9} median {ms:6.1f} ms/step ({ms / base:.2f}x main), {sleeps:.1f} sleeps/step")


if __name__ == "__main__":
    main()
