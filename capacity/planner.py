"""`pdserve plan simulate|validate`: DistServe-style search over deployments with the simulator.

A deployment meets the SLOs at a rate when its SLO attainment (fraction of requests meeting every
SLO, i.e. the tail: attainment >= 0.9 means the p90 latencies are within the SLOs) is at least
``target``. The search tries total worker counts n = 1..max_workers in order and, for each n, every
split xPyD (x + y = n) and colocated xn; the recommendation is the smallest n with a deployment that
meets the target (ties: highest attainment), together with its goodput per worker, i.e. the
highest rate it sustains at the target divided by n (found by bisection).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from capacity.arrivals import arrival_times
from capacity.metrics import summarize
from capacity.simulator import Deployment, LatencyModel, simulate
from capacity.workload import LengthDist


@dataclass(frozen=True)
class Models:
    """Latency models of the prefill pool and of the decode / colocated pool, and engine limits."""

    prefill: LatencyModel
    decode: LatencyModel
    engine: dict[str, int]

    def deployment(self, prefill: int = 0, decode: int = 0, colocated: int = 0) -> Deployment:
        e = self.engine
        return Deployment(prefill, decode, colocated, prefill_token_budget=e["max_batched_tokens"],
                          max_num_seqs=e["max_num_seqs"], kv_capacity_tokens=e["decode_kv_capacity_tokens"],
                          block_size=e["block_size"])


@dataclass(frozen=True)
class Workload:
    input_len: LengthDist
    output_len: LengthDist
    burstiness: float = 1.0


def simulate_summary(models: Models, dep: Deployment, workload: Workload, rate: float, num_requests: int,
                     slos: dict[str, float], seed: int = 0) -> dict[str, Any]:
    """Simulate ``num_requests`` requests arriving at ``rate``; return the metrics summary."""
    rng = np.random.default_rng(seed)
    inputs = workload.input_len.sample(rng, num_requests)
    outputs = workload.output_len.sample(rng, num_requests)
    arrivals = arrival_times(num_requests, rate, workload.burstiness, seed + 1)
    records = simulate(dep, arrivals, inputs, outputs, models.prefill, models.decode)
    duration = max(r.send_time + (r.e2e or 0.0) for r in records)
    return summarize(records, duration, slos)


def candidates(n: int, colocated: bool = True) -> list[tuple[int, int, int]]:
    """(prefill, decode, colocated) counts with n workers in total."""
    out = [(x, n - x, 0) for x in range(1, n)]
    return out + [(0, 0, n)] if colocated else out


def prefill_saturated(models: Models, workload: Workload, rate: float, prefill: int) -> bool:
    """True when the prefill pool alone cannot keep up (utilization >= 1): skip without simulating."""
    return prefill > 0 and rate * models.prefill.prefill_s(round(workload.input_len.mean)) >= prefill


def max_rate(models: Models, dep: Deployment, workload: Workload, slos: dict[str, float], target: float,
             num_requests: int, seed: int, hi: float) -> float:
    """Highest rate (bisection, 8 rounds in [0, hi*4]) with attainment >= target."""
    lo, hi = 0.0, hi * 4
    for _ in range(8):
        mid = (lo + hi) / 2
        attained = simulate_summary(models, dep, workload, mid, num_requests, slos, seed)["slo_attainment_all"]
        lo, hi = (mid, hi) if attained is not None and attained >= target else (lo, mid)
    return lo


def plan(models: Models, workload: Workload, rate: float, slos: dict[str, float], target: float = 0.9,
         max_workers: int = 64, num_requests: int = 400, seed: int = 0) -> dict[str, Any]:
    """Search deployments; return every evaluated row and the recommendations (best overall,
    best disaggregated, best colocated: the smallest n meeting ``target`` in each family)."""
    if not slos:
        raise ValueError("planning needs at least one SLO")
    rows: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    for n in range(1, max_workers + 1):
        for p, d, c in candidates(n):
            family = "colocated" if c else "disaggregated"
            if family in best:
                continue
            dep = models.deployment(p, d, c)
            if prefill_saturated(models, workload, rate, p):
                rows.append({"config": dep.name, "workers": n, "attainment": 0.0, "skipped": "prefill saturated"})
                continue
            rows.append(_row(dep, simulate_summary(models, dep, workload, rate, num_requests, slos, seed)))
        for family in ("disaggregated", "colocated"):
            feasible = [r for r in rows if r["workers"] == n and _family(r) == family and r["attainment"] >= target]
            if family not in best and feasible:
                best[family] = max(feasible, key=lambda r: (r["attainment"], r["goodput"]))
        if len(best) == 2:
            break
    result: dict[str, Any] = {"rate": rate, "target": target, "rows": rows}
    for family, row in best.items():
        dep = _parse_name(models, row["config"])
        sustained = max_rate(models, dep, workload, slos, target, num_requests, seed, rate)
        row["max_rate_at_target"] = sustained
        row["goodput_per_worker"] = sustained / dep.num_workers
        result[f"best_{family}"] = row
    chosen = [result[k] for k in ("best_disaggregated", "best_colocated") if k in result]
    if chosen:
        result["recommended"] = min(chosen, key=lambda r: (r["workers"], -r["goodput_per_worker"]))
    return result


def _family(row: dict[str, Any]) -> str:
    return "colocated" if row["config"].startswith("colocated") else "disaggregated"


def _row(dep: Deployment, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "config": dep.name, "workers": dep.num_workers, "attainment": s["slo_attainment_all"],
        "goodput": s["goodput"], "ttft_p90_ms": s["ttft_ms"]["p90"], "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_p90_ms": s["tpot_ms"]["p90"], "tpot_p99_ms": s["tpot_ms"]["p99"], "itl_p99_ms": s["itl_ms"]["p99"],
    }


def _parse_name(models: Models, name: str) -> Deployment:
    if name.startswith("colocated x"):
        return models.deployment(colocated=int(name.removeprefix("colocated x")))
    p, _, d = name.removesuffix("D").partition("P")
    return models.deployment(int(p), int(d))


VALIDATED = (("goodput", None), ("ttft_ms", "mean"), ("ttft_ms", "p90"), ("tpot_ms", "mean"), ("itl_ms", "p99"))


def validate(models: Models, sweep: dict[str, Any], repeats: int = 20) -> dict[str, Any]:
    """Predict every measured sweep point (mean over ``repeats`` simulated runs of the same size)
    and report predicted, measured and relative error per metric, plus the mean absolute error."""
    bench = sweep["bench"]
    workload = Workload(LengthDist.from_json(bench["input_len"]), LengthDist.from_json(bench["output_len"]),
                        float(bench["burstiness"]))
    slos = {k: v / 1000 for k, v in bench["slos_ms"].items()}
    points = []
    for point in sweep["points"]:
        dep = models.deployment(point["prefill"], point["decode"], point["colocated"])
        sims = [simulate_summary(models, dep, workload, point["rate"], bench["num_prompts"], slos, seed)
                for seed in range(repeats)]
        row: dict[str, Any] = {"config": point["config"], "rate": point["rate"]}
        for metric, stat in VALIDATED:
            key = metric if stat is None else f"{metric}_{stat}"
            measured = _get(point["summary"], metric, stat)
            predicted = float(np.mean([_get(s, metric, stat) for s in sims]))
            row[key] = {"measured": measured, "predicted": predicted, "rel_error": _rel(predicted, measured)}
        points.append(row)
    keys = [m if s is None else f"{m}_{s}" for m, s in VALIDATED]
    mape = {k: float(np.mean([abs(p[k]["rel_error"]) for p in points if not math.isnan(p[k]["rel_error"])]))
            for k in keys}
    return {"points": points, "mean_abs_rel_error": mape}


def _get(summary: dict[str, Any], metric: str, stat: str | None) -> float:
    value = summary[metric] if stat is None else summary[metric][stat]
    return float(value or 0.0)


def _rel(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.nan


def load_models(profile: dict[str, Any], prefill_profile: dict[str, Any] | None = None,
                decode_profile: dict[str, Any] | None = None) -> Models:
    """Models from one profile, or per-device profiles for the prefill and decode pools."""
    from capacity.profiler import latency_model

    base = latency_model(profile)
    prefill = latency_model(prefill_profile) if prefill_profile else base
    decode = latency_model(decode_profile) if decode_profile else base
    # the KV transfer is paid on the prefill side's schedule: keep the base profile's link
    prefill = LatencyModel(prefill.prefill, prefill.decode, base.transfer, base.kv_bytes_per_token)
    engine = (decode_profile or profile)["engine"]
    return Models(prefill, decode, dict(engine))


def format_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        if "skipped" in r:
            out.append([r["config"], str(r["workers"]), "-", "-", "-", "-", r["skipped"]])
            continue
        out.append([r["config"], str(r["workers"]), f"{100 * r['attainment']:.1f}%", f"{r['goodput']:.3f}",
                    f"{r['ttft_p90_ms']:.0f}", f"{r['tpot_p90_ms']:.0f}", ""])
    return out
