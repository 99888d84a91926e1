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

import torch

from pdserve.extras import missing_extra
from pdserve.kv_transfer.base import ExpectOptions, KvSpec

try:
    import ray
except ImportError as exc:
    raise missing_extra("ray", "The Ray KV benchmark") from exc

BENCH_ACTOR = "pdserve-kv-bench"


class _BenchReceiver:
    """Registers the intake for each header it is sent, then receives it like a decode actor."""

    def __init__(self) -> None:
        from pdserve.kv_transfer.grpc_backend import KvTransferServicer
        from pdserve.kv_transfer.ray_backend import RayKvReceiver

        self.receiver = RayKvReceiver(KvTransferServicer())

    def receive_kv(self, header: dict[str, Any], refs: list[Any]) -> dict[str, Any]:
        from pdserve.kv_transfer.ray_backend import spec_from_header

        spec, _ = spec_from_header(header)
        pending = self.receiver.expect(spec, ExpectOptions(60))
        ack = self.receiver.receive(header, refs)
        if ack["ok"]:
            kv, _ = pending.wait(60)
            ack["checksum"] = float(kv.float().sum())
        return ack


def ray_send_seconds(make_kv: Callable[[], tuple[KvSpec, torch.Tensor]], repeats: int) -> float:
    """Median seconds of one RayKvSender.send of `make_kv()`'s tensor to an actor on this node."""
    from pdserve.kv_transfer.ray_backend import NAMESPACE, RayKvSender

    if not ray.is_initialized():  # left running for the next call (ends with the process)
        ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    actor = (
        ray.remote(_BenchReceiver)
        .options(name=BENCH_ACTOR, namespace=NAMESPACE, num_cpus=0, get_if_exists=True)
        .remote()
    )
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


# ----- across the nodes of a local multi-node cluster (benchmarks/ray_multinode_kv_bench.py) ---------------
NODE_STORE_BYTES = 512 * 2**20  # object store per node of the benchmark cluster


def _random_kv(shape: tuple[int, ...], block_size: int, tokens: int) -> tuple[KvSpec, torch.Tensor]:
    import uuid

    spec = KvSpec(
        request_id=uuid.uuid4().hex,
        model_fingerprint="bench",
        dtype="float32",
        shape=shape,
        block_size=block_size,
        num_tokens=tokens,
    )
    return spec, torch.randn(shape)


class _GrpcReceiver:
    """A gRPC KvTransfer server (the "grpc" backend's receiving end) inside an actor."""

    def __init__(self) -> None:
        from pdserve.kv_transfer import KvTransferServicer, grpc_message_options
        from pdserve.worker.runtime import make_server

        self.receiver = KvTransferServicer()
        self.server = make_server(8, grpc_message_options())
        self.receiver.add_to_server(self.server)
        host = ray.util.get_node_ip_address()
        self.address = f"{host}:{self.server.add_insecure_port(f'{host}:0')}"
        self.server.start()
        self.pending: dict[str, Any] = {}

    def get_address(self) -> str:
        return self.address

    def expect(self, spec: KvSpec) -> None:
        self.pending[spec.request_id] = self.receiver.expect(spec, ExpectOptions(60))

    def wait(self, request_id: str) -> float:
        kv, _ = self.pending.pop(request_id).wait(60)
        return float(kv.float().sum())


class _NodeSender:
    """The prefill side on a chosen node: times sends of fresh KV to a receiver actor (median seconds)."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def memcpy(self, shape: tuple[int, ...], repeats: int) -> float:
        """Median seconds of a warm Tensor.copy_ of the same bytes, in this actor (the baseline)."""
        src = torch.randn(shape)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def ray_send(self, target: str, shape: tuple[int, ...], block_size: int, tokens: int, repeats: int) -> float:
        from pdserve.kv_transfer.ray_backend import RayKvSender

        sender, times = RayKvSender(f"ray:{target}"), []
        for i in range(repeats + 1):
            spec, kv = _random_kv(shape, block_size, tokens)
            start = time.perf_counter()
            sender.send(spec, kv, 0, timeout_s=120)
            if i:  # the first round warms the actor and both object stores
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def grpc_send(
        self,
        receiver: Any,
        shape: tuple[int, ...],
        block_size: int,
        tokens: int,  # noqa: ANN401
        repeats: int,
    ) -> float:
        from pdserve.kv_transfer import get_backend

        sender = get_backend("grpc").sender_factory(ray.get(receiver.get_address.remote()))
        times = []
        for i in range(repeats + 1):
            spec, kv = _random_kv(shape, block_size, tokens)
            ray.get(receiver.expect.remote(spec))
            start = time.perf_counter()
            sender.send(spec, kv, 0, timeout_s=120)
            checksum = ray.get(receiver.wait.remote(spec.request_id))  # until the receiver holds all of it
            if i:
                times.append(time.perf_counter() - start)
            assert abs(checksum - float(kv.sum())) <= 1e-3 * max(1.0, abs(checksum))
        return statistics.median(times)


def cross_node_seconds(
    shapes: list[tuple[int, tuple[int, ...]]], block_size: int, repeats: int
) -> dict[int, dict[str, float]]:
    """Start a head + two worker nodes (each its own raylet and object store, on this host), then for
    each (tokens, shape): median seconds of a memcpy of the bytes in the sending actor (the baseline),
    of one KV send node-a -> node-b through the object store (RayKvSender -> a receiving actor), the
    same within node-a, and over gRPC node-a -> node-b."""
    from ray.cluster_utils import Cluster

    from pdserve.kv_transfer.ray_backend import NAMESPACE

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": NODE_STORE_BYTES, "include_dashboard": False},
    )
    try:
        for name in ("node_a", "node_b"):
            cluster.add_node(num_cpus=4, resources={name: 10}, object_store_memory=NODE_STORE_BYTES)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        on = {name: {"num_cpus": 0, "resources": {name: 1}} for name in ("node_a", "node_b")}
        sender = ray.remote(_NodeSender).options(**on["node_a"]).remote()
        remote_rx = (
            ray.remote(_BenchReceiver)
            .options(name="bench-rx-b", namespace=NAMESPACE, max_concurrency=4, **on["node_b"])
            .remote()
        )
        local_rx = (
            ray.remote(_BenchReceiver)
            .options(name="bench-rx-a", namespace=NAMESPACE, max_concurrency=4, **on["node_a"])
            .remote()
        )
        grpc_rx = ray.remote(_GrpcReceiver).options(max_concurrency=4, **on["node_b"]).remote()
        nodes = ray.get(
            [
                sender.node_id.remote(),
                ray.remote(lambda: ray.get_runtime_context().get_node_id()).options(**on["node_b"]).remote(),
            ]
        )
        assert nodes[0] != nodes[1]
        ray.get([remote_rx.__ray_ready__.remote(), local_rx.__ray_ready__.remote(), grpc_rx.get_address.remote()])
        out = {}
        for tokens, shape in shapes:
            out[tokens] = {
                "memcpy": ray.get(sender.memcpy.remote(shape, repeats)),
                "ray_cross": ray.get(sender.ray_send.remote("bench-rx-b", shape, block_size, tokens, repeats)),
                "ray_same": ray.get(sender.ray_send.remote("bench-rx-a", shape, block_size, tokens, repeats)),
                "grpc_cross": ray.get(sender.grpc_send.remote(grpc_rx, shape, block_size, tokens, repeats)),
            }
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()
