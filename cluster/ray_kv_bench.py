"""Ray object-store KV transfer timing for benchmarks/kv_transfer_bench.py (kept here: only `cluster/`
and the Ray KV backend import ray).

The driver is the prefill side (`RayKvSender`: ray.put + a `receive_kv` call); a worker actor on the
same node is the decode side (`RayKvReceiver`: header check, ray.get, view). One `send` is timed
end to end, i.e. until the receiver's intake completed and its ack came back.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from kv_transfer.base import KvSpec

BENCH_ACTOR = "pdserve-kv-bench"


class _BenchReceiver:
    """Registers the intake for each header it is sent, then receives it like a decode actor."""

    def __init__(self) -> None:
        from kv_transfer.grpc_backend import KvTransferServicer
        from kv_transfer.ray_backend import RayKvReceiver

        self.receiver = RayKvReceiver(KvTransferServicer())

    def receive_kv(self, header: dict[str, Any], refs: list[Any]) -> dict[str, Any]:
        from kv_transfer.ray_backend import spec_from_header

        spec, _ = spec_from_header(header)
        pending = self.receiver.expect(spec, deadline_s=60)
        ack = self.receiver.receive(header, refs)
        if ack["ok"]:
            kv, _ = pending.wait(60)
            ack["checksum"] = float(kv.float().sum())
        return ack


def ray_send_seconds(make_kv: Callable[[], tuple[KvSpec, torch.Tensor]], repeats: int) -> float:
    """Median seconds of one RayKvSender.send of `make_kv()`'s tensor to an actor on this node."""
    from kv_transfer.ray_backend import NAMESPACE, RayKvSender

    if not ray.is_initialized():  # left running for the next call (ends with the process)
        ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    actor = ray.remote(_BenchReceiver).options(name=BENCH_ACTOR, namespace=NAMESPACE, num_cpus=0,
                                              get_if_exists=True).remote()
    try:
        sender = RayKvSender(f"ray:{BENCH_ACTOR}")
        times = []
        for i in range(repeats + 1):
            spec, kv = make_kv()
            start = time.perf_counter()
            sender.send(spec, kv, 0, timeout_s=120)
            if i:  # the first round warms the actor and the object store
                times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        ray.kill(actor)
