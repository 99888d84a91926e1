"""Live KV migration against recompute: how long a running request's move to another decode worker
takes, beside re-prefilling its context (what failover, and Dynamo's rebalancing, do instead).

One local cluster (1 prefill, 2 decode workers, real processes on loopback, the default model on
CPU). For each context length C (default 512 and 2,048 tokens) and each repeat:

- **migrate**: a request of C - 8 random prompt tokens streams until 8 tokens are delivered (so the
  context is C tokens), then `Router.Migrate` moves it to the other decode worker. Time: the router's
  `migrate_s`, from the Migrate call to the target holding the K/V of all C - 1 cached tokens and
  decoding (suspend, target reservation, KV push over gRPC, commit); the client's stream pauses at
  most this long. The request is cancelled after the move (that the moved stream's tokens equal an
  undisturbed run's is what tests/reliability/test_migration.py checks).
- **recompute**: a fresh request of C random prompt tokens with max_tokens=1: its TTFT (router
  measured: prefill of C tokens, KV hand-off to a decode worker, first token) is what a re-prefill of
  the same context costs a failover.

Prompts are fresh random token ids each time (no prefix-cache hit). Migrate and recompute alternate
per repeat, so the machine's load hits both alike; the table reports medians, min-max and the ratio
recompute / migrate of the medians.

    python benchmarks/migration_bench.py                      # default model, 512 and 2048: a few minutes
    python benchmarks/migration_bench.py --contexts 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading

import grpc

from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.engine.model_fetch import resolve_model
from pdserve.engine.model_loader import load_model
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

DELIVERED = 8  # output tokens before the move


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab) for _ in range(n)]


def _migrate_once(stub: router_pb2_grpc.RouterStub, ids: list[int], request_id: str) -> router_pb2.MigrateResponse:
    request = router_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=common_pb2.TokenIds(ids=ids),
        params=common_pb2.SamplingParams(max_tokens=10_000, ignore_eos=True),
    )
    call = stub.Generate(request, timeout=600)
    delivered, ready = 0, threading.Event()

    def read() -> None:
        nonlocal delivered
        try:
            for response in call:
                delivered += len(response.token_ids)
                if delivered >= DELIVERED:
                    ready.set()
        except grpc.RpcError:
            pass
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not ready.wait(600) or delivered < DELIVERED:
        raise RuntimeError("the stream ended before the move")
    try:
        return stub.Migrate(router_pb2.MigrateRequest(request_id=request_id), timeout=600)
    finally:
        call.cancel()
        reader.join(30)


def _recompute_once(stub: router_pb2_grpc.RouterStub, ids: list[int]) -> float:
    request = router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids), params=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True)
    )
    responses = list(stub.Generate(request, timeout=600))
    return responses[-1].timings.ttft_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the default model)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the raw numbers here")
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    vocab = load_model(model).config.vocab_size
    rng = random.Random(0)
    rows = []
    config = local_deployment(model=model, prefill=1, decode=2, threads_per_worker=args.threads)
    options = LaunchOptions(decode_args=("--kv-backend", "grpc"), prefill_args=("--no-prefix-caching",))
    with LocalCluster(config, options) as cluster:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
        _recompute_once(stub, _random_ids(rng, 64, vocab))  # warm-up
        for context in args.contexts:
            moves, recomputes = [], []
            for i in range(args.repeats):
                done = _migrate_once(stub, _random_ids(rng, context - DELIVERED, vocab), f"bench-{context}-{i}")
                moves.append(done)
                recomputes.append(_recompute_once(stub, _random_ids(rng, context, vocab)))
            move_s = [m.migrate_s for m in moves]
            rows.append(
                {
                    "context": context,
                    "moved_tokens": moves[0].num_tokens,
                    "kv_bytes": moves[0].kv_bytes,
                    "migrate_s": move_s,
                    "recompute_s": recomputes,
                    "ratio": statistics.median(recomputes) / statistics.median(move_s),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print()
    print(
        "| context (tokens) | KV moved | migrate median (min-max) | recompute median (min-max) | recompute / migrate |"
    )
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        m, c = r["migrate_s"], r["recompute_s"]
        print(
            f"| {r['context']} | {r['kv_bytes'] / 2**20:.1f} MiB | {statistics.median(m) * 1e3:.0f} ms "
            f"({min(m) * 1e3:.0f}-{max(m) * 1e3:.0f}) | {statistics.median(c) * 1e3:.0f} ms "
            f"({min(c) * 1e3:.0f}-{max(c) * 1e3:.0f}) | {r['ratio']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
