"""`python -m pdserve.prefill_worker`: one prefill worker process serving gRPC on loopback by default.

`start_worker` takes the typed `PrefillWorkerConfig` (`prefill_worker.config`, which also holds the
command line: `parse_args`, then `PrefillWorkerConfig.from_args`)."""

from __future__ import annotations

from pdserve.engine.fault_injection import InjectedFaults
from pdserve.engine.metrics import WorkerMetrics
from pdserve.kv_transfer.modelled import install_modelled_links
from pdserve.limits import receive_options
from pdserve.prefill_worker.config import PrefillWorkerConfig, build_parser, parse_args
from pdserve.prefill_worker.faults import FaultInjector
from pdserve.prefill_worker.servicer import PrefillServicer
from pdserve.prefill_worker.worker import PrefillWorker
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

__all__ = ["PrefillWorkerConfig", "build_parser", "main", "parse_args", "start_worker"]


def start_worker(config: PrefillWorkerConfig) -> StartedWorker:
    """Load the model, build the worker and its gRPC server, start serving on config.host:config.port.
    Shared by `main` (a process) and the Ray actor (`cluster.ray_actors`).
    ValueError before loading anything when config.host is beyond loopback without internal credentials."""
    apply_internal_credentials(config)
    check_bind_allowed(config.host)
    model, pool = config.model, config.pool
    engine_config, loaded = load_worker_model(model, pool)
    chunk_tokens = pool.chunk_tokens or None
    if model.engine == "sim":  # the profile's limits; KV hand-offs take its modelled time
        chunk_tokens = loaded.model.profile.engine.prefill_chunk_tokens
        install_modelled_links(loaded.model.profile, model.speedup)
    metrics = WorkerMetrics()
    injected = InjectedFaults.from_env()  # tests only (engine/fault_injection.py)
    faults = FaultInjector(injected.kv_fault, injected.kv_fault_count)
    worker = PrefillWorker(
        loaded,
        engine_config,
        transfer_timeout_s=pool.kv_timeout_s,
        metrics=metrics,
        faults=faults,
        prefill_chunk_tokens=chunk_tokens,
        prefix_caching=pool.prefix_caching,
        kv_streaming=config.kv.streaming,
        shared_kv_cache=config.kv.shared_cache,
    )
    endpoint = start_metrics_endpoint(metrics.registry, config.metrics_port)
    drain = Drain()
    server = make_server(
        control_threads=32, options=receive_options(), name=config.worker_id, limits=call_limits(config)
    )
    address = bind(server, config.host, config.port)
    servicer = PrefillServicer(worker, config.worker_id, address, pool.request_timeout_s, drain)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    worker_pb2_grpc.add_KvEventsServicer_to_server(
        KvEventsServicer(config.worker_id, lambda: worker.engine.kv_events), server
    )
    return start_serving(
        server,
        address,
        drain,
        worker.idle,
        lambda: "" if worker.loop_alive() else "engine loop died",
        pool.drain_timeout_s,
        stops=(worker.stop,),
        endpoint=endpoint,
        extras={"servicer": servicer},
    )


def main(argv: list[str] | None = None) -> None:
    config = PrefillWorkerConfig.from_args(parse_args(argv))
    run_worker_process(config, lambda: start_worker(config), role="prefill")


if __name__ == "__main__":
    main()
