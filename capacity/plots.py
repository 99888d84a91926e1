"""PNG plots (matplotlib, Agg backend). A sweep: goodput (with its bootstrap 95% interval as error
bars) and SLO attainment vs rate per configuration, and TTFT / ITL distributions (CDF per
configuration, pooled over rates). A plan: sustained goodput vs workers per slice family, with
the Pareto front and the offered rate."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from pdserve.extras import require

PLOTS = ("goodput_vs_rate.png", "slo_attainment_vs_rate.png", "ttft_cdf.png", "itl_cdf.png")


def _by_config(points: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        groups[p["config"]].append(p)
    return groups


def write_plots(output_dir: Path, doc: dict[str, Any]) -> list[Path]:
    matplotlib = require("matplotlib", "pdserve sweep's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = _by_config(doc["points"])
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(output_dir / name, dpi=100)
        plt.close(fig)
        written.append(output_dir / name)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in groups.items():
        goodput = [p["summary"]["goodput"] or 0 for p in pts]
        cis = [p["summary"].get("goodput_ci95") or [g, g] for p, g in zip(pts, goodput, strict=True)]
        err = [
            [max(0.0, g - lo) for g, (lo, _) in zip(goodput, cis, strict=True)],
            [max(0.0, hi - g) for g, (_, hi) in zip(goodput, cis, strict=True)],
        ]
        ax.errorbar([p["rate"] for p in pts], goodput, yerr=err, marker="o", capsize=3, label=name)
    rates = sorted({p["rate"] for p in doc["points"]})
    ax.plot(rates, rates, ls=":", color="gray", label="offered rate")
    ax.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="Goodput vs rate (95% bootstrap CI)")
    ax.legend()
    save(fig, PLOTS[0])

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in groups.items():
        rates = [p["rate"] for p in pts]
        ax.plot(rates, [100 * (p["summary"]["slo_attainment_all"] or 0) for p in pts], marker="o", label=f"{name} all")
        for metric in pts[0]["summary"]["slo_attainment"]:
            ax.plot(
                rates,
                [100 * p["summary"]["slo_attainment"][metric] for p in pts],
                ls="--",
                alpha=0.6,
                label=f"{name} {metric}",
            )
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", title="SLO attainment vs rate", ylim=(0, 105))
    ax.legend(fontsize=7)
    save(fig, PLOTS[1])

    for metric, filename in (("ttft", PLOTS[2]), ("itl", PLOTS[3])):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, pts in groups.items():
            values: list[float] = []
            for p in pts:
                for r in p["records"]:
                    if r["error"]:
                        continue
                    values.extend(r["itl"] if metric == "itl" else [r["ttft"]])
            if values:
                xs = np.sort(np.asarray(values) * 1000)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
        ax.set(xlabel=f"{metric.upper()} (ms)", ylabel="fraction of samples", title=f"{metric.upper()} CDF (all rates)")
        ax.set_xscale("log")
        ax.legend()
        save(fig, filename)
    return written


def plot_plan(path: Path, result: dict[str, Any]) -> Path:
    """Sustained goodput vs workers for every slice family, the Pareto front and the offered rate."""
    matplotlib = require("matplotlib", "pdserve plan's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    max_workers = int(result["max_workers"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in result["rows"]:
        size, rate = row["slice_workers"], row["slice_goodput"]
        if rate <= 0:
            continue
        sizes = list(range(size, max_workers + 1, size))
        style = {"ls": "--", "color": "black"} if row["slice"].startswith("colocated") else {"alpha": 0.5}
        ax.plot(sizes, [rate * n / size for n in sizes], lw=1, label=row["slice"], **style)
    front = result["pareto_front"]
    ax.plot(
        [p["workers"] for p in front],
        [p["goodput"] for p in front],
        "o-",
        color="red",
        lw=2,
        ms=4,
        label="Pareto front",
        drawstyle="steps-post",
    )
    ax.axhline(result["rate"], color="gray", ls=":", label=f"offered {result['rate']:g} req/s")
    ax.set(xlabel="workers", ylabel="goodput at the SLOs (req/s)", title="Sustained goodput vs deployment size")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
