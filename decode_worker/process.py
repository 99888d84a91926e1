"""`python -m pdserve.decode_worker`: one decode (or colocated) worker process; gRPC on loopback by default.

Serves DecodeWorker, KvTransfer (the gRPC KV backend's receiver) and health on one port.
`start_worker` takes the typed `DecodeWorkerConfig` (`decode_worker.config`, which also holds the
command line: `parse_args`, then `DecodeWorkerConfig.from_args`).
"""

from __future__ import annotations

from pdserve.decode_worker.config import DecodeWorkerConfig, build_parser, parse_args
from pdserve.decode_worker.servicer import DecodeServicer
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.fault_injection import InjectedFaults
from pdserve.engine.metrics import WorkerMetrics
from pdserve.kv_transfer import KvTransferServicer, grpc_message_options
from pdserve.limits import receive_options
from pdserve.telemetry.prometheus import start_metrics_endpoint
from pdserve.transport import check_bind_allowed
from pdserve.v1 import worker_pb2_grpc
from pdserve.worker.runtime import (
    Drain,
    KvEventsServicer,
    StartedWorker,
    apply_internal_credentials,
    bind,
    call_limits,
    load_worker_model,
    make_server,
    run_worker_process,
    start_serving,
)

__all__ = ["DecodeWorkerConfig", "build_parser", "frame_receive_bytes", "main", "parse_args", "start_worker"]


def frame_receive_bytes() -> int:
    """Largest KV frame message this worker takes (its receive limit is at least that)."""
    return max(size for key, size in grpc_message_options() if key == "grpc.max_receive_message_length")


def start_worker(config: DecodeWorkerConfig) -> StartedWorker:
    """Load the model, build the worker, its KV receiver and gRPC server, start serving on
    config.host:config.port. Shared by `main` (a process) and the Ray actor (`cluster.ray_actors`).
    ValueError before loading anything when config.host is beyond loopback without internal credentials."""
    apply_internal_credentials(config)
    check_bind_allowed(config.host)
    model, pool = config.model, config.pool
    engine_config, loaded = load_worker_model(
        model,
        pool,
        max_num_seqs=pool.max_num_seqs,
        prefix_caching=pool.prefix_caching,
        prefill_chunk_tokens=pool.chunk_tokens or None,
    )
    metrics = WorkerMetrics()
    injected = InjectedFaults.from_env()  # tests only (engine/fault_injection.py)
    worker = DecodeWorker(
        loaded,
        engine_config,
        admission_timeout_s=pool.admission_timeout_s,
        metrics=metrics,
        die_after_steps=injected.loop_death_after_steps,
        step_delay_s=injected.step_delay_ms / 1000,
    )
    endpoint = start_metrics_endpoint(metrics.registry, config.metrics_port)
    kv_receiver = KvTransferServicer()
    drain = Drain()
    server = make_server(
        control_threads=32,
        options=receive_options(frame_receive_bytes()),
        name=config.worker_id,
        limits=call_limits(config),
    )
    address = bind(server, config.host, config.port)
    servicer = DecodeServicer(
        worker,
        kv_receiver,
        config.worker_id,
        address,
        config.colocated,
        pool.local_prefill_threshold,
        pool.request_timeout_s,
        pool.kv_timeout_s,
        drain,
        kv_backend=config.kv.backend,
        kv_target=config.kv_target or address,
        kv_checksum=config.kv.checksum,
    )
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    worker_pb2_grpc.add_KvEventsServicer_to_server(
        KvEventsServicer(config.worker_id, lambda: worker.engine.kv_events), server
    )
    kv_receiver.add_to_server(server)
    return start_serving(
        server,
        address,
        drain,
        worker.idle,
        lambda: worker.dead_reason,
        pool.drain_timeout_s,
        stops=(kv_receiver.close, worker.stop),
        endpoint=endpoint,
        extras={"servicer": servicer, "kv_receiver": kv_receiver},
    )


def main(argv: list[str] | None = None) -> None:
    config = DecodeWorkerConfig.from_args(parse_args(argv))
    run_worker_process(config, lambda: start_worker(config), role=config.role)


if __name__ == "__main__":
    main()
