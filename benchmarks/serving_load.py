"""Serving under real load: many more concurrent clients than decode slots, through gRPC and HTTP.

Starts a local 1P1D deployment of the default model (router with the OpenAI HTTP API), then:
  1. gRPC: `pdserve bench` with --num-prompts N at --max-concurrency C (short prompts, 8-32 output
     tokens, all sent at once): reports completed/failed, then waits until every worker is idle and
     reports the KV blocks still used (goal: 0 failed, 0 leaked).
  2. HTTP: --http-requests streaming /v1/completions requests from --http-concurrency clients at
     once (aiohttp); reports errors by status.
  3. The RSS of every process after each phase (soak growth).
Not part of the tests (it takes many minutes on a CPU). Example (the issue's figures):

  python benchmarks/serving_load.py --num-prompts 3000 --max-concurrency 1000 \
      --http-requests 600 --http-concurrency 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter

import aiohttp

from pdserve.capacity.bench import BenchConfig, run_bench
from pdserve.capacity.workload import LengthDist
from pdserve.cluster.launch import local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def worker_info(address: str, role: str) -> common_pb2.WorkerInfo:
    stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(
        open_channel(address)
    )
    return stub.GetInfo(worker_pb2.InfoRequest(), timeout=10)


def wait_idle(workers: list[tuple[str, str]], timeout: float) -> list[common_pb2.WorkerInfo]:
    """Poll until no worker holds a request (or `timeout`); their last infos."""
    deadline = time.monotonic() + timeout
    while True:
        infos = [worker_info(address, role) for role, address in workers]
        if all(i.running_requests == 0 and i.queue_depth == 0 for i in infos) or time.monotonic() > deadline:
            return infos
        time.sleep(0.5)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def _one_http(session: aiohttp.ClientSession, url: str, i: int, model: str) -> str:
    body = {
        "model": model,
        "prompt": f"Tell me about the river number {i}",
        "max_tokens": 8 + i % 25,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                return f"HTTP {response.status}"
            finished = False
            async for line in response.content:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"stream error: {event['error'].get('message', '')[:60]}"
                    finished = finished or bool(event["choices"][0].get("finish_reason"))
            return "ok" if finished else "no finish_reason"
    except aiohttp.ClientError as exc:
        return f"{type(exc).__name__}"


async def http_phase(http_address: str, requests: int, concurrency: int) -> Counter[str]:
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(f"http://{http_address}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        url = f"http://{http_address}/v1/completions"
        outcomes = await asyncio.gather(*(_one_http(session, url, i, model) for i in range(requests)))
    return Counter(outcomes)


def report_rss(cluster: LocalCluster, label: str) -> dict[str, float]:
    sizes = {p.name: rss_mb(p.pid) for p in cluster._processes}  # noqa: SLF001 - a benchmark reads its own children
    print(f"RSS after {label}: " + ", ".join(f"{n} {mb:.0f} MB" for n, mb in sizes.items()), flush=True)
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=3000, help="gRPC phase requests (0: skip the phase)")
    ap.add_argument("--max-concurrency", type=int, default=1000)
    ap.add_argument("--http-requests", type=int, default=600)
    ap.add_argument("--http-concurrency", type=int, default=300)
    ap.add_argument("--threads-per-worker", type=int, default=1)
    args = ap.parse_args()
    config = local_deployment(prefill=1, decode=1, threads_per_worker=args.threads_per_worker, http_port=0)
    with LocalCluster(config) as cluster:
        workers = [(w.role, w.address) for w in cluster.workers]
        report_rss(cluster, "start")
        if args.num_prompts > 0:  # 0: the HTTP phase only
            start = time.monotonic()
            result = run_bench(
                BenchConfig(
                    url=cluster.router_address,
                    input_len=LengthDist.parse("8:48"),
                    output_len=LengthDist.parse("8:32"),
                    num_prompts=args.num_prompts,
                    max_concurrency=args.max_concurrency,
                    ignore_eos=True,
                    timeout_s=3600,
                ),
                progress=False,
            )
            summary = result["summary"]
            infos = wait_idle(workers, timeout=120)
            print(
                f"gRPC: {args.num_prompts} requests at concurrency {args.max_concurrency}: "
                f"completed {summary['completed']}, failed {summary['failed']}, "
                f"{time.monotonic() - start:.0f} s, {summary['output_throughput']:.1f} output tok/s; "
                f"KV blocks used once idle: {[i.kv_blocks_used for i in infos]} of "
                f"{[i.kv_blocks_total for i in infos]}",
                flush=True,
            )
            errors = Counter(r["error"][:80] for r in result["records"] if r["error"])
            if errors:
                print(f"gRPC errors: {dict(errors.most_common(5))}")
            report_rss(cluster, "gRPC phase")
        start = time.monotonic()
        outcomes = asyncio.run(http_phase(cluster.http_address, args.http_requests, args.http_concurrency))
        infos = wait_idle(workers, timeout=120)
        print(
            f"HTTP: {args.http_requests} streaming requests at concurrency {args.http_concurrency}: "
            f"{dict(outcomes)}, {time.monotonic() - start:.0f} s; KV blocks used once idle: "
            f"{[i.kv_blocks_used for i in infos]}",
            flush=True,
        )
        report_rss(cluster, "HTTP phase")
        print("requests finished per worker:", {a: worker_info(a, r).requests_finished for r, a in workers})


if __name__ == "__main__":
    main()
