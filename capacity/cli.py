"""The `pdserve bench`, `pdserve sweep` and `pdserve plan {profile,fit,simulate,validate,calibrate}` subcommands.

Heavy imports (transformers, torch, matplotlib) happen inside the command functions, so building
the parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pdserve.capacity.arrivals import parse_rate
from pdserve.capacity.metrics import parse_slo
from pdserve.capacity.workload import length_dist
from pdserve.cluster.engine_flags import add_engine_flags, engine_worker_args
from pdserve.cluster.tables import format_table
from pdserve.constants import REQUEST_TIMEOUT_S
from pdserve.extras import require

T = TypeVar("T")

DEFAULT_URL = "127.0.0.1:50051"


def _add_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", default="128", help="prompt tokens: N or LOW:HIGH (uniform)")
    p.add_argument("--input-hist", default=None, metavar="FILE", help="JSON/CSV of length,weight (wins)")
    p.add_argument("--output-len", default="64", help="max output tokens: N or LOW:HIGH (uniform)")
    p.add_argument("--output-hist", default=None, metavar="FILE", help="JSON/CSV of length,weight (wins)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    p.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="METRIC_MS=V",
        help="ttft_ms=..., tpot_ms=..., e2e_ms=... (repeatable)",
    )


def _add_load(p: argparse.ArgumentParser) -> None:
    _add_workload(p)
    p.add_argument("--model", default=None, help="model folder whose tokenizer cuts the prompts (default model)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=0, help="requests sent first and not recorded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate exactly the output length")
    p.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT_S, metavar="S", help="per-request deadline")


def add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="load-generate against a running router")
    bench.add_argument("--url", default=DEFAULT_URL, help=f"router address (default {DEFAULT_URL})")
    bench.add_argument("--rate", type=parse_rate, default=math.inf, help="requests/s, or inf (all at once)")
    bench.add_argument(
        "--token",
        default=None,
        help="bearer token for a router started with an auth token (default: $PDSERVE_AUTH_TOKEN)",
    )
    bench.add_argument("--tls-ca", default=None, metavar="PEM", help="trust this CA/certificate and use TLS")
    _add_load(bench)
    bench.add_argument("--output", default=None, metavar="FILE", help="write config, summary and records (JSON)")
    bench.add_argument("--no-progress", action="store_true")
    add_engine_flags(bench)
    bench.set_defaults(func=_cmd_bench)


def add_sweep(commands: argparse._SubParsersAction) -> None:
    sweep = commands.add_parser("sweep", help="bench every xPyD split and colocated over rates")
    sweep.add_argument("--workers", type=int, default=2, help="worker budget")
    sweep.add_argument("--rates", type=_rates, required=True, help="comma-separated rates, e.g. 0.5,1,2")
    _add_load(sweep)
    sweep.add_argument(
        "--configs",
        default=None,
        metavar="NAMES",
        help="only these configurations, comma-separated (e.g. 1P5D,3P3D,colocated x6); default all",
    )
    sweep.add_argument("--output-dir", default="sweep-results")
    add_engine_flags(sweep)
    sweep.set_defaults(func=_cmd_sweep)


def add_plan(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="profile, simulate and validate deployments")
    sub = plan.add_subparsers(dest="plan_command", required=True)
    prof = sub.add_parser("profile", help="measure latencies on this machine, write a profile")
    prof.add_argument("--model", default=None)
    prof.add_argument("--threads", type=int, default=1, help="torch threads (match the workers')")
    prof.add_argument("--repeats", type=int, default=3)
    prof.add_argument(
        "--contention",
        type=int,
        default=1,
        metavar="N",
        help="measure while N - 1 co-running helpers keep other cores busy (N workers share the machine)",
    )
    prof.add_argument(
        "--prefill-tokens",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="prompt lengths of the prefill points (default 32,128,256,512,1024)",
    )
    prof.add_argument(
        "--decode-batches",
        type=_int_list,
        default=None,
        metavar="B,B,...",
        help="batch sizes of the decode points (default 1,4,16); measure the batches your "
        "workload runs: the fit is a line in the batch",
    )
    prof.add_argument(
        "--decode-contexts",
        type=_int_list,
        default=None,
        metavar="C,C,...",
        help="context lengths of the decode points (default 128,512,1024)",
    )
    prof.add_argument("--output", default="profile.json")
    prof.set_defaults(func=_cmd_profile)
    pfit = sub.add_parser(
        "fit", help="fit a profile's pass model to the pass log of a serving run (PDSERVE_PASS_LOG=DIR while it ran)"
    )
    pfit.add_argument(
        "--pass-log", required=True, nargs="+", metavar="PATH", help="pass-log files, or folders of them (passes-*.csv)"
    )
    pfit.add_argument(
        "--profile", required=True, help="base profile: transfer, engine limits and model are taken from it"
    )
    pfit.add_argument("--name", default=None, help="name of the new profile (default: the base's + -pass-log)")
    pfit.add_argument("--output", required=True)
    pfit.set_defaults(func=_cmd_fit)
    sim = sub.add_parser("simulate", help="search prefill:decode ratios, colocated and sizes for a rate")
    sim.add_argument("--profile", required=True)
    sim.add_argument("--profile-prefill", default=None, help="profile of the prefill device")
    sim.add_argument("--profile-decode", default=None, help="profile of the decode device")
    sim.add_argument("--rate", type=float, required=True, help="offered rate (req/s)")
    _add_workload(sim)
    sim.add_argument(
        "--tail-slo",
        action="append",
        default=[],
        metavar="METRIC_STAT_MS=V",
        help="tail SLO, e.g. ttft_p90_ms=500, ttft_p99_ms=2000, tpot_p90_ms=50 (repeatable)",
    )
    sim.add_argument("--target", type=float, default=0.9, help="attainment the --slo SLOs need (0.9: p90)")
    sim.add_argument("--max-workers", type=int, default=64)
    sim.add_argument("--max-slice", type=int, default=5, help="largest p+q of the ratios p:q searched")
    sim.add_argument("--num-requests", type=int, default=300)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--output", default=None, metavar="FILE", help="JSON of every row, the front, the choice")
    sim.add_argument("--plot", default=None, metavar="PNG", help="goodput vs workers with the Pareto front")
    sim.set_defaults(func=_cmd_simulate)
    val = sub.add_parser("validate", help="replay a sweep's requests in the simulator; report the errors")
    val.add_argument("--profile", required=True)
    val.add_argument("--sweep", required=True, help="results.json of `pdserve sweep` (or results.json.gz)")
    val.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="do not model the prefill workers' prefix caches (no tokenizer needed)",
    )
    val.add_argument("--output", default=None, metavar="FILE")
    val.set_defaults(func=_cmd_validate)
    cal = sub.add_parser(
        "calibrate",
        help="measure the serving stack's overhead from a calibration sweep "
        "of a sim cluster; write the profile with it",
    )
    cal.add_argument("--profile", required=True)
    cal.add_argument("--sweep", required=True, help="results.json of a sim-engine `pdserve sweep` (or results.json.gz)")
    cal.add_argument("--output", required=True, metavar="FILE")
    cal.add_argument(
        "--wake-sigma",
        type=float,
        default=None,
        metavar="S",
        help="model a delay per pass that does not grow with the batch, lognormal with this "
        "log-space deviation (measured on a step log), and fit its mean to ITL p99 "
        "instead of the pass overhead's random factor",
    )
    cal.add_argument(
        "--jitter-sigma",
        type=float,
        default=0.0,
        metavar="S",
        help="with --wake-sigma: the pass overhead's random factor, held fixed (default 0)",
    )
    cal.set_defaults(func=_cmd_calibrate)


def comma_list(parse: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    """An argparse type: "a,b,c" -> [parse(a), parse(b), parse(c)]; an element that does not parse
    is an ArgumentTypeError naming the list and why."""

    def convert(text: str) -> list[T]:
        try:
            return [parse(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r} ({exc})") from None

    return convert


_rates = comma_list(parse_rate, "rates (each > 0, or inf)")
_int_list = comma_list(int, "integers")


def bench_config(args: argparse.Namespace, url: str) -> Any:
    from pdserve.capacity.bench import BenchConfig

    return BenchConfig(
        url=url,
        input_len=length_dist(args.input_len, args.input_hist, "128"),
        output_len=length_dist(args.output_len, args.output_hist, "64"),
        num_prompts=args.num_prompts,
        rate=getattr(args, "rate", math.inf),
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        warmup=args.warmup,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        slos=parse_slo(args.slo),
        model=args.model,
        timeout_s=args.timeout,
        speedup=args.speedup,
        engine=args.engine,
        profile=str(Path(args.profile).resolve()) if args.profile else None,
        token=getattr(args, "token", None) or os.environ.get("PDSERVE_AUTH_TOKEN") or None,
        tls_ca=getattr(args, "tls_ca", None),
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.capacity.bench import print_summary, run_bench

    require("rich", "pdserve bench")  # before the run, not after it

    try:
        # bench is a client of a running cluster: --speedup (the cluster's) scales its clock whatever
        # --engine says; --engine/--profile are only recorded with the results.
        if args.profile and not Path(args.profile).is_file():
            raise ValueError(f"--profile {args.profile}: no such file")
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
    from pdserve.capacity.sweep import run_sweep, select_configs

    require("rich", "pdserve sweep")  # before the runs, not after them
    require("matplotlib", "pdserve sweep's plots")

    try:
        worker_args = engine_worker_args(args)
        config = bench_config(args, "")
        configs = select_configs(args.workers, args.configs)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    doc = run_sweep(
        config,
        args.workers,
        args.rates,
        Path(args.output_dir),
        args.model,
        log=lambda s: print(s, file=sys.stderr, flush=True),
        worker_args=worker_args,
        configs=configs,
    )
    from pdserve.capacity.sweep import csv_row

    cols = ("config", "rate", "goodput", "slo_attainment_all", "ttft_p90_ms", "tpot_mean_ms", "itl_p99_ms")
    rows = [[_fmt(csv_row(p)[c]) for c in cols] for p in doc["points"]]
    print(format_table(cols, rows))
    print(f"best configuration: {doc['best_config']}")
    return 0


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.capacity.profiler import DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_TOKENS, run_profile

    try:
        profile = run_profile(
            args.model,
            args.threads,
            args.repeats,
            args.contention,
            progress=lambda s: print(s, file=sys.stderr),
            prefill_tokens=args.prefill_tokens or PREFILL_TOKENS,
            decode_batches=args.decode_batches or DECODE_BATCHES,
            decode_contexts=args.decode_contexts or DECODE_CONTEXTS,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    profile.save(args.output)
    doc = profile.to_json()
    print(json.dumps({k: doc[k] for k in ("name", "prefill", "decode", "transfer", "contention_workers")}, indent=1))
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    from pdserve.capacity.profiler import fit_pass_log
    from pdserve.engine.pass_log import read_pass_logs

    try:
        files: list[Path] = []
        for given in map(Path, args.pass_log):
            found = sorted(given.glob("passes-*.csv")) if given.is_dir() else [given]
            if not found or not found[0].is_file():
                raise ValueError(f"--pass-log {given}: no pass-log file there")
            files += found
        rows = read_pass_logs(files)
        profile = fit_pass_log(_load_profile(args.profile), rows, args.name)
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    profile.save(args.output)
    fitted = profile.points["pass_log"]
    print(
        f"fitted {fitted['passes']} passes from {len(files)} file(s): "
        + ", ".join(f"{t} {c:.6g}" for t, c in zip(fitted["terms"], fitted["coef"], strict=True))
        + f"; passes spread around the fit by a log-space deviation of {fitted['pass_sigma']:.3f} (pass_sigma)"
    )
    for kind, stats in fitted["by_kind"].items():
        if stats["passes"]:
            print(
                f"  {kind}: {stats['passes']} passes, mean {1000 * stats['mean_s']:.1f} ms, "
                f"mean |residual| {1000 * stats['mean_abs_residual_s']:.1f} ms"
            )
    return 0


def _load_profile(path: str | None) -> Any:
    from pdserve.engine.sim_profile import load_profile

    return load_profile(path) if path else None


def _cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.capacity.planner import Slos, Workload, format_rows, parse_tail_slo, plan, timing_for

    if args.plot:
        require("matplotlib", "pdserve plan simulate --plot")

    try:
        timing = timing_for(
            _load_profile(args.profile), _load_profile(args.profile_prefill), _load_profile(args.profile_decode)
        )
        workload = Workload(
            length_dist(args.input_len, args.input_hist, "128"),
            length_dist(args.output_len, args.output_hist, "64"),
            args.burstiness,
        )
        slos = Slos(parse_slo(args.slo), tuple(parse_tail_slo(args.tail_slo)), args.target)
        result = plan(timing, workload, args.rate, slos, args.max_workers, args.num_requests, args.seed, args.max_slice)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cols = ("slice", "slice goodput", "goodput/worker", f"deployment for {args.rate:g} req/s", "workers")
    print(format_table(cols, format_rows(result["rows"])))
    print(
        "pareto front (workers: deployment, goodput): "
        + ", ".join(f"{p['workers']}: {p['deployment']} {p['goodput']:.2f}" for p in result["pareto_front"])
    )
    for key in ("best_disaggregated", "best_colocated", "recommended"):
        if key in result:
            r = result[key]
            print(
                f"{key}: {r['deployment']} ({r['workers']} workers, sustains {r['sustains']:.2f} req/s, "
                f"{r['goodput_per_worker']:.3f} req/s per worker)"
            )
    if "verified" in result.get("recommended", {}):
        v = result["recommended"]["verified"]
        print(
            f"recommended, simulated whole at {args.rate:g} req/s: SLOs met {v['slos_met']}, TTFT p90 "
            f"{v['ttft_p90_ms']:.1f} ms, TTFT p99 {v['ttft_p99_ms']:.1f} ms, TPOT p90 {v['tpot_p90_ms']:.1f} ms"
        )
    if "recommended" not in result:
        print(f"no deployment up to {args.max_workers} workers sustains {args.rate:g} req/s")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    if args.plot:
        from pdserve.capacity.plots import plot_plan

        plot_plan(Path(args.plot), result)
    return 0


def read_sweep(path: str) -> Any:
    """A sweep's results.json, or a gzip of it (``.gz``: how large reports are committed)."""
    import gzip

    if path.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(Path(path).read_text())


