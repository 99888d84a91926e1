"""`pdserve bench`: an asyncio gRPC load generator against a running router.

Requests are token ids cut from the built-in corpus (tokenized here with the model's tokenizer, so
prompt lengths are exact) and sent at arrival times from ``arrivals``; at most ``max_concurrency``
are open at once (a request waiting for a slot is sent, and timed, when it gets one). Warm-up
requests run first, all at once, and are not recorded. Times are ``time.perf_counter`` on this
process; metrics follow ``metrics`` (vLLM definitions).

Against a sim cluster started with ``--speedup K`` (every modelled duration divided by K), the run
is scaled so that it reads in profile time: ``rate`` is in profile time (requests leave K times as
fast on the wall clock) and every recorded time (send time, TTFT, ITL, E2E, duration) is the wall
time multiplied by K. Wall-clock overhead of the serving stack is multiplied by K too
(docs/capacity.md measures it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import numpy as np

from pdserve.capacity.arrivals import arrival_times
from pdserve.capacity.metrics import LATENCY_METRICS, RequestRecord, summarize
from pdserve.capacity.workload import LengthDist, corpus_token_ids, cut_prompts
from pdserve.cluster.client import build_request, sampling_params
from pdserve.constants import REQUEST_TIMEOUT_S
from pdserve.extras import require
from pdserve.v1 import common_pb2, router_pb2_grpc

ProgressFn = Callable[[int], None]


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; ``slos`` in seconds keyed by ttft/tpot/e2e."""

    url: str
    input_len: LengthDist
    output_len: LengthDist
    num_prompts: int = 100
    rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0
    seed: int = 0
    ignore_eos: bool = False
    slos: dict[str, float] = field(default_factory=dict)
    model: str | None = None
    timeout_s: float = REQUEST_TIMEOUT_S
    speedup: float = 1.0  # the sim cluster's --speedup: rates and times are scaled to profile time
    engine: str = "model"  # recorded with the results: which engine served them
    profile: str | None = None  # recorded: the sim engine's profile file
    token: str | None = field(default=None, repr=False)  # bearer token of the router's public API (not recorded)
    tls_ca: str | None = None  # PEM the router's certificate is checked against: connect over TLS

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.rate > 0 or not self.burstiness > 0:
            raise ValueError("rate and burstiness must be > 0")
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["input_len"] = self.input_len.to_json()
        doc["output_len"] = self.output_len.to_json()
        doc["rate"] = "inf" if math.isinf(self.rate) else self.rate
        doc["slos_ms"] = {k: v * 1000 for k, v in self.slos.items()}
        del doc["slos"]
        del doc["token"]
        return doc


@dataclass(frozen=True)
class PlannedRequest:
    prompt_ids: list[int]
    output_len: int
    send_offset: float


