"""Bounded soak run: many requests with random cancellations while a worker is killed on a schedule.

Starts a local deployment (default 2 prefill + 2 decode workers), sends --requests requests from
--concurrency client threads (short prompts, small outputs), cancels a random --cancel-rate share of
them mid-stream, and SIGKILLs one decode worker after --kill-after-s seconds. Reports:
  lost requests   accepted, not cancelled by us, and not completed (goal 0)
  leaked blocks   KV blocks still used on the surviving workers once idle (goal 0)
  memory growth   RSS of each surviving process at the end vs after --rss-from completed requests
                  (after warm-up with --rss-from 0)
Not part of the tests (it takes minutes). Example:
  python benchmarks/soak.py --requests 2000 --concurrency 16
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from pdserve.cluster.launch import local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

WORDS = "river mill evening market flour dawn sea poem story light winter city lake".split()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def idle_blocks(workers: list, timeout_s: float = 60.0) -> int:  # noqa: ANN001
    """Wait until the workers hold no request; return the KV blocks they still hold (leaks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = []
        for w in workers:
            stub_cls = worker_pb2_grpc.PrefillWorkerStub if w.role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
            infos.append(stub_cls(open_channel(w.address)).GetInfo(worker_pb2.InfoRequest(), timeout=5))
        busy = any(i.running_requests or i.queue_depth for i in infos)
        if not busy or time.monotonic() > deadline:
            return sum(i.kv_blocks_used for i in infos)
        time.sleep(0.2)


def one_request(stub: router_pb2_grpc.RouterStub, rng: random.Random, cancel_rate: float) -> str:
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(2, 40)))
    request = router_pb2.GenerateRequest(
        prompt=prompt,
        params=common_pb2.SamplingParams(
            max_tokens=rng.randint(2, 16), ignore_eos=True, temperature=0.8, seed=rng.randrange(1 << 30)
        ),
    )
    call = stub.Generate(request, timeout=300)
    cancel_at = rng.randint(1, 3) if rng.random() < cancel_rate else None
    try:
        for count, response in enumerate(call, 1):
            if cancel_at is not None and count >= cancel_at:
                call.cancel()
                return "cancelled"
            if response.finish_reason:
                return "completed"
        return "lost"  # the stream ended without a finish reason
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED and cancel_at is not None:
            return "cancelled"
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "refused"  # never accepted: backpressure, not a loss
        return f"lost:{exc.code().name}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--cancel-rate", type=float, default=0.1)
    ap.add_argument("--kill-after-s", type=float, default=30.0, help="0: kill nothing")
    ap.add_argument(
        "--rss-from",
        type=int,
        default=0,
        metavar="N",
        help="measure memory growth from the moment N requests have ended (e.g. 500)",
    )
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = local_deployment(prefill=args.prefill, decode=args.decode, threads_per_worker=1)
    with LocalCluster(config) as cluster:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
        rng = random.Random(args.seed)
        for _ in range(8):  # warm-up
            one_request(stub, rng, 0.0)
        pids = {w.worker_id: w.pid for w in cluster.workers}
        pids["router"] = next(p.pid for p in cluster._processes if p.name == "router")  # noqa: SLF001
        warm_rss = {name: rss_mb(pid) for name, pid in pids.items()}  # after the warm-up requests
        start_rss: dict[str, float] = {}
        ended = [0]
        lock = threading.Lock()

        def run_one(seed: int) -> str:
            outcome = one_request(stub, random.Random(seed), args.cancel_rate)
            with lock:
                ended[0] += 1
                if ended[0] == max(1, args.rss_from):
                    start_rss.update({name: rss_mb(pid) for name, pid in pids.items()})
            return outcome

        victim = next(w for w in cluster.workers if w.role == "decode")
        killer = threading.Timer(args.kill_after_s, lambda: os.kill(victim.pid, signal.SIGKILL))
        if args.kill_after_s > 0:
            killer.start()
        seeds = [rng.randrange(1 << 30) for _ in range(args.requests)]
        start = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outcomes = Counter(pool.map(run_one, seeds))
        elapsed = time.monotonic() - start
        killer.cancel()
        survivors = [w for w in cluster.workers if w.pid != victim.pid or args.kill_after_s <= 0]
        leaked = idle_blocks(survivors)
        lost = sum(n for k, n in outcomes.items() if k.startswith("lost"))
        print(f"requests {args.requests} in {elapsed:.0f} s; outcomes {dict(outcomes)}")
        if args.kill_after_s > 0:
            print(f"killed decode worker {victim.worker_id} (pid {victim.pid}) at {args.kill_after_s:.0f} s")
        print(f"lost requests: {lost}   leaked KV blocks: {leaked}")
        print(f"memory from request {max(1, args.rss_from)} to {args.requests}:")
        for name in [w.worker_id for w in survivors] + ["router"]:
            end = rss_mb(pids[name])
            print(
                f"  {name:12s} RSS {start_rss[name]:7.0f} MB -> {end:7.0f} MB ({end - start_rss[name]:+.0f} MB); "
                f"after warm-up {warm_rss[name]:7.0f} MB"
            )


if __name__ == "__main__":
    main()