def _cmd_validate(args: argparse.Namespace) -> int:
    from pdserve.capacity.planner import HEADLINE, VALIDATED, sweep_prompts, timing_for, validate

    try:
        timing = timing_for(_load_profile(args.profile))
        sweep = read_sweep(args.sweep)
        result = validate(timing, sweep, None if args.no_prefix_cache else sweep_prompts(sweep))
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    keys = [m if s is None else f"{m}_{s}" for m, s in VALIDATED]
    rows = []
    for p in result["points"]:
        cells = [f"{p[k]['measured']:.2f}/{p[k]['predicted']:.2f} ({100 * p[k]['rel_error']:+.0f}%)" for k in keys]
        rows.append([p["config"], _fmt(p["rate"]), *cells])
    print(format_table(("config", "rate", *[f"{k} meas/pred" for k in keys]), rows))
    print("mean |relative error|: " + ", ".join(f"{k} {100 * result['mean_abs_rel_error'][k]:.1f}%" for k in HEADLINE))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from pdserve.capacity.planner import calibrate_overhead, sweep_prompts

    try:
        sweep = read_sweep(args.sweep)
        if args.wake_sigma is not None and min(args.wake_sigma, args.jitter_sigma) < 0:
            raise ValueError("--wake-sigma and --jitter-sigma must be >= 0")
        profile = calibrate_overhead(
            _load_profile(args.profile),
            sweep,
            sweep_prompts(sweep),
            wake_sigma=args.wake_sigma,
            jitter_sigma=args.jitter_sigma,
        )
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    profile.save(args.output)
    print(json.dumps(profile.overhead.to_json()))
    return 0
