"""Elastic prefill/decode demonstration on the simulated engine: a workload that shifts from long
prompts with short outputs to short prompts with long outputs, served by fixed P:D splits and by the
SLO autoscaler (which switches worker roles live), all measured in one run.

    python benchmarks/elastic_demo.py [--phase-s 45] [--speedup 0.2] [--output-dir benchmarks/reports/elastic]

Each configuration gets its own local cluster of 4 elastic sim workers (`serve --elastic --engine sim`)
and the same requests (same arrival times, lengths and token ids). The profile is the shipped H100
profile with a decode-heavier device (decode cost per sequence x37.5 and 12 sequences per decode
batch), so that with 4 workers phase A needs prefill capacity and phase B decode capacity at rates
this 2-core machine can drive. Times and rates are reported in profile time (wall x speedup).

Writes results.json, elastic_demo.png (SLO attainment and prefill workers over time) and prints a
table: goodput per configuration, and autoscaled / best fixed / worst fixed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from pdserve.capacity.metrics import RequestRecord  # noqa: E402
from pdserve.cluster.autoscaler import Autoscaler, AutoscalerConfig, AutoscalerLoop, PlannerSplits  # noqa: E402
from pdserve.cluster.client import PdserveClient, build_request, sampling_params, status_rows  # noqa: E402
from pdserve.cluster.engine_flags import sim_worker_args  # noqa: E402
from pdserve.cluster.local import LocalCluster, LocalClusterConfig  # noqa: E402
from pdserve.v1 import common_pb2, router_pb2_grpc  # noqa: E402

# profile time
PHASES = ({"name": "A: long prompts, short outputs", "prompt": 2048, "output": 8, "rate": 36.0},
          {"name": "B: short prompts, long outputs", "prompt": 128, "output": 64, "rate": 18.0})
SLO_TTFT_S, SLO_TPOT_S = 0.5, 0.04
CONFIGS = (("1P3D", 1, 3, False), ("2P2D", 2, 2, False), ("3P1D", 3, 1, False), ("autoscaled (from 2P2D)", 2, 2, True))


@dataclass(frozen=True)
class Planned:
    send_at: float  # profile seconds from the start
    phase: int
    prompt_ids: list[int]
    output_len: int


def demo_profile(out: Path) -> Path:
    doc = json.loads((REPO / "capacity/profiles/h100-llama-3.1-8b.json").read_text())
    doc["name"] = "elastic-demo (h100-llama-3.1-8b, decode-heavy)"
    doc["description"] = ("The shipped H100 profile with decode cost per sequence x37.5 and 12 sequences per "
                          "decode batch: a device whose decode saturates at rates a 2-core machine can drive")
    doc["decode"]["coef"][1] = doc["decode"]["coef"][1] * 37.5
    doc["engine"]["max_num_seqs"] = 12
    doc["engine"]["kv_capacity_tokens"] = 65536
    path = out / "demo-profile.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def plan_requests(phase_s: float, seed: int = 0) -> list[Planned]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for index, phase in enumerate(PHASES):
        end = phase_s * (index + 1)
        while True:
            t += rng.expovariate(phase["rate"])
            if t >= end:
                t = end
                break
            ids = [rng.randrange(1000, 20000) for _ in range(phase["prompt"])]
            out.append(Planned(t, index, ids, phase["output"]))
    return out


async def one(stub: router_pb2_grpc.RouterStub, planned: Planned, index: int, t0: float) -> RequestRecord:
    params = sampling_params(max_tokens=planned.output_len, ignore_eos=True, temperature=0.0)
    request = build_request(token_ids=planned.prompt_ids, params=params, request_id=f"demo-{index}")
    start = time.perf_counter()
    record = RequestRecord(index=index, send_time=start - t0, prompt_tokens=len(planned.prompt_ids))
    last = start
    try:
        async for response in stub.Generate(request, timeout=600):
            now = time.perf_counter()
            if response.token_ids:
                if record.ttft is None:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last)
                last = now
                record.output_tokens += len(response.token_ids)
            if response.finish_reason == common_pb2.FINISH_REASON_ERROR:
                record.error = response.error or "error"
        record.e2e = time.perf_counter() - start
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    return record


async def drive(url: str, plan: list[Planned], speedup: float) -> tuple[list[RequestRecord], float]:
    async with grpc.aio.insecure_channel(url) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        t0 = time.perf_counter()

        async def timed(i: int, p: Planned) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + p.send_at / speedup - time.perf_counter()))
            return await one(stub, p, i, t0)

        records = await asyncio.gather(*(timed(i, p) for i, p in enumerate(plan)))
    return list(records), t0


def watch_roles(url: str, stop: threading.Event, t0_box: list[float], out: list[tuple[float, int, int]]) -> None:
    with PdserveClient(url) as client:
        while not stop.wait(0.5):
            try:
                rows = status_rows(client.status())
            except grpc.RpcError:
                continue
            if t0_box:
                out.append((time.perf_counter() - t0_box[0], sum(r["role"] == "prefill" for r in rows),
                            sum(r["role"] == "decode" for r in rows)))


def meets(r: RequestRecord, speedup: float) -> bool:
    if not r.success:
        return False
    tpot = r.tpot
    return r.ttft * speedup <= SLO_TTFT_S and (tpot is None or tpot * speedup <= SLO_TPOT_S)


def run_config(name: str, prefill: int, decode: int, autoscale: bool, plan: list[Planned], profile: Path,
               speedup: float, planner: PlannerSplits | None, log_dir: Path) -> dict:
    config = LocalClusterConfig(prefill=prefill, decode=decode, elastic=True, threads_per_worker=1,
                                prefill_args=sim_worker_args(str(profile), speedup),
                                decode_args=sim_worker_args(str(profile), speedup),
                                log_dir=str(log_dir / name.split()[0]), log_level="WARNING")
    print(f"== {name}", flush=True)
    with LocalCluster(config) as cluster:
        url = cluster.router_address
        loop = None
        if autoscale:
            core = Autoscaler(AutoscalerConfig(
                ttft_s=SLO_TTFT_S / speedup, tpot_s=SLO_TPOT_S / speedup, window_s=1.2 / speedup,
                confirm_s=0.3 / speedup, cooldown_s=0.6 / speedup, min_samples=8, min_workers=4, max_workers=4),
                planner)
            loop = AutoscalerLoop(url, core, interval_s=0.1 / speedup).start()
        stop, t0_box, roles = threading.Event(), [], []
        watcher = threading.Thread(target=watch_roles, args=(url, stop, t0_box, roles), daemon=True)
        watcher.start()
        t0_box.append(time.perf_counter())
        records, _ = asyncio.run(drive(url, plan, speedup))
        stop.set()
        watcher.join()
        history = []
        if loop is not None:
            loop.stop()
            history = [{**h, "at": (h["at"] - t0_box[0]) * speedup, "took_s": h["took_s"] * speedup}
                       for h in loop.history]
    duration = max(r.send_time + (r.e2e or 0.0) for r in records) * speedup
    good = [meets(r, speedup) for r in records]
    per_phase = {}
    for index in range(len(PHASES)):
        sel = [g for g, p in zip(good, plan, strict=True) if p.phase == index]
        per_phase[index] = sum(sel) / len(sel) if sel else 0.0
    result = {
        "name": name, "goodput": sum(good) / duration, "attainment": sum(good) / len(good),
        "attainment_by_phase": per_phase, "failed": sum(not r.success for r in records),
        "duration_s": duration, "switches": history,
        "roles": [(t * speedup, p, d) for t, p, d in roles],
        "requests": [{"send": r.send_time * speedup, "phase": p.phase, "good": g,
                      "ttft": r.ttft * speedup if r.ttft else None,
                      "tpot": r.tpot * speedup if r.tpot else None}
                     for r, p, g in zip(records, plan, good, strict=True)],
    }
    print(f"   goodput {result['goodput']:.2f} req/s, attainment {result['attainment']:.2%} "
          f"(A {per_phase[0]:.0%}, B {per_phase[1]:.0%}), switches {len(history)}", flush=True)
    return result


def plot(results: list[dict], phase_s: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    bin_s = phase_s / 8
    for res in results:
        bins: dict[int, list[bool]] = {}
        for r in res["requests"]:
            bins.setdefault(int(r["send"] // bin_s), []).append(r["good"])
        xs = sorted(bins)
        top.plot([(x + 0.5) * bin_s for x in xs], [sum(bins[x]) / len(bins[x]) for x in xs], marker="o", ms=3,
                 label=f"{res['name']}: goodput {res['goodput']:.1f} req/s", lw=2.2 if res["switches"] or
                 "auto" in res["name"] else 1.2)
        if "auto" in res["name"]:
            ts = [t for t, _, _ in res["roles"]]
            bottom.step(ts, [p for _, p, _ in res["roles"]], where="post", color="C3", label="prefill workers")
            bottom.step(ts, [d for _, _, d in res["roles"]], where="post", color="C0", label="decode workers")
    for ax in (top, bottom):
        ax.axvline(phase_s, color="gray", ls="--", lw=1)
    top.set_ylabel("SLO attainment (per send-time bin)")
    top.set_title(f"Shifting workload, 4 sim workers: {PHASES[0]['name']} -> {PHASES[1]['name']}\n"
                  f"SLO: TTFT <= {SLO_TTFT_S * 1000:.0f} ms, TPOT <= {SLO_TPOT_S * 1000:.0f} ms (profile time)",
                  fontsize=9)
    top.set_ylim(-0.05, 1.05)
    top.legend(fontsize=8, loc="lower left")
    bottom.set_ylabel("workers (autoscaled run)")
    bottom.set_xlabel("time (s, profile time)")
    bottom.set_ylim(0, 4.5)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=10.0, help="length of each phase in profile seconds")
    ap.add_argument("--speedup", type=float, default=0.2, help="sim speedup (wall = profile / speedup)")
    ap.add_argument("--output-dir", default=str(REPO / "benchmarks/reports/elastic"))
    ap.add_argument("--only", default="", help="comma-separated config names to run (default all)")
    args = ap.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    profile = demo_profile(out)
    plan = plan_requests(args.phase_s)
    planner = PlannerSplits(str(profile), SLO_TTFT_S / args.speedup, SLO_TPOT_S / args.speedup, 0.9, args.speedup)
    for phase in PHASES:  # plan the nominal mixes before serving (the planner is CPU-heavy)
        from pdserve.cluster.autoscaler import Mix

        planner(Mix(phase["prompt"], phase["output"], phase["rate"] * args.speedup), 4)
    chosen = [c for c in CONFIGS if not args.only or c[0].split()[0] in args.only.split(",")]
    results = [run_config(name, p, d, auto, plan, profile, args.speedup, planner, Path("/tmp") / "elastic-demo-logs")
               for name, p, d, auto in chosen]
    fixed = [r for r in results if "auto" not in r["name"]]
    auto = [r for r in results if "auto" in r["name"]]
    summary = {}
    if fixed and auto:
        best, worst = max(fixed, key=lambda r: r["goodput"]), min(fixed, key=lambda r: r["goodput"])
        summary = {"autoscaled_over_best_fixed": auto[0]["goodput"] / best["goodput"],
                   "autoscaled_over_worst_fixed": auto[0]["goodput"] / max(worst["goodput"], 1e-9),
                   "best_fixed": best["name"], "worst_fixed": worst["name"]}
        print(f"autoscaled / best fixed ({best['name']}) = {summary['autoscaled_over_best_fixed']:.2f}; "
              f"autoscaled / worst fixed ({worst['name']}) = {summary['autoscaled_over_worst_fixed']:.2f}")
    doc = {"phases": PHASES, "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S}, "phase_s": args.phase_s,
           "speedup": args.speedup, "summary": summary, "results": results}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    plot(results, args.phase_s, out / "elastic_demo.png")
    print(f"wrote {out / 'results.json'} and {out / 'elastic_demo.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
