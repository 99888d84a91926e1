"""Elastic prefill/decode demonstration on the simulated engine (not the real model): a workload that
shifts from long prompts with short outputs to short prompts with long outputs, served by every fixed
P:D split of N workers and by the SLO autoscaler (which switches worker roles live), same arrival
trace for all, measured in one run.

    python benchmarks/elastic_demo.py [--workers 4] [--phase-s 20] [--speedup 0.25] \
        [--output-dir benchmarks/reports/elastic-demo] [--only 1P3D,autoscaled]

Each configuration gets its own local cluster of N elastic sim workers (`LocalCluster`, as `serve
--elastic --engine sim`) and the same requests (same send times, lengths and token ids), sent by
`pdserve bench`'s request loop (`capacity.bench.run_planned_async`). The profile is the shipped H100
profile with a decode-heavier device (decode cost per sequence x37.5, 12 sequences per decode batch),
so that with 4 workers phase A needs prefill capacity and phase B decode capacity at rates this
2-core machine can drive. The autoscaled run starts from the middle split and runs the autoscaler's
decision core and loop (`cluster.autoscaler`, as `serve --autoscale` does) with its time constants
given in profile time. Times and rates are reported in profile time (wall x speedup).

Writes results.json, elastic_demo.png (SLO attainment over time for every configuration, and the
autoscaled run's roles over time) and prints goodput per configuration and autoscaled / best fixed /
worst fixed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, TypedDict

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from pdserve.capacity.arrivals import arrival_times  # noqa: E402
from pdserve.capacity.bench import BenchConfig, PlannedRequest, run_planned_async  # noqa: E402
from pdserve.capacity.metrics import RequestRecord, meets_all  # noqa: E402
from pdserve.capacity.splits import PlannerSplits  # noqa: E402
from pdserve.capacity.workload import LengthDist  # noqa: E402
from pdserve.cluster.autoscaler import Autoscaler, AutoscalerConfig, AutoscalerLoop, Mix  # noqa: E402
from pdserve.cluster.client import PdserveClient, status_rows  # noqa: E402
from pdserve.cluster.engine_flags import sim_worker_args  # noqa: E402
from pdserve.cluster.launch import LaunchOptions, local_deployment  # noqa: E402
from pdserve.cluster.local import LocalCluster  # noqa: E402


# profile time
class Phase(TypedDict):
    name: str
    prompt: int
    output: int
    rate: float


PHASES: tuple[Phase, ...] = (
    {"name": "A: long prompts, short outputs", "prompt": 2048, "output": 8, "rate": 40.0},
    {"name": "B: short prompts, long outputs", "prompt": 128, "output": 64, "rate": 18.0},
)
SLOS = {"ttft": 0.5, "tpot": 0.04}  # seconds, profile time
# the autoscaler's time constants in profile seconds (divided by the speedup for the wall-clock loop)
AUTOSCALER = {"window_s": 1.5, "confirm_s": 0.5, "cooldown_s": 1.5, "interval_s": 0.1}


def demo_profile(out: Path) -> Path:
    doc = json.loads((REPO / "capacity/profiles/h100-llama-3.1-8b.json").read_text())
    doc["name"] = "elastic-demo (h100-llama-3.1-8b, decode-heavy)"
    doc["description"] = (
        "The shipped H100 profile with decode cost per sequence x37.5 and 12 sequences per "
        "decode batch: a device whose decode saturates at rates a 2-core machine can drive"
    )
    doc["decode"]["coef"][1] = doc["decode"]["coef"][1] * 37.5
    doc["engine"]["max_num_seqs"] = 12
    doc["engine"]["kv_capacity_tokens"] = 65536
    path = out / "demo-profile.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def plan_trace(phase_s: float, seed: int = 0) -> tuple[list[PlannedRequest], list[int]]:
    """The shifting trace: Poisson arrivals per phase (profile seconds), random prompt token ids (the
    sim engine only counts them); returns the requests and each one's phase."""
    rng = random.Random(seed)
    requests, phases = [], []
    for index, phase in enumerate(PHASES):
        start = phase_s * index
        offsets = [
            t for t in arrival_times(int(phase["rate"] * phase_s * 2), phase["rate"], 1.0, seed + index) if t < phase_s
        ]
        for offset in offsets:
            ids = [rng.randrange(1000, 20000) for _ in range(phase["prompt"])]
            requests.append(PlannedRequest(ids, phase["output"], start + offset))
            phases.append(index)
    return requests, phases


def watch_roles(url: str, stop: threading.Event, out: list[tuple[float, int, int]]) -> None:
    """(perf_counter, prefill workers, decode workers) every 0.25 s, as `pdserve status` shows them."""
    with PdserveClient(url) as client:
        while not stop.wait(0.25):
            try:
                rows = status_rows(client.status())
            except grpc.RpcError:
                continue
            out.append(
                (
                    time.perf_counter(),
                    sum(r["role"] == "prefill" for r in rows),
                    sum(r["role"] == "decode" for r in rows),
                )
            )


