"""Disaggregation on one GPU (`bash benchmarks/gpu_disagg_check.sh`, under 8 minutes on one H200);
`--device cpu` is the same script on tiny shapes, run by the test suite (tests/test_gpu_disagg_check.py)
so that it cannot rot between device runs. Set-up, shapes and helpers are the device check's
(benchmarks/gpu_check.py, benchmarks/device_env.sh): random weights, seeded, on real configs; only the
default model's tokenizer travels. Every figure is a ratio against a baseline of the same run.

  kv       K/V hand-off of `--kv-tokens` tokens (2,048) of the Llama-3.1-8B shape (bf16), every other
           block of a pool: cuda_ipc (a second process sends a control frame; this one maps its pool,
           copies device to device into its own pool and acks) and pinned-host staging (gather to
           pinned host, scatter back), each against a plain device-to-device copy of the same bytes.
           Goal: cuda_ipc >= 0.5 of that copy. Off CUDA the sender falls back to shm (logged).
  serving  1P1D (two worker processes on one GPU, KV by `--kv-backend auto`, so cuda_ipc) against one
           colocated worker, on the Llama-3.2-1B shape (the default tokenizer's vocabulary): an
           interference workload (short requests decoding while long prompts arrive) and the short
           requests alone. TTFT and ITL p50/p90 of the short requests, goodput (requests per second
           that met --slo-ttft-ms and --slo-tpot-ms). Goals: 1P1D ITL p90 <= 0.5x colocated under
           interference; 1P1D TTFT p50 <= 1.1x colocated on short prompts alone.
  kill     kill -9 of the prefill worker that holds a request mid-hand-off (2 prefill workers, 1 decode
           worker): the request fails over with the tokens of an undisturbed run, well before any
           timeout, and the decode worker's blocks are all free afterwards.

  python benchmarks/gpu_disagg_check.py --out DIR                 # on the device (gpu_disagg_check.sh)
  python benchmarks/gpu_disagg_check.py --device cpu --out DIR    # the dry run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import SHAPES, TINY, Row, build, load_tokenizer, run_steps, timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("kv", "serving", "kill")


# ----- kv ------------------------------------------------------------------------------------------
def kv_shape(args: argparse.Namespace) -> Any:  # noqa: ANN401 - a KVCacheShape
    from pdserve.engine.kv_cache import KVCacheShape

    dims = TINY["tiny-llama"] if args.tiny else SHAPES["llama-8b"]
    return KVCacheShape(
        num_layers=dims["num_hidden_layers"],
        num_kv_heads=dims["num_key_value_heads"],
        head_dim=dims["head_dim"],
        block_size=16,
        dtype=args.torch_dtype,
    )


def seeded_pool(args: argparse.Namespace, seed: int) -> Any:  # noqa: ANN401 - a KVCache
    from pdserve.engine.kv_cache import KVCache

    blocks = -(-args.kv_tokens // 16)
    cache = KVCache(kv_shape(args), 2 * blocks, args.device, shared=True)  # shared: the CPU run's shm fallback
    generator = torch.Generator(args.device).manual_seed(seed)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=generator, device=args.device))
    return cache


def block_ids(args: argparse.Namespace) -> list[int]:
    return list(range(0, 2 * -(-args.kv_tokens // 16), 2))  # every other block: a real gather, not one slice


def sig(value: float) -> float:
    """Three significant figures (a dry run's tiny payloads read as 0.0 when rounded to decimals)."""
    return float(f"{value:.3g}")


def device_copy_time(payload: torch.Tensor, device: str) -> float:
    """A plain device-to-device copy of `payload`'s bytes (the baseline)."""
    out = torch.empty_like(payload)
    return timed(lambda: out.copy_(payload), device, repeats=10)


def kv_sender(args: argparse.Namespace) -> int:
    """The second process of the kv step: a prefill worker's pool, sent `--repeats` times."""
    from pdserve.engine.kv_cache import segment_prefix
    from pdserve.kv_transfer import KvSpec
    from pdserve.kv_transfer.cuda_ipc_backend import CudaIpcKvSender

    cache = seeded_pool(args, seed=1)
    print(f"PREFIX {segment_prefix()}", flush=True)
    sys.stdin.readline()  # the receiver registered its intakes
    sender = CudaIpcKvSender(args.address)
    times = []
    for i in range(args.repeats + 1):
        spec = KvSpec.for_cache(f"kv-{i}", "fp", cache.shape, args.kv_tokens)
        start = time.perf_counter()
        sender.send_blocks(spec, cache, block_ids(args), i, timeout_s=60)
        times.append(time.perf_counter() - start)
    print("TIMES " + json.dumps(times), flush=True)
    return 0


def step_kv(args: argparse.Namespace) -> list[Row]:
    from pdserve.engine.kv_cache import KVCache
    from pdserve.kv_transfer import ExpectOptions, KvSpec, KvTransferServicer, grpc_message_options
    from pdserve.worker.runtime import make_server

    ids = block_ids(args)
    src = seeded_pool(args, seed=1)
    dst = KVCache(src.shape, src.num_blocks, args.device)
    nbytes = len(ids) * src.shape.bytes_per_block
    d2d = device_copy_time(src.kv[:, :, : len(ids)].contiguous(), args.device)
    staged = timed(lambda: dst.scatter(ids, src.gather(ids)), args.device, repeats=5)

    class Receiver(KvTransferServicer):
        kinds: list[str] = []

        def PushKv(self, request_iterator, context):  # noqa: ANN001, ANN202, N802 - records the path taken
            frames = list(request_iterator)
            self.kinds.append(
                "cuda_ipc" if frames[0].header.cuda_ipc_descriptor else "shm" if frames[0].header.shm_name else "grpc"
            )
            return super().PushKv(iter(frames), context)

    receiver = Receiver()
    server = make_server(8, grpc_message_options())
    receiver.add_to_server(server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "kv-sender",
            "--address",
            address,
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--kv-tokens",
            str(args.kv_tokens),
            "--repeats",
            str(args.repeats),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None  # both PIPE
    try:
        prefix = child.stdout.readline().split()[1]
        options = ExpectOptions(120, in_place=True, shm_segment_prefix=prefix)
        pendings = [
            receiver.expect(KvSpec.for_cache(f"kv-{i}", "fp", src.shape, args.kv_tokens), options)
            for i in range(args.repeats + 1)
        ]
        child.stdin.write("go\n")
        child.stdin.flush()
        copies: list[float] = []
        for pending in pendings:
            kv, _ = pending.wait(120)
            assert not isinstance(kv, torch.Tensor), "an in_place intake on one host completes in place"
            dst.kv.zero_()
            start = time.perf_counter()
            kv(dst.kv, ids)  # device to device (cuda_ipc) or from shared memory (the fallback); then synced
            copies.append(time.perf_counter() - start)
        line = child.stdout.readline()
        sends = json.loads(line.removeprefix("TIMES "))
        child.wait(60)
    finally:
        child.kill()
        receiver.close()
        server.stop(0)
    same = torch.equal(dst.kv[:, :, ids], src.kv[:, :, ids])
    kind = receiver.kinds[-1]
    handoff, copy = statistics.median(sends[1:]), statistics.median(copies[1:])  # the first one maps the pool
    goal = kind != "cuda_ipc" or d2d / handoff >= 0.5
    return [
        {"step": "kv", "what": f"{args.kv_tokens}-token K/V bytes ({args.dtype})", "value": nbytes, "ok": True},
        {"step": "kv", "what": "device-to-device copy GB/s", "value": sig(nbytes / d2d / 1e9), "ok": True},
        {"step": "kv", "what": "pinned-host staging GB/s", "value": sig(nbytes / staged / 1e9), "ok": True},
        {"step": "kv", "what": "pinned-host staging / d2d copy", "value": sig(d2d / staged), "ok": True},
        {"step": "kv", "what": "hand-off path taken", "value": kind, "ok": kind == "cuda_ipc" or args.tiny},
        {
            "step": "kv",
            "what": f"{kind} hand-off (frame, copy, ack) GB/s",
            "value": sig(nbytes / handoff / 1e9),
            "ok": True,
        },
        {"step": "kv", "what": f"{kind} hand-off / d2d copy (goal >= 0.5)", "value": sig(d2d / handoff), "ok": goal},
        {"step": "kv", "what": f"{kind} copy alone / d2d copy", "value": sig(d2d / copy), "ok": True},
        {
            "step": "kv",
            "what": f"{kind} first hand-off (maps the pool) ms",
            "value": round(sends[0] * 1e3, 2),
            "ok": True,
        },
        {"step": "kv", "what": "blocks arrived bit-exact", "value": same, "ok": same},
    ]


# ----- serving -------------------------------------------------------------------------------------
def save_model(args: argparse.Namespace) -> str:
    """The serving shape with random weights as a model folder (worker processes load it), made once."""
    if args.model_dir:
        return args.model_dir
    name = "tiny-llama" if args.tiny else "llama-1b"
    dims = dict((TINY if args.tiny else SHAPES)[name], vocab_size=len(args.tok))  # ids the tokenizer can show
    loaded = build(name, dims, args.torch_dtype, args.device, args.tok, seed=5)
    folder = Path(tempfile.mkdtemp(prefix="pdserve-disagg-model-"))
    loaded.model.save_pretrained(folder)
    args.tok.save_pretrained(folder)
    del loaded
    args.model_dir = str(folder)
    return args.model_dir


def run_request(client: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:  # noqa: ANN401
    from pdserve.cluster.client import build_request, sampling_params

    request = build_request(token_ids=prompt, params=sampling_params(max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    stamps, ids = [], []
    for response in client.generate(request):
        if response.token_ids:
            stamps.append(time.perf_counter())
            ids += list(response.token_ids)
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft": stamps[0] - start if stamps else math.inf, "gaps": gaps, "ids": ids, "e2e": end - start}


def prompts(count: int, length: int, salt: int) -> list[list[int]]:
    return [[100 + (salt * 997 + i * 31 + j * 7) % 20000 for j in range(length)] for i in range(count)]


def workload(address: str, args: argparse.Namespace, with_long: bool) -> dict[str, Any]:
    """Short requests decoding; with_long: long prompts arrive every --long-gap-s meanwhile."""
    from pdserve.cluster.client import PdserveClient

    short, long_ = prompts(args.short, args.short_len, 1), prompts(args.long if with_long else 0, args.long_len, 2)
    with PdserveClient(address, timeout_s=300) as client, ThreadPoolExecutor(args.short + len(long_)) as pool:
        run_request(client, short[0][:16], 2)  # warm-up
        start = time.perf_counter()
        futures = [pool.submit(run_request, client, p, args.short_tokens) for p in short]
        time.sleep(args.long_gap_s)  # the short ones are decoding
        long_futures = []
        for p in long_:
            long_futures.append(pool.submit(run_request, client, p, 4))
            time.sleep(args.long_gap_s)
        results = [f.result() for f in futures]
        long_results = [f.result() for f in long_futures]
        wall = time.perf_counter() - start
    if any(len(r["ids"]) != args.short_tokens for r in results):
        raise RuntimeError(f"a short request ended early: {[len(r['ids']) for r in results]}")
    return {"short": results, "long": long_results, "wall": wall}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))] * 1e3


def figures(run: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    short = run["short"]
    gaps = [g for r in short for g in r["gaps"]]
    everyone = short + run["long"]

    def met(r: dict[str, Any]) -> bool:
        tpot = (r["e2e"] - r["ttft"]) / max(1, len(r["ids"]) - 1)
        return r["ttft"] * 1e3 <= args.slo_ttft_ms and tpot * 1e3 <= args.slo_tpot_ms

    return {
        "ttft_ms_p50": pct([r["ttft"] for r in short], 0.5),
        "ttft_ms_p90": pct([r["ttft"] for r in short], 0.9),
        "itl_ms_p50": pct(gaps, 0.5),
        "itl_ms_p90": pct(gaps, 0.9),
        "long_ttft_ms_p50": pct([r["ttft"] for r in run["long"]], 0.5) if run["long"] else float("nan"),
        "goodput_rps": sum(met(r) for r in everyone) / run["wall"],
        "met_slo": sum(met(r) for r in everyone),
        "requests": len(everyone),
    }


def step_serving(args: argparse.Namespace) -> list[Row]:
    from pdserve.cluster.launch import local_deployment
    from pdserve.cluster.local import LocalCluster

    model = save_model(args)
    common = {"model": model, "device": args.device, "dtype": args.dtype, "kv_cache_mb": args.kv_cache_mb}
    topologies = {
        "1p1d": local_deployment(prefill=1, decode=1, **common),
        "colocated": local_deployment(prefill=0, decode=0, colocated=1, **common),
    }
    out: dict[str, dict[str, dict[str, float]]] = {}
    rows: list[Row] = []
    for name, config in topologies.items():
        with LocalCluster(config) as cluster:
            out[name] = {
                "interference": figures(workload(cluster.router_address, args, True), args),
                "short alone": figures(workload(cluster.router_address, args, False), args),
            }
            if name == "1p1d":
                rows += backend_rows(cluster)
    for name in topologies:
        for load, values in out[name].items():
            for key, value in values.items():
                rows.append({"step": "serving", "what": f"{name} {load} {key}", "value": round(value, 2), "ok": True})
    itl = out["1p1d"]["interference"]["itl_ms_p90"] / out["colocated"]["interference"]["itl_ms_p90"]
    ttft = out["1p1d"]["short alone"]["ttft_ms_p50"] / out["colocated"]["short alone"]["ttft_ms_p50"]
    judge = not args.tiny  # the dry run checks the machinery, not the goals
    rows.append(
        {
            "step": "serving",
            "what": "1p1d/colocated interference itl p90 (goal <= 0.5)",
            "value": round(itl, 3),
            "ok": itl <= 0.5 or not judge,
        }
    )
    rows.append(
        {
            "step": "serving",
            "what": "1p1d/colocated short-alone ttft p50 (goal <= 1.1)",
            "value": round(ttft, 3),
            "ok": ttft <= 1.1 or not judge,
        }
    )
    rows.append(
        {
            "step": "serving",
            "what": f"SLOs: ttft <= {args.slo_ttft_ms} ms, tpot <= {args.slo_tpot_ms} ms",
            "value": "stated",
            "ok": True,
        }
    )
    return rows


def backend_rows(cluster: Any) -> list[Row]:  # noqa: ANN401
    """Did the KV go worker to worker, and by which path (the fallback's log line says)?"""
    from pdserve.transport import open_channel
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    decode = next(w for w in cluster.workers if w.role == "decode")
    info = worker_pb2_grpc.DecodeWorkerStub(open_channel(decode.address)).GetInfo(worker_pb2.InfoRequest(), timeout=10)
    logs = " ".join(p.read_text(errors="replace") for p in Path(cluster.log_dir).glob("*.log"))
    fell_back = "KV goes through host memory" in logs
    return [
        {
            "step": "serving",
            "what": "1p1d decode worker prefilled no prompt",
            "value": int(info.prefill_tokens_computed),
            "ok": info.prefill_tokens_computed == 0,
        },
        {
            "step": "serving",
            "what": "1p1d KV path",
            "value": "host (fallback logged)" if fell_back else "cuda_ipc",
            "ok": True,
        },
    ]


# ----- kill ----------------------------------------------------------------------------------------
def busy_prefill_worker(stubs: dict[int, Any], deadline: float) -> int | None:  # noqa: ANN401
    """The pid of the prefill worker that took the request (polls GetInfo), or None."""
    from pdserve.v1 import worker_pb2

    while time.perf_counter() < deadline:
        for pid, stub in stubs.items():
            info = stub.GetInfo(worker_pb2.InfoRequest(), timeout=5)
            if info.running_requests or info.queue_depth:
                return pid
    return None


def step_kill(args: argparse.Namespace) -> list[Row]:
    from pdserve.cluster.client import PdserveClient
    from pdserve.cluster.launch import local_deployment
    from pdserve.cluster.local import LocalCluster
    from pdserve.transport import open_channel
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    model = save_model(args)
    config = local_deployment(
        prefill=2, decode=1, model=model, device=args.device, dtype=args.dtype, kv_cache_mb=args.kv_cache_mb
    )
    prompt = prompts(1, args.kill_len, 3)[0]
    with LocalCluster(config) as cluster, PdserveClient(cluster.router_address, timeout_s=300) as client:
        reference = run_request(client, prompt, args.short_tokens)
        prefill = {
            w.pid: worker_pb2_grpc.PrefillWorkerStub(open_channel(w.address))
            for w in cluster.workers
            if w.role == "prefill"
        }
        done_before = {
            pid: stub.GetInfo(worker_pb2.InfoRequest(), timeout=5).requests_finished for pid, stub in prefill.items()
        }
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(run_request, client, prompt, args.short_tokens)
            victim = busy_prefill_worker(prefill, time.perf_counter() + 30)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
            result = future.result(timeout=300)
        survivor = next(pid for pid in prefill if pid != victim)
        took_over = (
            prefill[survivor].GetInfo(worker_pb2.InfoRequest(), timeout=5).requests_finished - done_before[survivor]
        )
        decode = next(w for w in cluster.workers if w.role == "decode")
        stub = worker_pb2_grpc.DecodeWorkerStub(open_channel(decode.address))
        deadline, used = time.perf_counter() + 10, -1
        while time.perf_counter() < deadline and used != 0:
            used = stub.GetInfo(worker_pb2.InfoRequest(), timeout=5).kv_blocks_used
            time.sleep(0.1)
    same = result["ids"] == reference["ids"]
    stalled = result["e2e"] > args.stall_s
    return [
        {
            "step": "kill",
            "what": "prefill worker killed while it held the request",
            "value": victim is not None,
            "ok": victim is not None,
        },
        {
            "step": "kill",
            "what": "request failed over to the other prefill worker",
            "value": took_over >= 1,
            "ok": took_over >= 1 or args.tiny,
        },
        {"step": "kill", "what": "tokens identical to an undisturbed run", "value": same, "ok": same},
        {
            "step": "kill",
            "what": f"request e2e s (no stall: <= {args.stall_s} s)",
            "value": round(result["e2e"], 2),
            "ok": not stalled,
        },
        {"step": "kill", "what": "undisturbed e2e s", "value": round(reference["e2e"], 2), "ok": True},
        {"step": "kill", "what": "decode KV blocks still used afterwards", "value": used, "ok": used == 0},
    ]


# ----- main ----------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the dry run on tiny shapes")
    ap.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--out", default=None, help="folder for gpu-disagg-check.json (default $OUT when set)")
    ap.add_argument("--tokenizer", default=None, help="default .device/tokenizer, else the cached default model")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float16", "float32"),
        help="default bfloat16 (cpu: float32, the fast dtype on an AVX2 CPU)",
    )
    ap.add_argument("--kv-tokens", type=int, default=None, help="default 2048 (cpu: 256)")
    ap.add_argument("--repeats", type=int, default=None, help="kv hand-offs timed: default 10 (cpu: 3)")
    ap.add_argument("--kv-cache-mb", type=int, default=None, help="every worker's KV cache: default 4096 (cpu: 64)")
    ap.add_argument("--short", type=int, default=None, help="short requests: default 16 (cpu: 2)")
    ap.add_argument("--short-len", type=int, default=None, help="their prompt: default 64 (cpu: 16)")
    ap.add_argument("--short-tokens", type=int, default=None, help="their output: default 128 (cpu: 8)")
    ap.add_argument("--long", type=int, default=None, help="long prompts: default 8 (cpu: 1)")
    ap.add_argument("--long-len", type=int, default=None, help="their prompt: default 2048 (cpu: 200)")
    ap.add_argument("--long-gap-s", type=float, default=None, help="between long prompts: default 0.15 (cpu: 0.1)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="default 500 (cpu: 60000)")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="default 30 (cpu: 10000)")
    ap.add_argument("--kill-len", type=int, default=None, help="kill step's prompt: default 4096 (cpu: 600)")
    ap.add_argument("--stall-s", type=float, default=None, help="no-stall bound of the kill step: default 20 (cpu: 60)")
    ap.add_argument("--role", default="check", choices=("check", "kv-sender"), help=argparse.SUPPRESS)
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.tiny = args.device == "cpu"
    for name, gpu, cpu in (
        ("dtype", "bfloat16", "float32"),
        ("kv_tokens", 2048, 256),
        ("repeats", 10, 3),
        ("kv_cache_mb", 4096, 64),
        ("short", 16, 2),
        ("short_len", 64, 16),
        ("short_tokens", 128, 8),
        ("long", 8, 1),
        ("long_len", 2048, 200),
        ("long_gap_s", 0.15, 0.1),
        ("slo_ttft_ms", 500.0, 60000.0),
        ("slo_tpot_ms", 30.0, 10000.0),
        ("kill_len", 4096, 600),
        ("stall_s", 20.0, 60.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, cpu if args.tiny else gpu)
    args.torch_dtype = getattr(torch, args.dtype)
    args.model_dir = None
    return args


def main() -> int:
    args = parse_args()
    if args.role == "kv-sender":
        return kv_sender(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_disagg_check: no CUDA device visible (use --device cpu for the dry run)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    args.tok = load_tokenizer(args.tokenizer)
    print(f"gpu_disagg_check: {device_name}, torch {torch.__version__}, steps {' '.join(args.only)}", flush=True)
    started = time.perf_counter()
    rows = run_steps(
        "gpu_disagg_check",
        args,
        [{"step": "env", "what": "device", "value": device_name, "ok": True}],
        lambda name: globals()[f"step_{name}"],
    )
    out_dir = args.out or os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        doc = {
            "device": device_name,
            "torch": torch.__version__,
            "seconds": time.perf_counter() - started,
            "args": {k: v for k, v in vars(args).items() if k not in ("tok", "torch_dtype")},
            "rows": rows,
        }
        (Path(out_dir) / "gpu-disagg-check.json").write_text(json.dumps(doc, indent=1, default=str))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
