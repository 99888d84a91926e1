"""`pdserve sweep`: every xPyD split of a worker budget and colocated with as many workers, at each rate.

For each configuration a ``LocalCluster`` is started (threads_per_worker = max(1, cores // workers)),
the bench runs in-process at each rate (fresh seed per rate, same workload), and the cluster is
stopped. Outputs in ``output_dir``: ``results.csv`` (one row per configuration and rate),
``results.json`` (bench settings and every point with its summary and per-request records) and the
plots of ``plots``. The best configuration is the one with the highest goodput over the rates.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdserve.capacity.bench import BenchConfig, load_corpus_ids, run_bench
from pdserve.capacity.metrics import RequestRecord, bootstrap_goodput

CSV_COLUMNS = (
    "config",
    "prefill",
    "decode",
    "colocated",
    "rate",
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "goodput",
    "slo_attainment_all",
    "ttft_mean_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_mean_ms",
    "tpot_p90_ms",
    "itl_median_ms",
    "itl_p99_ms",
    "e2e_mean_ms",
    "goodput_ci95_low",
    "goodput_ci95_high",
)


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    name: str
    prefill: int
    decode: int
    colocated: int

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated


def sweep_configs(budget: int) -> list[SweepConfig]:
    """Every xPyD with x + y = budget (x, y >= 1), then colocated x budget."""
    if budget < 1:
        raise ValueError(f"worker budget must be >= 1, got {budget}")
    configs = [SweepConfig(f"{x}P{budget - x}D", x, budget - x, 0) for x in range(1, budget)]
    return configs + [SweepConfig(f"colocated x{budget}", 0, 0, budget)]


def select_configs(budget: int, names: str | None) -> list[SweepConfig]:
    """The configurations of `budget` named in the comma-separated `names` (all when None)."""
    configs = sweep_configs(budget)
    if not names:
        return configs
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {c.name: c for c in configs}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown} for {budget} workers; known: {list(known)}")
    return [known[n] for n in wanted]


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """Torch threads per worker: the CPUs split evenly, at least 1."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


def csv_row(point: dict[str, Any]) -> dict[str, Any]:
    s = point["summary"]
    return {
        "config": point["config"],
        "prefill": point["prefill"],
        "decode": point["decode"],
        "colocated": point["colocated"],
        "rate": point["rate"],
        "completed": s["completed"],
        "failed": s["failed"],
        "request_throughput": s["request_throughput"],
        "output_throughput": s["output_throughput"],
        "goodput": s["goodput"],
        "slo_attainment_all": s["slo_attainment_all"],
        "ttft_mean_ms": s["ttft_ms"]["mean"],
        "ttft_p90_ms": s["ttft_ms"]["p90"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_mean_ms": s["tpot_ms"]["mean"],
        "tpot_p90_ms": s["tpot_ms"]["p90"],
        "itl_median_ms": s["itl_ms"]["median"],
        "itl_p99_ms": s["itl_ms"]["p99"],
        "e2e_mean_ms": s["e2e_ms"]["mean"],
        "goodput_ci95_low": s.get("goodput_ci95", [None, None])[0],
        "goodput_ci95_high": s.get("goodput_ci95", [None, None])[1],
    }


def best_config(points: Sequence[dict[str, Any]]) -> str:
    """The configuration with the highest goodput at any rate (ties: the first)."""
    best: dict[str, float] = {}
    for p in points:
        best[p["config"]] = max(best.get(p["config"], 0.0), float(p["summary"]["goodput"] or 0.0))
    return max(best, key=lambda name: best[name])


def add_goodput_cis(doc: dict[str, Any]) -> None:
    """Give every point's summary a bootstrap 95% interval of its goodput (``goodput_ci95``)."""
    slos = {k: v / 1000 for k, v in doc["bench"]["slos_ms"].items()}
    for point in doc["points"]:
        summary = point["summary"]
        if "goodput_ci95" not in summary and summary["goodput"] is not None:
            records = [RequestRecord.from_json(r) for r in point["records"]]
            summary["goodput_ci95"] = list(bootstrap_goodput(records, summary["duration_s"], slos))


def write_outputs(output_dir: Path, doc: dict[str, Any]) -> None:
    """results.json, results.csv and the plots (goodput intervals are added first when missing)."""
    from pdserve.capacity.plots import write_plots

    add_goodput_cis(doc)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(doc, indent=1))
    with open(output_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for point in doc["points"]:
            writer.writerow(csv_row(point))
    write_plots(output_dir, doc)


def run_sweep(
    bench: BenchConfig,
    budget: int,
    rates: Sequence[float],
    output_dir: Path,
    model: str | None = None,
    log: Callable[[str], object] = print,
    worker_args: tuple[str, ...] = (),
    configs: Sequence[SweepConfig] | None = None,
) -> dict[str, Any]:
    """Run every configuration (or `configs`) at every rate; write and return the results document.
    `worker_args` go to every worker (the sim engine's flags: then one thread per worker)."""
    from pdserve.cluster.launch import LaunchOptions, local_deployment
    from pdserve.cluster.local import LocalCluster

    corpus_ids = load_corpus_ids(model)
    threads = 1 if bench.engine == "sim" else threads_per_worker(budget)
    points: list[dict[str, Any]] = []
    for config in configs or sweep_configs(budget):
        cluster_config = local_deployment(
            model=model,
            prefill=config.prefill,
            decode=config.decode,
            colocated=config.colocated,
            threads_per_worker=threads,
            startup_timeout_s=600.0,
        )
        options = LaunchOptions(prefill_args=worker_args, decode_args=worker_args)
        log(f"sweep: starting {config.name} ({threads} thread(s) per worker)")
        with LocalCluster(cluster_config, options) as cluster:
            for i, rate in enumerate(rates):
                run = dataclasses.replace(bench, url=cluster.router_address, rate=rate, model=model)
                result = run_bench(run, corpus_ids, progress=True)
                summary = result["summary"]
                log(
                    f"sweep: {config.name} rate {rate}: goodput {summary['goodput']} req/s, "
                    f"ttft p90 {summary['ttft_ms']['p90']:.0f} ms, itl p99 {summary['itl_ms']['p99']:.0f} ms"
                )
                points.append(
                    {
                        **dataclasses.asdict(config),
                        "config": config.name,
                        "rate": rate,
                        "rate_index": i,
                        "summary": summary,
                        "records": result["records"],
                    }
                )
    bench_doc = dataclasses.replace(bench, url="", model=model).to_json()
    bench_doc["workers"] = budget
    bench_doc["rate"] = None
    doc = {
        "bench": bench_doc,
        "workers": budget,
        "threads_per_worker": threads,
        "rates": [r if not math.isinf(r) else "inf" for r in rates],
        "points": points,
        "best_config": best_config(points),
    }
    write_outputs(output_dir, doc)
    return doc
