"""`python -m pdserve.elastic_worker --role {prefill,decode,colocated} [flags]`: a worker process that can
change role at runtime (RoleControl.SetRole; `pdserve role`), with its model loaded once.

Takes the flags of both `python -m pdserve.prefill_worker` and `python -m pdserve.decode_worker` (each role reads
its own; shared ones such as --model, --kv-cache-mb and --block-size are one value for both), or
``--config FILE``: {"prefill": <prefill document>, "decode": <decode document>} as `pdserve serve
--elastic` writes it (flags given as well override it); `elastic_worker.config` parses them into the
typed `ElasticWorkerConfig` that `start_worker` takes. Serves DecodeWorker, PrefillWorker, KvTransfer,
RoleControl and health on one port; the READY line names the starting role.
"""

from __future__ import annotations

from pdserve.decode_worker import process as decode_main
from pdserve.elastic_worker.config import ElasticWorkerConfig, parse_args
from pdserve.elastic_worker.servicer import (
    ElasticDecodeServicer,
    ElasticPrefillServicer,
    RoleControlServicer,
)
from pdserve.elastic_worker.worker import ElasticSettings, ElasticWorker, prefill_config_of
from pdserve.engine.llm_engine import build_cache
from pdserve.engine.metrics import WorkerMetrics
from pdserve.kv_transfer import KvTransferServicer
from pdserve.kv_transfer.modelled import install_modelled_links
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

__all__ = ["ElasticWorkerConfig", "main", "parse_args", "start_worker"]


def start_worker(config: ElasticWorkerConfig) -> StartedWorker:
    """Load the model once, allocate the KV cache once, serve every role's services on one port,
    starting in `config.role`. Shared by `main` and the Ray worker actor."""
    shared = config.decode  # what both roles share (model, address, KV memory, engine) is read from here
    apply_internal_credentials(shared)
    check_bind_allowed(shared.host)
    model, pool = shared.model, shared.pool
    decode_config, loaded = load_worker_model(
        model, pool, max_num_seqs=pool.max_num_seqs, prefix_caching=pool.prefix_caching
    )
    chunk_tokens = config.prefill.pool.chunk_tokens or None
    sim = model.engine == "sim"
    if sim:
        chunk_tokens = loaded.model.profile.engine.prefill_chunk_tokens
        install_modelled_links(loaded.model.profile, model.speedup)
    prefill_config = prefill_config_of(decode_config, config.prefill.pool.max_batched_tokens, sim)
    kv_cache = build_cache(loaded, decode_config, shared=config.prefill.kv.shared_cache)
    metrics = WorkerMetrics()
    endpoint = start_metrics_endpoint(metrics.registry, shared.metrics_port)
    kv_receiver = KvTransferServicer()
    drain = Drain()
    server = make_server(
        control_threads=32,
        options=receive_options(decode_main.frame_receive_bytes()),
        name=shared.worker_id,
        limits=call_limits(shared),
    )
    address = bind(server, shared.host, shared.port)
    settings = ElasticSettings(
        shared.worker_id, address, config.prefill, config.decode, prefill_config, decode_config, chunk_tokens
    )
    worker = ElasticWorker(loaded, kv_cache, settings, config.role, kv_receiver, metrics, drain)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(ElasticDecodeServicer(worker), server)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(ElasticPrefillServicer(worker), server)
    worker_pb2_grpc.add_RoleControlServicer_to_server(RoleControlServicer(worker), server)
    worker_pb2_grpc.add_KvEventsServicer_to_server(
        KvEventsServicer(shared.worker_id, lambda: worker.core.worker.engine.kv_events), server
    )
    kv_receiver.add_to_server(server)
    return start_serving(
        server,
        address,
        drain,
        worker.idle,
        worker.dead_reason,
        pool.drain_timeout_s,
        stops=(kv_receiver.close, worker.stop),
        endpoint=endpoint,
        extras={"worker": worker, "kv_receiver": kv_receiver},
    )


def main(argv: list[str] | None = None) -> None:
    config = ElasticWorkerConfig.from_args(*parse_args(argv))
    run_worker_process(config.decode, lambda: start_worker(config), role=config.role, switchable=True)


if __name__ == "__main__":
    main()
