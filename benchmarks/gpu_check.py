"""The GPU check: one command on a CUDA machine, under 10 minutes on one GPU (`benchmarks/gpu_check.sh`).

Steps (each prints its rows; a table of every row comes last, and the rows are written as JSON to
--out when given):
  1. exactness   pytest with PDSERVE_TEST_DEVICE=cuda: the engine against Hugging Face on the GPU
                 (bf16 and fp32, vLLM's logprob-closeness rule, the 7 exactness prompts) and the
                 device/dtype plumbing tests.
  2. serving     a 1P1D deployment on the GPU (prefill on cuda:0, decode on cuda:1 when there are
                 two GPUs), and one colocated GPU worker, same run: --num-prompts prompts streamed
                 at once; every request must finish with its tokens, and the decode worker must
                 never have prefilled. TTFT and ITL (median, p90) of each; the 1P1D/colocated ratios.
  3. kv          K/V hand-off bandwidth for a --kv-tokens prompt of the default model's geometry:
                 device cache -> pinned host (`KVCache.gather`), host -> device cache
                 (`KVCache.scatter`), each against a raw pinned `copy_` of the same bytes, and a
                 CUDA IPC hand-off to a second process (descriptor as bytes, checked by a checksum).

  python benchmarks/gpu_check.py --out benchmarks/reports/gpu-check.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

Row = dict[str, object]


def step_exactness() -> list[Row]:
    env = {**os.environ, "PDSERVE_TEST_DEVICE": "cuda"}
    tests = ["tests/engine/test_hf_equivalence_bf16.py", "tests/engine/test_device_dtype.py",
             "tests/kv_transfer/test_device_staging.py"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                          capture_output=True, text=True, timeout=400, check=False)
    print(done.stdout[-3000:], done.stderr[-2000:], sep="\n")
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return [{"step": "exactness", "what": "pytest on cuda", "value": summary,
             "ok": done.returncode == 0, "seconds": round(time.perf_counter() - start, 1)}]


def streamed(client, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[float], int]:  # noqa: ANN001
    """(TTFT, inter-token gaps, tokens) of one streamed request, timed here."""
    from pdserve.cluster.client import build_request, sampling_params

    request = build_request(token_ids=prompt_ids, params=sampling_params(max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    stamps, tokens = [], 0
    for response in client.generate(request):
        if response.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(response.token_ids)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return (stamps[0] - start if stamps else float("nan")), gaps, tokens


def burst(address: str, num_prompts: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    from pdserve.cluster.client import PdserveClient

    prompts = [[100 + (i * 31 + j * 7) % 20000 for j in range(prompt_len)] for i in range(num_prompts)]
    with PdserveClient(address, timeout_s=300) as client:
        streamed(client, prompts[0][:16], 2)  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=num_prompts) as pool:
            results = list(pool.map(lambda p: streamed(client, p, max_tokens), prompts))
        wall = time.perf_counter() - start
    if any(tokens != max_tokens for _, _, tokens in results):
        raise RuntimeError(f"a request ended early: {[t for _, _, t in results]}")
    ttfts = sorted(r[0] for r in results)
    gaps = sorted(g for r in results for g in r[1])
    return {"ttft_ms_median": statistics.median(ttfts) * 1e3, "ttft_ms_p90": ttfts[int(0.9 * len(ttfts))] * 1e3,
            "itl_ms_median": statistics.median(gaps) * 1e3, "itl_ms_p90": gaps[int(0.9 * len(gaps))] * 1e3,
            "output_tok_s": num_prompts * max_tokens / wall}


def step_serving(args: argparse.Namespace) -> list[Row]:
    from pdserve.cluster.local import LocalCluster, LocalClusterConfig
    from pdserve.transport import open_channel
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    on_gpu = args.device == "cuda"
    first, second = ("cuda:0", "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0") if on_gpu else ("cpu", "cpu")
    topologies = {
        "1p1d": LocalClusterConfig(prefill=1, decode=1, device=args.device, dtype=args.dtype,
                                   prefill_args=("--device", first), decode_args=("--device", second)),
        "colocated": LocalClusterConfig(prefill=0, decode=0, colocated=1, device=args.device, dtype=args.dtype),
    }
    rows, figures = [], {}
    for name, config in topologies.items():
        with LocalCluster(config) as cluster:
            figures[name] = burst(cluster.router_address, args.num_prompts, args.prompt_len, args.max_tokens)
            if name == "1p1d":
                decode = next(w for w in cluster.workers if w[0] == "decode")
                stub = worker_pb2_grpc.DecodeWorkerStub(open_channel(decode[2]))
                info = stub.GetInfo(worker_pb2.InfoRequest(), timeout=10)
                rows.append({"step": "serving", "what": "1p1d decode worker prefilled no prompt",
                             "value": int(info.prefill_tokens_computed), "ok": info.prefill_tokens_computed == 0})
        for key, value in figures[name].items():
            rows.append({"step": "serving", "what": f"{name} {key}", "value": round(value, 2), "ok": True})
    for key in ("ttft_ms_median", "itl_ms_median", "output_tok_s"):
        ratio = figures["1p1d"][key] / figures["colocated"][key]
        rows.append({"step": "serving", "what": f"1p1d/colocated {key}", "value": round(ratio, 2), "ok": True})
    return rows


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 10) -> float:  # noqa: ANN001
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ipc_child(conn) -> None:  # noqa: ANN001 - a multiprocessing connection; bytes only cross it
    from pdserve.kv_transfer import cuda_ipc

    data, shape, dtype = conn.recv_bytes(), json.loads(conn.recv_bytes()), conn.recv_bytes().decode()
    start = time.perf_counter()
    tensor = cuda_ipc.import_tensor(cuda_ipc.unpack(data), tuple(shape), dtype)
    local = tensor.clone()
    torch.cuda.synchronize()
    conn.send_bytes(json.dumps({"sum": float(local.float().sum()), "s": time.perf_counter() - start}).encode())


def step_kv(args: argparse.Namespace) -> list[Row]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.kv_cache import KVCache, host_empty
    from pdserve.engine.model_fetch import resolve_model
    from pdserve.engine.model_loader import load_model
    from pdserve.kv_transfer import cuda_ipc

    config = EngineConfig(device=args.device, dtype=args.dtype)
    shape = load_model(resolve_model(None), config.torch_dtype, "cpu").kv_shape(16)
    blocks = -(-args.kv_tokens // 16)
    src, dst = KVCache(shape, blocks * 2, config.device), KVCache(shape, blocks * 2, config.device)
    src.kv.normal_()
    ids = list(range(0, 2 * blocks, 2))  # every other block: a real gather, not one slice
    payload = src.gather(ids)
    nbytes = payload.numel() * payload.element_size()
    raw_host = host_empty(tuple(payload.shape), payload.dtype)
    raw_dev = src.gather_on_device(ids)
    d2h_raw = timed(lambda: raw_host.copy_(raw_dev, non_blocking=True))
    h2d_raw = timed(lambda: raw_dev.copy_(raw_host, non_blocking=True))
    d2h = timed(lambda: src.gather(ids))
    h2d = timed(lambda: dst.scatter(ids, payload))
    rows = [{"step": "kv", "what": f"{args.kv_tokens}-token K/V bytes", "value": nbytes, "ok": True}]
    for what, ours, raw in (("gather device->pinned host", d2h, d2h_raw), ("scatter host->device", h2d, h2d_raw)):
        rows.append({"step": "kv", "what": f"{what} GB/s", "value": round(nbytes / ours / 1e9, 2), "ok": True})
        rows.append({"step": "kv", "what": f"{what} / raw pinned copy", "value": round(raw / ours, 2), "ok": True})
    if args.device != "cuda":
        return rows
    device_copy = src.gather_on_device(ids)
    expected = float(device_copy.float().sum())
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_child, args=(child,))
    proc.start()
    parent.send_bytes(cuda_ipc.pack(cuda_ipc.export_tensor(device_copy)))
    parent.send_bytes(json.dumps(list(device_copy.shape)).encode())
    parent.send_bytes(str(device_copy.dtype).removeprefix("torch.").encode())
    answer = json.loads(parent.recv_bytes())
    proc.join(60)
    ok = abs(answer["sum"] - expected) <= 1e-3 * max(1.0, abs(expected))
    rows.append({"step": "kv", "what": "CUDA IPC to another process: same bytes", "value": ok, "ok": ok})
    rows.append({"step": "kv", "what": "CUDA IPC import+clone GB/s", "value": round(nbytes / answer["s"] / 1e9, 2),
                 "ok": True})
    return rows


def print_table(rows: list[Row]) -> None:
    width = max(len(str(r["what"])) for r in rows)
    print(f"\n{'step':10s} {'what':{width}s} {'value':>14s}  ok")
    for r in rows:
        print(f"{r['step']!s:10s} {r['what']!s:{width}s} {r['value']!s:>14s}  {'yes' if r['ok'] else 'NO'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=("exactness", "serving", "kv"), default=["exactness", "serving", "kv"])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write the rows here as JSON")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of the serving and kv steps on this machine (no IPC)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing to check", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {name}")
    steps = {"exactness": step_exactness, "serving": lambda: step_serving(args), "kv": lambda: step_kv(args)}
    rows: list[Row] = []
    for name in args.only:
        try:
            rows += steps[name]()
        except Exception as err:  # noqa: BLE001 - one failed step must not hide the others' rows
            rows.append({"step": name, "what": "failed", "value": f"{type(err).__name__}: {err}"[:200], "ok": False})
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1, default=str)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
