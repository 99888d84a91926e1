"""`python -m pdserve.prefill_worker`: one prefill worker process serving gRPC on loopback by default."""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.fault_injection import InjectedFaults
from pdserve.engine.metrics import WorkerMetrics
from pdserve.engine.sim_runner import add_engine_args
from pdserve.kv_transfer.modelled import install_modelled_links
from pdserve.limits import receive_options
from pdserve.prefill_worker.faults import FaultInjector
from pdserve.prefill_worker.servicer import PrefillServicer
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.process_config import add_config_arg, parse_with_document
from pdserve.settings import KvTransferSection, PrefillPool, add_section_flags
from pdserve.telemetry.prometheus import start_metrics_endpoint
from pdserve.transport import check_bind_allowed
from pdserve.v1 import worker_pb2_grpc
from pdserve.worker.runtime import (
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


def parse_args(argv: list[str] | None = None, document: dict[str, Any] | None = None) -> argparse.Namespace:
    """This worker's options: defaults < `document` (or the JSON file of --config) < flags."""
    return parse_with_document(build_parser(), argv, document)


def build_parser() -> argparse.ArgumentParser:
    """This worker's command-line flags (also read by `elastic_worker`, which takes both roles' flags)."""
    ap = argparse.ArgumentParser(prog="python -m pdserve.prefill_worker", description=__doc__)
    add_worker_args(ap, worker_id="prefill-0", pool=PrefillPool)
    add_section_flags(ap, PrefillPool, ("chunk_tokens",))
    add_section_flags(ap, KvTransferSection, ("streaming", "shared_cache"))
    add_observability_args(ap)
    add_engine_args(ap)
    add_config_arg(ap)
    return ap


def start_worker(args: argparse.Namespace) -> StartedWorker:
    """Load the model, build the worker and its gRPC server, start serving on args.host:args.port.
    Shared by `main` (a process) and the Ray actor (`cluster.ray_actors`).
    ValueError before loading anything when args.host is beyond loopback without internal credentials."""
    apply_internal_credentials(args)
    check_bind_allowed(args.host)
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                          kv_cache_memory_mb=args.kv_cache_mb, max_num_batched_tokens=args.max_batched_tokens)
    config, loaded = load_worker_model(args, config)
    chunk_tokens = args.prefill_chunk_tokens or None
    if args.engine == "sim":  # the profile's limits; KV hand-offs take its modelled time
        chunk_tokens = loaded.model.profile.engine.prefill_chunk_tokens
        install_modelled_links(loaded.model.profile, args.speedup)
    metrics = WorkerMetrics()
    injected = InjectedFaults.from_env()  # tests only (engine/fault_injection.py)
    faults = FaultInjector(injected.kv_fault, injected.kv_fault_count)
    worker = PrefillWorker(loaded, config, transfer_timeout_s=args.kv_timeout_s, metrics=metrics, faults=faults,
                           prefill_chunk_tokens=chunk_tokens,
                           prefix_caching=args.prefix_caching, kv_streaming=args.kv_streaming,
                           shared_kv_cache=args.shared_kv_cache)
    endpoint = start_metrics_endpoint(metrics.registry, args.metrics_port)
    drain = Drain()
    server = make_server(control_threads=32, options=receive_options(), name=args.worker_id,
                         limits=call_limits(args))
    address = bind(server, args.host, args.port)
    servicer = PrefillServicer(worker, args.worker_id, address, args.request_timeout_s, drain)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    worker_pb2_grpc.add_KvEventsServicer_to_server(KvEventsServicer(args.worker_id, lambda: worker.engine.kv_events),
                                                  server)
    return start_serving(server, address, drain, worker.idle,
                         lambda: "" if worker.loop_alive() else "engine loop died", args.drain_timeout_s,
                         stops=(worker.stop,), endpoint=endpoint, extras={"servicer": servicer})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_worker_process(args, lambda: start_worker(args), role="prefill")


if __name__ == "__main__":
    main()