def plan_requests(config: BenchConfig, corpus_ids: Sequence[int], count: int, seed: int) -> list[PlannedRequest]:
    """Prompts, output lengths and send offsets for ``count`` requests (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    prompts = cut_prompts(corpus_ids, config.input_len.sample(rng, count), rng)
    outputs = config.output_len.sample(rng, count)
    offsets = arrival_times(count, config.rate, config.burstiness, seed + 1)
    return [PlannedRequest(p, o, t) for p, o, t in zip(prompts, outputs, offsets, strict=True)]


def load_corpus_ids(model: str | None) -> list[int]:
    """Corpus token ids with the tokenizer of ``model`` (None: the default model)."""
    from transformers import AutoTokenizer

    from pdserve.engine.model_fetch import resolve_model

    return corpus_token_ids(AutoTokenizer.from_pretrained(resolve_model(model)))


async def _one(
    stub: router_pb2_grpc.RouterStub, planned: PlannedRequest, index: int, config: BenchConfig, t0: float
) -> RequestRecord:
    params = sampling_params(max_tokens=planned.output_len, ignore_eos=config.ignore_eos, temperature=0.0)
    request = build_request(token_ids=planned.prompt_ids, params=params, request_id=f"bench-{index}-{config.seed}")
    start = time.perf_counter()
    record = RequestRecord(index=index, send_time=start - t0, prompt_tokens=len(planned.prompt_ids))
    last = start
    try:
        metadata = (("authorization", f"Bearer {config.token}"),) if config.token else None
        call = stub.Generate(request, timeout=config.timeout_s, metadata=metadata)
        async for response in call:
            now = time.perf_counter()
            if response.token_ids:
                if record.ttft is None:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last)
                last = now
                record.output_tokens += len(response.token_ids)
            if response.finish_reason == common_pb2.FINISH_REASON_ERROR:
                record.error = response.error or "FINISH_REASON_ERROR"
        record.e2e = time.perf_counter() - start
        if record.ttft is None and not record.error:
            record.error = "stream ended without a token"
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    return record


def _channel(config: BenchConfig) -> grpc.aio.Channel:
    if config.tls_ca is None:
        return grpc.aio.insecure_channel(config.url)
    with open(config.tls_ca, "rb") as f:
        return grpc.aio.secure_channel(config.url, grpc.ssl_channel_credentials(f.read()))


async def run_bench_async(
    config: BenchConfig, corpus_ids: Sequence[int], on_done: ProgressFn | None = None
) -> dict[str, Any]:
    """Run the warm-up and the measured requests; return {config, summary, records}."""
    measured = plan_requests(config, corpus_ids, config.num_prompts, config.seed)
    warm = plan_requests(config, corpus_ids, config.warmup, config.seed + 1000) if config.warmup else []
    return await run_planned_async(config, measured, warm, on_done)


async def run_planned_async(
    config: BenchConfig,
    measured: Sequence[PlannedRequest],
    warm: Sequence[PlannedRequest] = (),
    on_done: ProgressFn | None = None,
) -> dict[str, Any]:
    """Send planned requests (a trace made elsewhere, e.g. a workload that shifts) with ``config``'s
    connection, concurrency limit, SLOs and speedup (its lengths, rate and counts are not used);
    return {config, summary, records}, records in profile time."""
    limit = config.max_concurrency or len(measured) + len(warm)
    semaphore = asyncio.Semaphore(limit)
    async with _channel(config) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def guarded(planned: PlannedRequest, index: int, t0: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + planned.send_offset / config.speedup - time.perf_counter()))
            async with semaphore:
                record = await _one(stub, planned, index, config, t0)
            if on_done is not None and index >= 0:
                on_done(1)
            return record

        if warm:
            t_warm = time.perf_counter()
            await asyncio.gather(
                *(guarded(PlannedRequest(p.prompt_ids, p.output_len, 0.0), -1 - i, t_warm) for i, p in enumerate(warm))
            )
        t0 = time.perf_counter()
        records = await asyncio.gather(*(guarded(p, i, t0) for i, p in enumerate(measured)))
        duration = (time.perf_counter() - t0) * config.speedup
    records = [to_profile_time(r, config.speedup) for r in records]
    return {
        "config": config.to_json(),
        "summary": summarize(records, duration, config.slos),
        "records": [r.to_json() for r in records],
    }


def to_profile_time(record: RequestRecord, speedup: float) -> RequestRecord:
    """A record measured on the wall clock of a cluster running ``speedup`` times faster, in profile time."""
    if speedup == 1.0:
        return record

    def scaled(value: float | None) -> float | None:
        return None if value is None else value * speedup

    return dataclasses.replace(
        record,
        send_time=record.send_time * speedup,
        ttft=scaled(record.ttft),
        itl=[gap * speedup for gap in record.itl],
        e2e=scaled(record.e2e),
    )


def run_bench(config: BenchConfig, corpus_ids: Sequence[int] | None = None, progress: bool = True) -> dict[str, Any]:
    """Blocking wrapper: tokenizes the corpus if needed, shows a rich progress bar when asked."""
    ids = list(corpus_ids) if corpus_ids is not None else load_corpus_ids(config.model)
    if not progress:
        return asyncio.run(run_bench_async(config, ids))
    require("rich", "pdserve bench's progress bar (--no-progress runs without it)")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("requests", total=config.num_prompts)
        return asyncio.run(run_bench_async(config, ids, lambda n: bar.advance(task, n)))


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, value) rows of the end-of-run table."""
    rows = [
        ("completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.3f}"),
        ("output token throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
        ("total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}"),
    ]
    if summary.get("goodput") is not None:
        rows.append(("goodput (req/s)", f"{summary['goodput']:.3f}"))
        for metric, fraction in summary["slo_attainment"].items():
            rows.append((f"SLO attainment {metric}", f"{100 * fraction:.1f}%"))
        rows.append(("SLO attainment all", f"{100 * summary['slo_attainment_all']:.1f}%"))
    for name in LATENCY_METRICS:
        s = summary[f"{name}_ms"]
        rows.append(
            (
                f"{name.upper()} ms mean/median/p90/p99",
                "  ".join(f"{s[k]:.1f}" for k in ("mean", "median", "p90", "p99")),
            )
        )
    return rows


def print_summary(summary: dict[str, Any]) -> None:
    require("rich", "pdserve bench's result table")
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pdserve bench")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in summary_rows(summary):
        table.add_row(name, value)
    Console().print(table)
