"""`pdserve plan profile`: measure this machine with the engine in-process and fit a profile
(`engine.sim_profile`, the format the sim engine and the planner read).

* prefill: one packed forward pass over a prompt of N tokens, fitted as a + b*N + c*N^2 (attention);
* decode step: B sequences of context C each taking one token, fitted as a + b*B + c*B*C (the
  sequences share one block table: the compute is the same and the cache stays small);
* KV transfer: the gRPC backend over loopback (a ``KvTransferServicer`` in this process), fitted as
  a + b*bytes.

Each point is the median of ``repeats`` timed runs after one warm-up. ``contention`` N > 1 runs N - 1
helper processes beside the measurement, each keeping one core busy with float32 matrix products
on one torch thread (what a co-running worker's forward passes do to this one's cores and memory
bandwidth), so the profile describes a worker that shares the machine with N - 1 others. The
gRPC transfer fit stands for every backend (shm is measured by `benchmarks/kv_transfer_bench.py`).
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from pdserve.engine.sim_profile import DecodeCost, EngineLimits, LinkCost, PrefillCost, Profile
from pdserve.engine.timing import timed

PREFILL_TOKENS = (32, 128, 256, 512, 1024)
DECODE_BATCHES = (1, 4, 16)
DECODE_CONTEXTS = (128, 512, 1024)
TRANSFER_TOKENS = (16, 256, 1024, 2048)
# engine limits of the workers as `pdserve serve` starts them (decode_worker / prefill_worker defaults)
DECODE_KV_CACHE_MB = 512
MAX_BATCHED_TOKENS = 4096
MAX_NUM_SEQS = 64
BLOCK_SIZE = 16
PREFILL_CHUNK_TOKENS = 512  # prefill_worker --prefill-chunk-tokens default


def fit(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least-squares coefficients of y ~ rows (each row holds the regressors, a 1 first for a + ...)."""
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(y, dtype=float), rcond=None)
    return [float(c) for c in coef]


