"""`python -m pdserve.decode_worker`: one decode (or colocated) worker process; gRPC on loopback by default.

Serves DecodeWorker, KvTransfer (the gRPC KV backend's receiver) and health on one port.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.decode_worker.servicer import DecodeServicer
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.fault_injection import InjectedFaults
from pdserve.engine.metrics import WorkerMetrics
from pdserve.engine.sim_runner import add_engine_args
from pdserve.engine.worker_runtime import (
    Drain,
    KvEventsServicer,
    StartedWorker,
    add_observability_args,
    add_worker_args,
    apply_internal_credentials,
    bind,
    call_limits,
    load_worker_model,
    make_server,
    run_worker_process,
    start_serving,
)
from pdserve.kv_transfer import KvTransferServicer, grpc_message_options
from pdserve.limits import receive_options
from pdserve.process_config import add_config_arg, parse_with_document
from pdserve.telemetry.prometheus import start_metrics_endpoint
from pdserve.transport import check_bind_allowed
from pdserve.v1 import worker_pb2_grpc


def parse_args(argv: list[str] | None = None, document: dict[str, Any] | None = None) -> argparse.Namespace:
    """This worker's options: defaults < `document` (or the JSON file of --config) < flags."""
    return parse_with_document(build_parser(), argv, document)


def build_parser() -> argparse.ArgumentParser:
    """This worker's command-line flags (also read by `elastic_worker`, which takes both roles' flags)."""
    ap = argparse.ArgumentParser(prog="python -m pdserve.decode_worker", description=__doc__)
    add_worker_args(ap, worker_id="decode-0", kv_cache_mb=512)
    ap.add_argument("--colocated", action="store_true", help="prefill every request here (classic server)")
    ap.add_argument("--local-prefill-threshold", type=int, default=0,
                    help="prompts shorter than this many tokens are prefilled here (0: off)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prefill-chunk-tokens", type=int, default=512,
                    help="prompts this worker prefills itself (colocated, logprob requests, short prompts) go at "
                         "most this many tokens per pass, so running streams stall one chunk at most (0: whole "
                         "prompts)")
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--admission-timeout-s", type=float, default=30.0)
    ap.add_argument("--kv-timeout-s", type=float, default=120.0,
                    help="how long a remote prefill (queue, compute, KV transfer) may take before it is retried")
    ap.add_argument("--kv-backend", default="auto", choices=("auto", "grpc", "shm", "ray"),
                    help="how prefill workers ship KV here: grpc (streamed to this worker's port), shm (same-host "
                         "shared memory), ray (object store), or auto: when the prefill worker is on this host, "
                         "cuda_ipc (device to device) if both KV caches are on CUDA, else shm (logged); grpc "
                         "across hosts (default)")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the K/V blocks of received prompts; a later prompt with the same prefix has only "
                         "the blocks this worker lacks shipped (default on)")
    ap.add_argument("--kv-target", default="",
                    help="where prefill workers send KV (default: this worker's gRPC address; "
                         "ray:<actor name> for the ray backend)")
    ap.add_argument("--kv-checksum", nargs="?", const="xxh3", default="", choices=("xxh3", "crc32"),
                    help="shm backend: prefill workers send a checksum of the blocks (xxh3 when no algorithm is "
                         "named), checked here over the copied bytes; the gRPC stream always checksums every "
                         "frame (see docs/security.md for the cost)")
    add_observability_args(ap)
    add_engine_args(ap)
    add_config_arg(ap)
    return ap


def frame_receive_bytes() -> int:
    """Largest KV frame message this worker takes (its receive limit is at least that)."""
    return max(size for key, size in grpc_message_options() if key == "grpc.max_receive_message_length")


def start_worker(args: argparse.Namespace) -> StartedWorker:
    """Load the model, build the worker, its KV receiver and gRPC server, start serving on
    args.host:args.port. Shared by `main` (a process) and the Ray actor (`cluster.ray_actors`).
    ValueError before loading anything when args.host is beyond loopback without internal credentials."""
    apply_internal_credentials(args)
    check_bind_allowed(args.host)
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                          kv_cache_memory_mb=args.kv_cache_mb, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_batched_tokens, prefix_caching=args.prefix_caching,
                          prefill_chunk_tokens=args.prefill_chunk_tokens or None)
    config, loaded = load_worker_model(args, config)
    metrics = WorkerMetrics()
    injected = InjectedFaults.from_env()  # tests only (engine/fault_injection.py)
    worker = DecodeWorker(loaded, config, admission_timeout_s=args.admission_timeout_s, metrics=metrics,
                          die_after_steps=injected.loop_death_after_steps,
                          step_delay_s=injected.step_delay_ms / 1000)
    endpoint = start_metrics_endpoint(metrics.registry, args.metrics_port)
    kv_receiver = KvTransferServicer()
    drain = Drain()
    server = make_server(control_threads=32, options=receive_options(frame_receive_bytes()), name=args.worker_id,
                         limits=call_limits(args))
    address = bind(server, args.host, args.port)
    servicer = DecodeServicer(worker, kv_receiver, args.worker_id, address, args.colocated,
                              args.local_prefill_threshold, args.request_timeout_s, args.kv_timeout_s, drain,
                              kv_backend=args.kv_backend, kv_target=args.kv_target or address,
                              kv_checksum=args.kv_checksum)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    worker_pb2_grpc.add_KvEventsServicer_to_server(KvEventsServicer(args.worker_id, lambda: worker.engine.kv_events),
                                                  server)
    kv_receiver.add_to_server(server)
    return start_serving(server, address, drain, worker.idle, lambda: worker.dead_reason, args.drain_timeout_s,
                         stops=(kv_receiver.close, worker.stop), endpoint=endpoint,
                         extras={"servicer": servicer, "kv_receiver": kv_receiver})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_worker_process(args, lambda: start_worker(args), role="colocated" if args.colocated else "decode")


if __name__ == "__main__":
    main()
