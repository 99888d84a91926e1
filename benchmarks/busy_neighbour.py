"""The engine's decode step beside a busy neighbour: does a preempted compute thread stall the step?

For each dtype, one engine at --batch running sequences (context ~--context tokens), its decode steps
timed (median of --steps) in four conditions, alternating for --rounds rounds:

  quiet        nothing else runs
  busy         one process spins on one core (pure Python, as a router, a tokenizer or another
               pool's worker would) while the steps run
  1 thread     the engine computes on one thread (torch.set_num_threads(1)), nothing else runs
  1 thread busy
  adaptive busy  the engine's thread governor on (engine/thread_governor.py, on by default in
                 serving), after --adapt-steps steps beside the spinner to find its count
  adaptive quiet the same, after the spinner stopped

The other rows run with the governor off, at a fixed count. A step that only lost the preempted
core's share would run at about the 1-thread step's time beside a busy core (the neighbour takes
one core, the step keeps the other). `busy / 1 thread` well above 1.0 is time lost waiting for a
compute thread that was not running. The CPU model and its flags are
printed first.

  python benchmarks/busy_neighbour.py --dtypes bfloat16 float32 --batch 32 --rounds 3
  python benchmarks/busy_neighbour.py --same-group   # the spinner in the engine's own session
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_profile import _abort_all, running_engine, step_time  # noqa: E402
from peer_vllm import _spin, cpu_description  # noqa: E402

from pdserve.engine.model_fetch import resolve_model  # noqa: E402
from pdserve.engine.model_loader import load_model  # noqa: E402
from pdserve.engine.thread_governor import ThreadGovernor  # noqa: E402


def _spin_in_session(same_group: bool) -> None:
    if not same_group:
        os.setsid()  # its own session, so its own scheduler autogroup, as a separate program would be
    _spin()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--adapt-steps", type=int, default=16, help="steps the governor gets before its rows are timed")
    ap.add_argument("--same-group", action="store_true", help="the spinner in this process's session (autogroup)")
    args = ap.parse_args()
    print(cpu_description(), flush=True)
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    print(f"scheduler autogroup: {autogroup.read_text().strip() if autogroup.exists() else 'n/a'}", flush=True)
    threads = torch.get_num_threads()
    context = multiprocessing.get_context("spawn")
    with torch.inference_mode():
        for dtype in args.dtypes:
            loaded = load_model(resolve_model(None), dtype=getattr(torch, dtype))
            engine = running_engine(loaded, args.batch, args.context)
            step_time(engine, 3)
            names = ("quiet", "busy", "1 thread", "1 thread busy", "adaptive busy", "adaptive quiet")
            times: dict[str, list[float]] = {name: [] for name in names}
            moves = []
            for _ in range(args.rounds):
                spinner = None
                for name in names:
                    adaptive = name.startswith("adaptive")
                    if not adaptive or name == "adaptive busy":
                        engine.governor = ThreadGovernor(threads) if adaptive else None
                    torch.set_num_threads(1 if name.startswith("1 thread") else threads)
                    if name.endswith("busy") and spinner is None:
                        spinner = context.Process(target=_spin_in_session, args=(args.same_group,), daemon=True)
                        spinner.start()
                        time.sleep(0.3)
                    if not name.endswith("busy") and spinner is not None:
                        spinner.kill()
                        spinner.join()
                        spinner = None
                    if adaptive:
                        step_time(engine, args.adapt_steps)
                    try:
                        times[name].append(step_time(engine, args.steps) * 1e3)
                    finally:
                        if name == "adaptive quiet" and engine.governor is not None:
                            moves.append(engine.governor.moves)
                if spinner is not None:
                    spinner.kill()
                    spinner.join()
            engine.governor = None
            torch.set_num_threads(threads)
            med = {name: statistics.median(t) for name, t in times.items()}
            print(f"\n{dtype}, batch {args.batch}, {threads} threads (median step over {args.rounds} rounds):")
            for name, t in times.items():
                print(f"  {name:14s} {med[name]:7.1f} ms  (rounds {', '.join(f'{x:.1f}' for x in t)})")
            print(
                f"  busy keeps {med['quiet'] / med['busy']:.2f}x of quiet throughput; busy / 1-thread "
                f"{med['busy'] / med['1 thread']:.2f}; 2 threads are {med['1 thread'] / med['quiet']:.2f}x "
                "one thread quiet",
                flush=True,
            )
            print(
                f"  adaptive: busy keeps {med['quiet'] / med['adaptive busy']:.2f}x of quiet throughput, quiet "
                f"again {med['quiet'] / med['adaptive quiet']:.2f}x; the governor moved {moves} times per round",
                flush=True,
            )
            _abort_all(engine)


if __name__ == "__main__":
    main()
