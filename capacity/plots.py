"""PNG plots of a sweep (matplotlib, Agg backend): goodput and SLO attainment vs rate per
configuration, and TTFT / ITL distributions (CDF per configuration, pooled over rates)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

PLOTS = ("goodput_vs_rate.png", "slo_attainment_vs_rate.png", "ttft_cdf.png", "itl_cdf.png")


def _by_config(points: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        groups[p["config"]].append(p)
    return groups


def write_plots(output_dir: Path, doc: dict[str, Any]) -> list[Path]:
    import matplotlib

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
        ax.plot([p["rate"] for p in pts], [p["summary"]["goodput"] or 0 for p in pts], marker="o", label=name)
    rates = sorted({p["rate"] for p in doc["points"]})
    ax.plot(rates, rates, ls=":", color="gray", label="offered rate")
    ax.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="Goodput vs rate")
    ax.legend()
    save(fig, PLOTS[0])

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in groups.items():
        rates = [p["rate"] for p in pts]
        ax.plot(rates, [100 * (p["summary"]["slo_attainment_all"] or 0) for p in pts], marker="o", label=f"{name} all")
        for metric in pts[0]["summary"]["slo_attainment"]:
            ax.plot(rates, [100 * p["summary"]["slo_attainment"][metric] for p in pts], ls="--", alpha=0.6,
                    label=f"{name} {metric}")
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
