"""KV transfer bandwidth per backend against a warm memcpy of the same bytes, same run.

Part 1 (--bandwidth): in one process, a real gRPC KvTransfer server on loopback receives the K/V
of an N-token prompt of the default model's geometry; we time `send` (framing, checksums, gRPC,
validation, reassembly) against `torch.Tensor.copy_` of the same bytes (warm, same process), and
the "ray" backend: ray.put here + ray.get in a worker actor on the same node, until its ack.
"shm" sends a tensor and receives a tensor (staging segment, two copies); "shm c2c" is what the
serving path does: blocks of a prefill cache in shared memory copied straight into blocks of a
decode cache, timed until the ack (which waits for that copy).
Part 2 (--ttft): against a real 1P1D service (separate processes), the share of time-to-first-token
spent in KV transfer for prompts of 128, 512 and 2048 tokens, from the per-request timings.
Part 3 (--checksum): what the decode worker's `--kv-checksum` costs on the shm cache-to-cache path:
the same transfer without a checksum, with xxh3 and with crc32 (sender over its blocks, receiver over
the copied blocks), rounds interleaved in one run; ratios are with / without.

  python benchmarks/kv_transfer_bench.py --bandwidth --ttft
  python benchmarks/kv_transfer_bench.py --checksum --tokens 128 512 2048 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import torch

from pdserve.engine.kv_cache import segment_prefix
from pdserve.kv_transfer import ExpectOptions, KvSpec, KvTransferServicer, get_backend, grpc_message_options
from pdserve.kv_transfer.base import dtype_name
from pdserve.worker.runtime import make_server

SMOLLM2 = dict(layers=30, kv_heads=3, head_dim=64, block_size=16)


def kv_for(tokens: int, dtype: torch.dtype = torch.float32) -> tuple[KvSpec, torch.Tensor]:
    g = SMOLLM2
    n = -(-tokens // g["block_size"])
    shape = (g["layers"], 2, n, g["block_size"], g["kv_heads"], g["head_dim"])
    spec = KvSpec(
        request_id=uuid.uuid4().hex,
        model_fingerprint="bench",
        dtype=dtype_name(dtype),
        shape=shape,
        block_size=g["block_size"],
        num_tokens=tokens,
    )
    return spec, torch.randn(shape).to(dtype)


def memcpy_seconds(kv: torch.Tensor, repeats: int) -> float:
    dst = torch.empty_like(kv)
    dst.copy_(kv)  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(kv)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def grpc_seconds(backend: str, receiver: KvTransferServicer, address: str, tokens: int, repeats: int) -> float:
    sender = get_backend(backend).sender_factory(address)
    times = []
    for i in range(repeats + 1):
        spec, kv = kv_for(tokens)
        pending = receiver.expect(spec, ExpectOptions(60, shm_segment_prefix=segment_prefix()))  # ours: same process
        start = time.perf_counter()
        sender.send(spec, kv, 0, timeout_s=60)
        got, _ = pending.wait(timeout=60)
        if i:  # the first round warms the channel
            times.append(time.perf_counter() - start)
        assert torch.equal(got, kv)
    return statistics.median(times)


def shm_in_place_seconds(
    receiver: KvTransferServicer, address: str, tokens: int, repeats: int, checksums: tuple[str, ...] = ("",)
) -> dict[str, list[float]]:
    """What a 1P1D pair on one host does: from blocks of a prefill cache in shared memory straight
    into reserved blocks of a decode cache (a consumer thread copies, the ack waits for it). Each
    round runs once per entry of `checksums` (interleaved); returns the times per entry."""
    import threading

    from pdserve.engine.kv_cache import KVCache, KVCacheShape
    from pdserve.kv_transfer.shm_backend import ShmKvSender

    g = SMOLLM2
    n = -(-tokens // g["block_size"])
    shape = KVCacheShape(
        num_layers=g["layers"],
        num_kv_heads=g["kv_heads"],
        head_dim=g["head_dim"],
        block_size=g["block_size"],
        dtype=torch.float32,
    )
    source, dest = KVCache(shape, 2 * n, shared=True), KVCache(shape, 2 * n)
    source.kv.copy_(torch.randn(source.kv.shape))
    src_ids, dst_ids = list(range(n // 2, n // 2 + n)), list(range(n, 2 * n))  # as a pool hands them out
    sender, times = ShmKvSender(address), {c: list[float]() for c in checksums}
    for i in range(repeats + 1):
        for checksum in checksums:
            spec = KvSpec(
                request_id=uuid.uuid4().hex,
                model_fingerprint="bench",
                dtype="float32",
                shape=(g["layers"], 2, n, g["block_size"], g["kv_heads"], g["head_dim"]),
                block_size=g["block_size"],
                num_tokens=tokens,
            )
            pending = receiver.expect(
                spec, ExpectOptions(60, in_place=True, shm_segment_prefix=segment_prefix(), require_checksum=checksum)
            )
            consumer = threading.Thread(target=lambda p=pending: p.wait(60)[0](dest.kv, dst_ids))
            consumer.start()
            start = time.perf_counter()
            sender.send_blocks(spec, source, src_ids, 0, timeout_s=60, checksum=checksum)
            if i:
                times[checksum].append(time.perf_counter() - start)
            consumer.join()
            assert torch.equal(dest.kv[:, :, dst_ids], source.kv[:, :, src_ids])
    sender.close()
    return times


def ray_seconds(tokens: int, repeats: int) -> float:
    """ray.put in this process + ray.get in a worker actor of this node (the "ray" backend, end to end)."""
    from pdserve.cluster.ray_kv_bench import ray_send_seconds

    return ray_send_seconds(lambda: kv_for(tokens), repeats)


def bandwidth(tokens_list: list[int], repeats: int, with_ray: bool = True) -> None:
    receiver = KvTransferServicer()
    server = make_server(16, grpc_message_options())
    receiver.add_to_server(server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    print(
        f"{'tokens':>7} {'MiB':>8} {'memcpy GB/s':>12} {'grpc GB/s':>10} {'grpc/memcpy':>12}"
        f" {'shm GB/s':>9} {'shm/memcpy':>11} {'shm c2c GB/s':>13} {'c2c/memcpy':>11}"
        + (f" {'ray GB/s':>9} {'ray/memcpy':>11}" if with_ray else "")
    )
    try:
        for tokens in tokens_list:
            spec, kv = kv_for(tokens)
            mem = memcpy_seconds(kv, repeats)
            net = grpc_seconds("grpc", receiver, address, tokens, repeats)
            gb = spec.nbytes / 1e9
            shm = grpc_seconds("shm", receiver, address, tokens, repeats)
            c2c = statistics.median(shm_in_place_seconds(receiver, address, tokens, repeats)[""])
            line = (
                f"{tokens:7d} {spec.nbytes / 2**20:8.1f} {gb / mem:12.2f} {gb / net:10.2f} {mem / net:12.3f}"
                f" {gb / shm:9.2f} {mem / shm:11.3f} {gb / c2c:13.2f} {mem / c2c:11.3f}"
            )
            if with_ray:
                obj = ray_seconds(tokens, repeats)
                line += f" {gb / obj:9.2f} {mem / obj:11.3f}"
            print(line, flush=True)
    finally:
        receiver.close()
        server.stop(0)


def checksum_cost(tokens_list: list[int], repeats: int) -> None:
    """shm cache-to-cache without and with --kv-checksum xxh3 / crc32, interleaved (median, min-max)."""

    receiver = KvTransferServicer()
    server = make_server(16, grpc_message_options())
    receiver.add_to_server(server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    algorithms = ("", "xxh3", "crc32")
    print(
        f"{'tokens':>7} {'MiB':>6}"
        + "".join(f" {(a or 'none') + ' ms':>10} {'(min-max)':>14}" for a in algorithms)
        + f" {'xxh3/none':>10} {'crc32/none':>11}"
    )
    try:
        for tokens in tokens_list:
            spec, _ = kv_for(tokens)
            times = shm_in_place_seconds(receiver, address, tokens, repeats, checksums=algorithms)
            med = {a: statistics.median(times[a]) for a in algorithms}
            line = f"{tokens:7d} {spec.nbytes / 2**20:6.1f}"
            for a in algorithms:
                line += f" {med[a] * 1e3:10.2f} {f'({min(times[a]) * 1e3:.1f}-{max(times[a]) * 1e3:.1f})':>14}"
            print(line + f" {med['xxh3'] / med['']:10.2f} {med['crc32'] / med['']:11.2f}", flush=True)
    finally:
        receiver.close()
        server.stop(0)


def ttft_share(tokens_list: list[int], repeats: int) -> None:
    from pdserve.cluster.client import PdserveClient, build_request
    from pdserve.cluster.launch import local_deployment
    from pdserve.cluster.local import LocalCluster
    from pdserve.v1 import common_pb2

    with LocalCluster(local_deployment(model=None, prefill=1, decode=1, colocated=0)) as cluster:
        client = PdserveClient(cluster.router_address)
        print(f"{'tokens':>7} {'ttft ms':>9} {'prefill ms':>11} {'kv ms':>7} {'kv share':>9}")
        for tokens in tokens_list:
            rows = []
            for i in range(repeats + 1):
                ids = [(17 * k + i) % 40000 + 100 for k in range(tokens)]
                result = client.complete(build_request(token_ids=ids, params=common_pb2.SamplingParams(max_tokens=1)))
                if i:
                    rows.append(result.timings)
            ttft = statistics.median(t["ttft_s"] for t in rows)
            pre = statistics.median(t["prefill_s"] for t in rows)
            kv = statistics.median(t["kv_transfer_s"] for t in rows)
            print(f"{tokens:7d} {ttft * 1e3:9.1f} {pre * 1e3:11.1f} {kv * 1e3:7.1f} {kv / ttft:9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth", action="store_true")
    ap.add_argument("--ttft", action="store_true")
    ap.add_argument("--checksum", action="store_true", help="cost of --kv-checksum on the shm path")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray object-store backend")
    args = ap.parse_args()
    if not (args.bandwidth or args.ttft or args.checksum):
        args.bandwidth = args.ttft = True
    if args.bandwidth:
        bandwidth(args.tokens, args.repeats, with_ray=not args.no_ray)
    if args.ttft:
        ttft_share(args.tokens, args.repeats)
    if args.checksum:
        checksum_cost(args.tokens, args.repeats)


if __name__ == "__main__":
    main()
