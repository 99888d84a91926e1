"""The `pdserve bench`, `pdserve sweep` and `pdserve plan {profile,simulate,validate}` subcommands.

Heavy imports (transformers, torch, matplotlib) happen inside the command functions, so building
the parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from capacity.arrivals import parse_rate
from capacity.metrics import parse_slo
from capacity.workload import length_dist
from cluster.tables import format_table

DEFAULT_URL = "127.0.0.1:50051"


def _add_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", default="128", help="prompt tokens: N or LOW:HIGH (uniform)")
    p.add_argument("--input-hist", default=None, metavar="FILE", help="JSON/CSV of length,weight (wins)")
    p.add_argument("--output-len", default="64", help="max output tokens: N or LOW:HIGH (uniform)")
    p.add_argument("--output-hist", default=None, metavar="FILE", help="JSON/CSV of length,weight (wins)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    p.add_argument("--slo", action="append", default=[], metavar="METRIC_MS=V",
                   help="ttft_ms=..., tpot_ms=..., e2e_ms=... (repeatable)")


def _add_load(p: argparse.ArgumentParser) -> None:
    _add_workload(p)
    p.add_argument("--model", default=None, help="model folder whose tokenizer cuts the prompts (default model)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=0, help="requests sent first and not recorded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate exactly the output length")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request deadline")


def add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="load-generate against a running router")
    bench.add_argument("--url", default=DEFAULT_URL, help=f"router address (default {DEFAULT_URL})")
    bench.add_argument("--rate", type=parse_rate, default=math.inf, help="requests/s, or inf (all at once)")
    _add_load(bench)
    bench.add_argument("--output", default=None, metavar="FILE", help="write config, summary and records (JSON)")
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(func=_cmd_bench)


def add_sweep(commands: argparse._SubParsersAction) -> None:
    sweep = commands.add_parser("sweep", help="bench every xPyD split and colocated over rates")
    sweep.add_argument("--workers", type=int, default=2, help="worker budget")
    sweep.add_argument("--rates", type=_rates, required=True, help="comma-separated rates, e.g. 0.5,1,2")
    _add_load(sweep)
    sweep.add_argument("--output-dir", default="sweep-results")
    sweep.set_defaults(func=_cmd_sweep)


def add_plan(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="profile, simulate and validate deployments")
    sub = plan.add_subparsers(dest="plan_command", required=True)
    prof = sub.add_parser("profile", help="measure latencies on this machine, fit models")
    prof.add_argument("--model", default=None)
    prof.add_argument("--threads", type=int, default=1, help="torch threads (match the workers')")
    prof.add_argument("--repeats", type=int, default=3)
    prof.add_argument("--output", default="profile.json")
    prof.set_defaults(func=_cmd_profile)
    sim = sub.add_parser("simulate", help="search prefill:decode ratios and sizes for a rate")
    sim.add_argument("--profile", required=True)
    sim.add_argument("--profile-prefill", default=None, help="profile of the prefill device")
    sim.add_argument("--profile-decode", default=None, help="profile of the decode device")
    sim.add_argument("--rate", type=float, required=True)
    _add_workload(sim)
    sim.add_argument("--target", type=float, default=0.9, help="SLO attainment to reach (0.9: p90 SLOs)")
    sim.add_argument("--max-workers", type=int, default=64)
    sim.add_argument("--num-requests", type=int, default=400)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--output", default=None, metavar="FILE")
    sim.set_defaults(func=_cmd_simulate)
    val = sub.add_parser("validate", help="compare simulator predictions with a sweep")
    val.add_argument("--profile", required=True)
    val.add_argument("--sweep", required=True, help="results.json of `pdserve sweep`")
    val.add_argument("--repeats", type=int, default=20)
    val.add_argument("--output", default=None, metavar="FILE")
    val.set_defaults(func=_cmd_validate)


def _rates(text: str) -> list[float]:
    return [parse_rate(t) for t in text.split(",") if t.strip()]


def bench_config(args: argparse.Namespace, url: str) -> Any:
    from capacity.bench import BenchConfig

    return BenchConfig(
        url=url, input_len=length_dist(args.input_len, args.input_hist, "128"),
        output_len=length_dist(args.output_len, args.output_hist, "64"), num_prompts=args.num_prompts,
        rate=getattr(args, "rate", math.inf), burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        warmup=args.warmup, seed=args.seed, ignore_eos=args.ignore_eos, slos=parse_slo(args.slo),
        model=args.model, timeout_s=args.timeout,
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    from capacity.bench import print_summary, run_bench

    try:
        config = bench_config(args, args.url)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = run_bench(config, progress=not args.no_progress)
    print_summary(result["summary"])
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0 if result["summary"]["completed"] else 1


def _cmd_sweep(args: argparse.Namespace) -> int:
    from capacity.sweep import run_sweep

    try:
        config = bench_config(args, "")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    doc = run_sweep(config, args.workers, args.rates, Path(args.output_dir), args.model,
                    log=lambda s: print(s, file=sys.stderr, flush=True))
    from capacity.sweep import csv_row


    cols = ("config", "rate", "goodput", "slo_attainment_all", "ttft_p90_ms", "tpot_mean_ms", "itl_p99_ms")
    rows = [[_fmt(csv_row(p)[c]) for c in cols] for p in doc["points"]]
    print(format_table(cols, rows))
    print(f"best configuration: {doc['best_config']}")
    return 0


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _cmd_profile(args: argparse.Namespace) -> int:
    from capacity.profiler import run_profile

    doc = run_profile(args.model, args.threads, args.repeats, progress=lambda s: print(s, file=sys.stderr))
    Path(args.output).write_text(json.dumps(doc, indent=1))
    print(json.dumps({"fits": doc["fits"], "fit_forms": doc["fit_forms"], "device": doc["device"]}, indent=1))
    return 0


def _load_json(path: str | None) -> dict[str, Any] | None:
    return json.loads(Path(path).read_text()) if path else None


def _cmd_simulate(args: argparse.Namespace) -> int:
    from capacity.planner import Workload, format_rows, load_models, plan


    models = load_models(_load_json(args.profile) or {}, _load_json(args.profile_prefill),
                         _load_json(args.profile_decode))
    workload = Workload(length_dist(args.input_len, args.input_hist, "128"),
                        length_dist(args.output_len, args.output_hist, "64"), args.burstiness)
    try:
        result = plan(models, workload, args.rate, parse_slo(args.slo), args.target, args.max_workers,
                      args.num_requests, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cols = ("config", "workers", "attainment", "goodput", "ttft_p90_ms", "tpot_p90_ms", "note")
    print(format_table(cols, format_rows(result["rows"])))
    for key in ("best_disaggregated", "best_colocated", "recommended"):
        if key in result:
            r = result[key]
            print(f"{key}: {r['config']} ({r['workers']} workers, attainment {100 * r['attainment']:.1f}%, "
                  f"sustains {r['max_rate_at_target']:.2f} req/s = {r['goodput_per_worker']:.3f} req/s per worker)")
    if "recommended" not in result:
        print(f"no deployment up to {args.max_workers} workers meets the target")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from capacity.planner import VALIDATED, load_models, validate


    models = load_models(_load_json(args.profile) or {})
    result = validate(models, _load_json(args.sweep) or {}, args.repeats)
    keys = [m if s is None else f"{m}_{s}" for m, s in VALIDATED]
    rows = []
    for p in result["points"]:
        cells = [f"{p[k]['measured']:.2f}/{p[k]['predicted']:.2f} ({100 * p[k]['rel_error']:+.0f}%)" for k in keys]
        rows.append([p["config"], _fmt(p["rate"]), *cells])
    print(format_table(("config", "rate", *[f"{k} meas/pred" for k in keys]), rows))
    print("mean |relative error|: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in result["mean_abs_rel_error"].items()))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0
