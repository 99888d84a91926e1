"""Benchmark metrics with the definitions of vLLM's `vllm bench serve` (pure functions, no I/O).

Per request (only completed ones count):

* TTFT: request sent -> first token-bearing chunk.
* ITL: every gap between consecutive token-bearing chunks (pooled over all requests).
* TPOT: (e2e - ttft) / (output_tokens - 1); undefined (excluded) when output_tokens <= 1.
* E2E: request sent -> last chunk.

Run level: request throughput = completed / duration; output token throughput = output tokens /
duration; total token throughput = (input + output tokens) / duration; goodput = completed requests
meeting every SLO / duration (a request without a TPOT meets a TPOT SLO, as in vLLM); SLO attainment
per metric = fraction of completed requests meeting it. Statistics are reported in milliseconds:
mean, median, std (population), p90, p99 (numpy linear percentiles); all 0 when there is no value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2e")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (90, 99)


@dataclass
class RequestRecord:
    """What the load generator saw of one request; times in seconds, send_time from run start."""

    index: int
    send_time: float
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error and self.ttft is not None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        assert self.e2e is not None and self.ttft is not None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "tpot": self.tpot}

    @classmethod
    def from_json(cls, doc: Mapping[str, object]) -> RequestRecord:
        keys = ("index", "send_time", "prompt_tokens", "output_tokens", "ttft", "itl", "e2e", "error")
        return cls(**{k: doc[k] for k in keys if k in doc})  # type: ignore[arg-type]


def parse_slo(items: Iterable[str]) -> dict[str, float]:
    """``["ttft_ms=500", "tpot_ms=50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        metric = name.strip().removesuffix("_ms")
        if not sep or metric not in SLO_METRICS or not name.strip().endswith("_ms"):
            raise ValueError(f"SLO must look like ttft_ms=500, tpot_ms=50 or e2e_ms=2000, got {item!r}")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"SLO {name} must be > 0 ms, got {value}")
        slos[metric] = ms / 1000.0
    return slos


def stats_ms(values_s: Sequence[float], percentiles: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """mean, median, std, p<k> of values given in seconds, in milliseconds (zeros when empty)."""
    names = ["mean", "median", "std"] + [f"p{p}" for p in percentiles]
    if not values_s:
        return dict.fromkeys(names, 0.0)
    arr = np.asarray(values_s, dtype=float) * 1000.0
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in percentiles})
    return out


def meets(record: RequestRecord, metric: str, limit_s: float) -> bool:
    """Whether a completed request meets one SLO (no TPOT, i.e. <= 1 output token, meets it)."""
    value = record.tpot if metric == "tpot" else getattr(record, metric)
    if value is None:
        return metric == "tpot"
    return bool(value <= limit_s)


def meets_all(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    return record.success and all(meets(record, m, v) for m, v in slos.items())


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slos: Mapping[str, float] | None = None
) -> dict[str, object]:
    """The run summary: counts, throughputs, goodput, SLO attainment and latency statistics (ms)."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slos = dict(slos or {})
    done = [r for r in records if r.success]
    good = [r for r in done if meets_all(r, slos)]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, object] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "goodput": len(good) / duration_s if slos else None,
        "slo_attainment": {m: _fraction(done, m, v) for m, v in slos.items()},
        "slo_attainment_all": len(good) / len(done) if done and slos else None,
    }
    series = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2e": [r.e2e for r in done if r.e2e is not None],
    }
    for name in LATENCY_METRICS:
        summary[f"{name}_ms"] = stats_ms(series[name])
    return summary


def _fraction(done: Sequence[RequestRecord], metric: str, limit_s: float) -> float:
    return sum(meets(r, metric, limit_s) for r in done) / len(done) if done else 0.0


def bootstrap_goodput(
    records: Sequence[RequestRecord], duration_s: float, slos: Mapping[str, float], resamples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of goodput (requests resampled with replacement; the
    duration is held fixed)."""
    good = np.array([meets_all(r, slos) for r in records], dtype=float)
    if not len(good):
        return (0.0, 0.0)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(good), size=(resamples, len(good)))
    rates = good[draws].sum(axis=1) / duration_s
    return (float(np.percentile(rates, 2.5)), float(np.percentile(rates, 97.5)))