def device_description(threads: int) -> dict[str, Any]:
    import torch

    return {
        "device": "cpu",
        "processor": platform.processor() or platform.machine(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _profile_compute(
    loaded: Any,
    repeats: int,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    decode_batches: Sequence[int] = DECODE_BATCHES,
    decode_contexts: Sequence[int] = DECODE_CONTEXTS,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from pdserve.engine.kv_cache import KVCache
    from pdserve.engine.model_runner import ModelRunner, StepInput

    max_tokens = max(*prefill_tokens, *decode_contexts)
    kv = KVCache(loaded.kv_shape(BLOCK_SIZE), math.ceil(max_tokens / BLOCK_SIZE) + 1)
    runner = ModelRunner(loaded, kv)
    table = list(range(kv.num_blocks))
    token = int(loaded.tokenizer.eos_token_id or 1)

    def pass_time(items: list[StepInput]) -> float:
        return timed(lambda: runner.forward(items), repeats)

    prefill = [{"tokens": n, "latency_s": pass_time([StepInput([token] * n, 0, table)])} for n in prefill_tokens]
    decode = [
        {"batch": b, "context": c, "latency_s": pass_time([StepInput([token], c - 1, table)] * b)}
        for b in decode_batches
        for c in decode_contexts
    ]
    return prefill, decode


def _profile_transfer(loaded: Any, repeats: int) -> list[dict[str, float]]:
    import grpc
    import torch

    from pdserve.kv_transfer import KvSpec
    from pdserve.kv_transfer.base import ExpectOptions, dtype_name
    from pdserve.kv_transfer.grpc_backend import GrpcKvSender, KvTransferServicer, grpc_message_options

    shape = loaded.kv_shape(BLOCK_SIZE)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=grpc_message_options())
    receiver = KvTransferServicer()
    receiver.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sender = GrpcKvSender(f"127.0.0.1:{port}")
    points = []
    counter = iter(range(10**9))
    try:
        for tokens in TRANSFER_TOKENS:
            blocks = math.ceil(tokens / BLOCK_SIZE)
            dims = (shape.num_layers, 2, blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
            kv = torch.randn(dims).to(shape.dtype)

            def once(kv: torch.Tensor = kv, dims: tuple[int, ...] = dims, tokens: int = tokens) -> None:
                spec = KvSpec(
                    f"profile-{next(counter)}", loaded.fingerprint, dtype_name(shape.dtype), dims, BLOCK_SIZE, tokens
                )
                pending = receiver.expect(spec, ExpectOptions(60.0))
                sender.send(spec, kv, 1, 60.0)
                pending.wait(60.0)

            nbytes = kv.numel() * kv.element_size()
            points.append({"tokens": tokens, "bytes": nbytes, "latency_s": timed(once, repeats)})
    finally:
        sender.close()
        receiver.close()
        server.stop(None)
    return points


CONTENTION_SCRIPT = (
    "import sys, torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\nwhile True:\n    a = torch.tanh(a @ a)\n"
)


def start_contention(count: int) -> list[Any]:
    """`count` helper processes that each keep one core busy until killed."""
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", CONTENTION_SCRIPT]) for _ in range(count)]


def stop_contention(helpers: list[Any]) -> None:
    for helper in helpers:
        helper.kill()
        helper.wait()


def check_grid(name: str, values: Sequence[int], minimum: int, count: int) -> tuple[int, ...]:
    """A measurement grid: sorted distinct values >= minimum, at least `count` of them (for the fit)."""
    grid = tuple(sorted(set(values)))
    if len(grid) < count or grid[0] < minimum:
        raise ValueError(f"{name}: need at least {count} distinct values >= {minimum}, got {list(values)}")
    return grid


def run_profile(
    model: str | None = None,
    threads: int = 1,
    repeats: int = 3,
    contention: int = 1,
    progress: Callable[[str], object] = print,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    decode_batches: Sequence[int] = DECODE_BATCHES,
    decode_contexts: Sequence[int] = DECODE_CONTEXTS,
) -> Profile:
    """Measure and fit; return the profile (`contention`: workers sharing the machine, this one included).
    The grids say where the fits are measured: the prompt lengths, decode batch sizes and contexts a
    workload will see give a profile that is accurate there (a line through batches 1-16 misses
    the small batches of a light load)."""
    prefill_tokens = check_grid("prefill tokens", prefill_tokens, 1, 3)
    decode_batches = check_grid("decode batches", decode_batches, 1, 2)
    decode_contexts = check_grid("decode contexts", decode_contexts, 2, 1)
    import torch

    from pdserve.engine.model_fetch import resolve_model
    from pdserve.engine.model_loader import load_model

    if contention < 1:
        raise ValueError(f"contention must be >= 1, got {contention}")
    torch.set_num_threads(threads)
    started = time.perf_counter()
    loaded = load_model(resolve_model(model))
    helpers = start_contention(contention - 1)
    try:
        progress(f"profiling prefill and decode passes ({contention - 1} co-running helper(s))")
        prefill, decode = _profile_compute(loaded, repeats, prefill_tokens, decode_batches, decode_contexts)
        progress("profiling KV transfer over loopback gRPC")
        transfer = _profile_transfer(loaded, repeats)
    finally:
        stop_contention(helpers)
    shape = loaded.kv_shape(BLOCK_SIZE)
    t0, t1 = fit([[1, p["bytes"]] for p in transfer], [p["latency_s"] for p in transfer])
    link = LinkCost(max(0.0, t0), 1.0 / max(t1, 1e-15))
    return Profile(
        name=f"cpu-{loaded.path.name}-{threads}thread-contention{contention}".lower(),
        model_name=loaded.path.name,
        kv_bytes_per_token=shape.bytes_per_block / BLOCK_SIZE,
        max_model_len=loaded.max_model_len,
        description=f"{loaded.path.name} on this CPU, {threads} torch thread(s) per worker, measured by "
        f"`pdserve plan profile` with {contention} worker(s) sharing the machine",
        source="measured by pdserve plan profile",
        device=device_description(threads),
        prefill=PrefillCost(
            *_nonnegative(fit([[1, p["tokens"], p["tokens"] ** 2] for p in prefill], [p["latency_s"] for p in prefill]))
        ),
        decode=DecodeCost(
            *_nonnegative(
                fit([[1, p["batch"], p["batch"] * p["context"]] for p in decode], [p["latency_s"] for p in decode])
            )
        ),
        transfer={"grpc": link, "shm": link, "ray": link},
        engine=EngineLimits(
            block_size=BLOCK_SIZE,
            kv_capacity_tokens=int(DECODE_KV_CACHE_MB * 2**20 // shape.bytes_per_block) * BLOCK_SIZE,
            max_num_seqs=MAX_NUM_SEQS,
            max_batched_tokens=MAX_BATCHED_TOKENS,
            prefill_chunk_tokens=PREFILL_CHUNK_TOKENS,
        ),
        contention_workers=contention,
        points={
            "prefill": prefill,
            "decode": decode,
            "transfer": transfer,
            "profile_seconds": time.perf_counter() - started,
        },
    )


def _nonnegative(coef: list[float]) -> list[float]:
    """Least squares may give a tiny negative term on noisy points; a profile's terms are >= 0."""
    return [max(0.0, c) for c in coef]


# ----- fitting to a serving run's pass log ---------------------------------------------------------
#: Regressors of one pass in the joint fit: a constant, then the prefill and decode terms.
PASS_LOG_TERMS = ("constant", "prefill_tokens", "prefill_attention", "decode_batch", "decode_context")
MIN_PASS_LOG_LINES = 20


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |x c - y| over c >= 0 (Lawson-Hanson style: drop the most negative term, refit, until
    every term left is >= 0; columns that are all zero stay 0)."""
    active = [k for k in range(x.shape[1]) if np.any(x[:, k])]
    while True:
        coef = np.zeros(x.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [k for k in active if coef[k] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda k: coef[k]))


def fit_pass_log(base: Profile, rows: Sequence[Mapping[str, float]], name: str | None = None) -> Profile:
    """`base` with its pass model fitted to pass-log lines (`engine.pass_log`) of a serving run:
    seconds ~ a + b_p*prefill_tokens + c_p*prefill_attention + b_d*decode_batch + c_d*decode_context,
    one non-negative least-squares fit over every pass, mixed ones included. Both formulas get the
    one constant ``a``, so a mixed pass costs ``a`` once, as the pass model counts it. The pass log
    times the loop's whole pass (scheduling, sampling, applying tokens), so ``overhead`` is reset
    to zero but for ``pass_sigma``: the standard deviation of log(measured / fitted) over the
    passes, how far this machine's passes spread around the fit (the planner draws each pass's
    time from a lognormal factor of mean 1 with it). Transfer, engine limits and the model come
    from `base`. ValueError when there are fewer than MIN_PASS_LOG_LINES passes or no pass of a
    kind (prefill, decode)."""
    from dataclasses import replace

    from pdserve.engine.sim_profile import Overhead

    if len(rows) < MIN_PASS_LOG_LINES:
        raise ValueError(f"pass log: need at least {MIN_PASS_LOG_LINES} passes to fit, got {len(rows)}")
    if not any(r["prefill_tokens"] for r in rows) or not any(r["decode_batch"] for r in rows):
        raise ValueError(
            "pass log: need passes with prompt tokens and passes with decoding sequences "
            "(log a run that prefills and decodes: both roles, or colocated workers)"
        )
    x = np.array(
        [[1.0, r["prefill_tokens"], r["prefill_attention"], r["decode_batch"], r["decode_context"]] for r in rows]
    )
    y = np.array([r["seconds"] for r in rows])
    a, bp, cp, bd, cd = (float(c) for c in nonnegative_lstsq(x, y))
    fitted = x @ np.array([a, bp, cp, bd, cd])
    residual = y - fitted
    positive = (fitted > 0) & (y > 0)
    pass_sigma = float(np.std(np.log(y[positive] / fitted[positive]), ddof=1)) if positive.sum() > 1 else 0.0
    kinds = {
        "prefill only": [i for i, r in enumerate(rows) if r["prefill_tokens"] and not r["decode_batch"]],
        "decode only": [i for i, r in enumerate(rows) if r["decode_batch"] and not r["prefill_tokens"]],
        "mixed": [i for i, r in enumerate(rows) if r["decode_batch"] and r["prefill_tokens"]],
    }
    summary = {
        kind: {
            "passes": len(idx),
            "mean_s": float(np.mean(y[idx])) if idx else None,
            "mean_abs_residual_s": float(np.mean(np.abs(residual[idx]))) if idx else None,
        }
        for kind, idx in kinds.items()
    }
    return replace(
        base,
        name=name or f"{base.name}-pass-log",
        description=f"{base.description}; pass model fitted to {len(rows)} passes of a serving run's pass log "
        "(`pdserve plan fit`)",
        source=f"{base.source}; pass model: `pdserve plan fit` on a pass log",
        prefill=PrefillCost(a, bp, cp),
        decode=DecodeCost(a, bd, cd),
        overhead=Overhead(pass_sigma=pass_sigma),
        points={
            **base.points,
            "pass_log": {
                "passes": len(rows),
                "terms": list(PASS_LOG_TERMS),
                "coef": [a, bp, cp, bd, cd],
                "pass_sigma": pass_sigma,
                "by_kind": summary,
            },
        },
    )
