"""Time to first token, each figure a ratio against a baseline measured in the same run.

  --disagg   TTFT of a 1P1D deployment / TTFT of one colocated worker, for prompts of --lengths
             tokens (prefix caching off, so every request computes its whole prompt).
  --prefix   TTFT of prompts that share 90% of their tokens with an earlier prompt / TTFT of prompts
             of the same length that share nothing (1P1D, prefix caching on).
Each point is the median of --repeats requests (max_tokens 1), after one warm-up request.

  python benchmarks/ttft_bench.py --disagg --prefix
"""

from __future__ import annotations

import argparse
import random
import statistics

from pdserve.cluster.client import PdserveClient, build_request
from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.v1 import common_pb2


def random_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def ttft(client: PdserveClient, ids: list[int]) -> float:
    result = client.complete(build_request(token_ids=ids, params=common_pb2.SamplingParams(max_tokens=1)))
    return result.timings["ttft_s"]


def median_ttft(client: PdserveClient, prompts: list[list[int]]) -> float:
    ttft(client, prompts[0])  # warm-up
    return statistics.median(ttft(client, p) for p in prompts[1:])


def disagg(lengths: list[int], repeats: int, threads: int, kv_backend: str, kv_streaming: str) -> None:
    rng = random.Random(0)
    prompts = {n: [random_ids(n, rng) for _ in range(repeats + 1)] for n in lengths}
    results: dict[str, dict[int, float]] = {}
    configs = {
        "colocated": (local_deployment(prefill=0, decode=0, colocated=1, threads_per_worker=threads), LaunchOptions()),
        "1p1d": (
            local_deployment(prefill=1, decode=1, threads_per_worker=threads),
            LaunchOptions(
                prefill_args=("--no-prefix-caching", "--kv-streaming", kv_streaming),
                decode_args=("--kv-backend", kv_backend),
            ),
        ),
    }
    for name, (config, options) in configs.items():
        with LocalCluster(config, options) as cluster, PdserveClient(cluster.router_address) as client:
            results[name] = {n: median_ttft(client, prompts[n]) for n in lengths}
    print(f"{'tokens':>7} {'colocated ms':>13} {'1p1d ms':>9} {'1p1d/colocated':>15}")
    for n in lengths:
        c, d = results["colocated"][n], results["1p1d"][n]
        print(f"{n:7d} {c * 1e3:13.1f} {d * 1e3:9.1f} {d / c:15.2f}")


def prefix(length: int, repeats: int, threads: int) -> None:
    rng = random.Random(1)
    shared = random_ids(int(length * 0.9), rng)
    cached = [shared + random_ids(length - len(shared), rng) for _ in range(repeats + 1)]
    fresh = [random_ids(length, rng) for _ in range(repeats + 1)]
    config = local_deployment(prefill=1, decode=1, threads_per_worker=threads)
    with LocalCluster(config) as cluster, PdserveClient(cluster.router_address) as client:
        hit = median_ttft(client, cached)  # the warm-up request fills the cache with the shared prefix
        miss = median_ttft(client, fresh)
    print(
        f"prompt {length} tokens, 90% shared: TTFT {hit * 1e3:.1f} ms vs {miss * 1e3:.1f} ms unshared "
        f"-> ratio {hit / miss:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--disagg", action="store_true")
    ap.add_argument("--prefix", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--prefix-length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    ap.add_argument("--kv-backend", default="auto", help="decode workers' --kv-backend for the 1p1d runs")
    ap.add_argument("--kv-streaming", default="request", help="prefill workers' --kv-streaming (request|layer)")
    args = ap.parse_args()
    if not (args.disagg or args.prefix):
        args.disagg = args.prefix = True
    if args.disagg:
        print(f"1p1d: --kv-backend {args.kv_backend} --kv-streaming {args.kv_streaming}")
        disagg(args.lengths, args.repeats, args.threads, args.kv_backend, args.kv_streaming)
    if args.prefix:
        prefix(args.prefix_length, args.repeats, args.threads)


if __name__ == "__main__":
    main()