def run_config(
    name: str,
    prefill: int,
    decode: int,
    autoscale: bool,
    trace: list[PlannedRequest],
    phases: list[int],
    profile: Path,
    speedup: float,
    planner: PlannerSplits | None,
    log_dir: Path,
) -> dict:
    engine = sim_worker_args(str(profile), speedup)
    config = local_deployment(
        prefill=prefill,
        decode=decode,
        elastic=True,
        threads_per_worker=1,
        log_dir=str(log_dir / name),
        log_level="WARNING",
    )
    print(f"== {name}", flush=True)
    n = prefill + decode
    with LocalCluster(config, LaunchOptions(prefill_args=engine, decode_args=engine)) as cluster:
        url = cluster.router_address
        loop = None
        if autoscale:
            wall = {k: v / speedup for k, v in AUTOSCALER.items()}
            core = Autoscaler(
                AutoscalerConfig(
                    ttft_s=SLOS["ttft"] / speedup,
                    tpot_s=SLOS["tpot"] / speedup,
                    window_s=wall["window_s"],
                    confirm_s=wall["confirm_s"],
                    cooldown_s=wall["cooldown_s"],
                    min_samples=8,
                    min_workers=n,
                    max_workers=n,
                ),
                planner,
            )
            loop = AutoscalerLoop(url, core, interval_s=wall["interval_s"]).start()
        stop, roles = threading.Event(), list[Any]()
        watcher = threading.Thread(target=watch_roles, args=(url, stop, roles), daemon=True)
        watcher.start()
        bench = BenchConfig(
            url=url,
            input_len=LengthDist(values=(1,), weights=(1.0,)),
            output_len=LengthDist(values=(1,), weights=(1.0,)),
            num_prompts=len(trace),
            ignore_eos=True,
            slos=SLOS,
            speedup=speedup,
            engine="sim",
            profile=str(profile),
        )
        t0 = time.perf_counter()
        t0_monotonic = time.monotonic()  # the autoscaler loop's clock
        doc = asyncio.run(run_planned_async(bench, trace))
        stop.set()
        watcher.join()
        history = []
        if loop is not None:
            loop.stop()
            history = [
                {**h, "at": (h["at"] - t0_monotonic) * speedup, "took_s": h["took_s"] * speedup} for h in loop.history
            ]
    records = [RequestRecord.from_json(r) for r in doc["records"]]
    summary = doc["summary"]
    good = [meets_all(r, SLOS) for r in records]
    by_phase = {}
    for index in range(len(PHASES)):
        sel = [g for g, p in zip(good, phases, strict=True) if p == index]
        by_phase[index] = sum(sel) / len(sel) if sel else 0.0
    result = {
        "name": name,
        "goodput": summary["goodput"],
        "attainment": sum(good) / len(good),
        "attainment_by_phase": by_phase,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "duration_s": summary["duration_s"],
        "switches": history,
        "roles": [((t - t0) * speedup, p, d) for t, p, d in roles],
        "requests": [
            {
                "send": _round(r.send_time),
                "phase": p,
                "good": g,
                "ttft": _round(r.ttft),
                "tpot": _round(r.tpot),
                "error": r.error,
            }
            for r, p, g in zip(records, phases, good, strict=True)
        ],
    }
    print(
        f"   goodput {result['goodput']:.2f} req/s, attainment {result['attainment']:.1%} "
        f"(A {by_phase[0]:.0%}, B {by_phase[1]:.0%}), completed {summary['completed']}/{len(records)}, "
        f"switches {len(history)}",
        flush=True,
    )
    for h in history:
        print(
            f"   t={h['at']:.1f}s {h['kind']} {h['worker_id']} -> {h['role']} ({h['outcome']}, "
            f"{h['took_s']:.2f}s): {h['reason']}",
            flush=True,
        )
    return result


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def plot(results: list[dict], phase_s: float, workers: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=(3, 2))
    bin_s = phase_s / 8
    for res in results:
        bins: dict[int, list[bool]] = {}
        for r in res["requests"]:
            bins.setdefault(int(r["send"] // bin_s), []).append(r["good"])
        xs = sorted(bins)
        auto = res["name"].startswith("auto")
        top.plot(
            [(x + 0.5) * bin_s for x in xs],
            [sum(bins[x]) / len(bins[x]) for x in xs],
            marker="o",
            ms=3,
            label=f"{res['name']}: goodput {res['goodput']:.1f} req/s",
            lw=2.4 if auto else 1.2,
            color="black" if auto else None,
        )
        if auto:
            ts = [t for t, _, _ in res["roles"]]
            bottom.step(ts, [p for _, p, _ in res["roles"]], where="post", color="C3", label="prefill workers")
            bottom.step(ts, [d for _, _, d in res["roles"]], where="post", color="C0", label="decode workers")
            for h in res["switches"]:
                bottom.axvline(h["at"], color="gray", lw=0.6, ls=":")
    for ax in (top, bottom):
        ax.axvline(phase_s, color="gray", ls="--", lw=1)
    top.set_ylabel("SLO attainment (by send time)")
    top.set_title(
        f"Shifting workload, {workers} sim workers: {PHASES[0]['name']} -> {PHASES[1]['name']}\n"
        f"SLO: TTFT <= {SLOS['ttft'] * 1000:.0f} ms, TPOT <= {SLOS['tpot'] * 1000:.0f} ms "
        "(profile time; simulated engine)",
        fontsize=9,
    )
    top.set_ylim(-0.05, 1.05)
    top.legend(fontsize=8, loc="lower left")
    bottom.set_ylabel("workers (autoscaled run)")
    bottom.set_xlabel("time (s, profile time)")
    bottom.set_ylim(0, workers + 0.5)
    bottom.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=20.0, help="length of each phase in profile seconds")
    ap.add_argument("--speedup", type=float, default=0.25, help="sim speedup (wall = profile / speedup)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default=str(REPO / "benchmarks/reports/elastic-demo"))
    ap.add_argument("--log-dir", default=None, help="process logs (default: a temporary folder)")
    ap.add_argument("--only", default="", help="comma-separated configurations to run, e.g. 2P2D,autoscaled")
    ap.add_argument("--no-planner", action="store_true", help="autoscale on pressure signals only")
    ap.add_argument(
        "--fixed-from",
        default=None,
        metavar="RESULTS_JSON",
        help="take the fixed splits' results from an earlier run of the same trace (same phases, "
        "SLOs, --phase-s, --speedup, --seed, --workers) and run only the autoscaled one",
    )
    args = ap.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="elastic-demo-logs-"))
    profile = demo_profile(out)
    trace, phases = plan_trace(args.phase_s, args.seed)
    n = args.workers
    start_p = n // 2
    configs = [(f"{p}P{n - p}D", p, n - p, False) for p in range(1, n)] + [("autoscaled", start_p, n - start_p, True)]
    chosen = [c for c in configs if not args.only or c[0] in args.only.split(",")]
    reused: list[dict] = []
    if args.fixed_from:
        earlier = json.loads(Path(args.fixed_from).read_text())
        same = {
            "phases": [dict(p) for p in PHASES],
            "slos_s": SLOS,
            "phase_s": args.phase_s,
            "speedup": args.speedup,
            "seed": args.seed,
            "workers": n,
        }
        differs = [k for k, v in same.items() if earlier.get(k, 0 if k == "seed" else None) != v]
        if differs:
            raise SystemExit(f"--fixed-from {args.fixed_from}: another trace ({', '.join(differs)} differ)")
        reused = [r for r in earlier["results"] if not r["name"].startswith("auto")]
        chosen = [c for c in chosen if c[3]]
    planner = None
    if any(auto for *_, auto in chosen) and not args.no_planner:
        planner = PlannerSplits(
            str(profile), SLOS["ttft"] / args.speedup, SLOS["tpot"] / args.speedup, 0.9, args.speedup
        )
        for phase in PHASES:  # plan the nominal mixes before serving (the planner is CPU-heavy)
            rates = planner(Mix(phase["prompt"], phase["output"], phase["rate"] * args.speedup), n)
            print(
                f"planner, {phase['name']}: "
                + ", ".join(f"{p}P{n - p}D {r / args.speedup:.1f} req/s" for p, r in sorted(rates.items())),
                flush=True,
            )
    print(
        f"{len(trace)} requests over {2 * args.phase_s:.0f} profile seconds "
        f"({2 * args.phase_s / args.speedup:.0f} s wall per configuration); logs in {log_dir}",
        flush=True,
    )
    results = reused + [
        run_config(name, p, d, auto, trace, phases, profile, args.speedup, planner, log_dir)
        for name, p, d, auto in chosen
    ]
    fixed = [r for r in results if not r["name"].startswith("auto")]
    auto = [r for r in results if r["name"].startswith("auto")]
    summary = {}
    if fixed and auto:
        best, worst = max(fixed, key=lambda r: r["goodput"]), min(fixed, key=lambda r: r["goodput"])
        summary = {
            "autoscaled_goodput": auto[0]["goodput"],
            "best_fixed": best["name"],
            "best_fixed_goodput": best["goodput"],
            "worst_fixed": worst["name"],
            "worst_fixed_goodput": worst["goodput"],
            "autoscaled_over_best_fixed": auto[0]["goodput"] / best["goodput"],
            "autoscaled_over_worst_fixed": auto[0]["goodput"] / max(worst["goodput"], 1e-9),
        }
        print(
            f"autoscaled / best fixed ({best['name']}) = {summary['autoscaled_over_best_fixed']:.2f}; "
            f"autoscaled / worst fixed ({worst['name']}) = {summary['autoscaled_over_worst_fixed']:.2f}"
        )
    doc = {
        "engine": "sim",
        "command": " ".join(["python", "benchmarks/elastic_demo.py", *sys.argv[1:]]),
        "phases": PHASES,
        "slos_s": SLOS,
        "autoscaler_profile_s": AUTOSCALER,
        "phase_s": args.phase_s,
        "speedup": args.speedup,
        "seed": args.seed,
        "workers": n,
        "requests": len(trace),
        "fixed_from": args.fixed_from,
        "summary": summary,
        "results": results,
    }
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    plot(results, args.phase_s, n, out / "elastic_demo.png")
    print(f"wrote {out / 'results.json'} and {out / 'elastic_demo.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
