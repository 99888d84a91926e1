"""`python -m pdserve.elastic_worker --role {prefill,decode,colocated} [flags]`: a worker process that can
change role at runtime (RoleControl.SetRole; `pdserve role`), with its model loaded once.

Takes the flags of both `python -m pdserve.prefill_worker` and `python -m pdserve.decode_worker` (each role reads
its own; shared ones such as --model, --kv-cache-mb and --block-size are one value for both), or
``--config FILE``: {"prefill": <prefill document>, "decode": <decode document>} as `pdserve serve
--elastic` writes it (flags given as well override it). Serves
DecodeWorker, PrefillWorker, KvTransfer, RoleControl and health on one port; the READY line names
the starting role.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pdserve.decode_worker import process as decode_main
from pdserve.elastic_worker.servicer import (
    ElasticDecodeServicer,
    ElasticPrefillServicer,
    RoleControlServicer,
)
from pdserve.elastic_worker.worker import ROLES, ElasticSettings, ElasticWorker, prefill_config_of
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import build_cache
from pdserve.engine.metrics import WorkerMetrics
from pdserve.kv_transfer import KvTransferServicer
from pdserve.kv_transfer.modelled import install_modelled_links
from pdserve.limits import receive_options
from pdserve.prefill_worker import process as prefill_main
from pdserve.process_config import namespace_from_document
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


def parse_args(argv: list[str] | None = None, document: dict[str, Any] | None = None,
               ) -> tuple[str, argparse.Namespace, argparse.Namespace]:
    """(role, prefill flags, decode flags); exits with status 2 on a flag neither role knows.

    `document` (or the JSON file of ``--config``): {"prefill": {...}, "decode": {...}}, each role's
    process document (`deploy_config.worker_document`), validated by that role's parser; flags on
    the command line override both."""
    argv = list(sys.argv[1:] if argv is None else argv)
    role_parser = argparse.ArgumentParser(prog="python -m pdserve.elastic_worker", description=__doc__, add_help=False)
    role_parser.add_argument("--role", choices=ROLES, required=True, help="the role to start in")
    role_parser.add_argument("--config", default=None, metavar="FILE",
                             help='JSON {"prefill": {...}, "decode": {...}}: each role\'s process document')
    role_args, rest = role_parser.parse_known_args(argv)
    if document is None and role_args.config:
        try:
            document = json.loads(Path(role_args.config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            role_parser.error(f"--config {role_args.config}: {exc}")
    parsers = {"prefill": prefill_main.build_parser(), "decode": decode_main.build_parser()}
    bases: dict[str, argparse.Namespace | None] = {"prefill": None, "decode": None}
    if document is not None:
        if not isinstance(document, dict) or set(document) != set(parsers):
            role_parser.error('--config: expected {"prefill": {...}, "decode": {...}}')
        for kind, parser in parsers.items():
            try:
                bases[kind] = namespace_from_document(parser, document[kind])
            except ValueError as exc:
                role_parser.error(f"--config: {kind}: {exc}")
    for parser in parsers.values():
        parser.allow_abbrev = False
    (prefill_args, prefill_rest), (decode_args, decode_rest) = (
        parser.parse_known_args(rest, namespace=bases[kind]) for kind, parser in parsers.items())
    unknown = [a for a in prefill_rest if a in decode_rest]
    if unknown:
        role_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return role_args.role, prefill_args, decode_args


def start_worker(role: str, prefill_args: argparse.Namespace, decode_args: argparse.Namespace) -> StartedWorker:
    """Load the model once, allocate the KV cache once, serve every role's services on one port,
    starting in `role`. Shared by `main` and the Ray worker actor."""
    args = decode_args  # the shared flags (model, address, KV memory, engine) are read from here
    apply_internal_credentials(args)
    check_bind_allowed(args.host)
    decode_config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                                 kv_cache_memory_mb=args.kv_cache_mb, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_batched_tokens, prefix_caching=args.prefix_caching)
    decode_config, loaded = load_worker_model(args, decode_config)
    chunk_tokens = prefill_args.prefill_chunk_tokens or None
    sim = args.engine == "sim"
    if sim:
        chunk_tokens = loaded.model.profile.engine.prefill_chunk_tokens
        install_modelled_links(loaded.model.profile, args.speedup)
    prefill_config = prefill_config_of(decode_config, prefill_args.max_batched_tokens, sim)
    kv_cache = build_cache(loaded, decode_config, shared=prefill_args.shared_kv_cache)
    metrics = WorkerMetrics()
    endpoint = start_metrics_endpoint(metrics.registry, args.metrics_port)
    kv_receiver = KvTransferServicer()
    drain = Drain()
    server = make_server(control_threads=32, options=receive_options(decode_main.frame_receive_bytes()),
                         name=args.worker_id, limits=call_limits(args))
    address = bind(server, args.host, args.port)
    settings = ElasticSettings(args.worker_id, address, prefill_args, decode_args, prefill_config, decode_config,
                               chunk_tokens)
    worker = ElasticWorker(loaded, kv_cache, settings, role, kv_receiver, metrics, drain)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(ElasticDecodeServicer(worker), server)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(ElasticPrefillServicer(worker), server)
    worker_pb2_grpc.add_RoleControlServicer_to_server(RoleControlServicer(worker), server)
    worker_pb2_grpc.add_KvEventsServicer_to_server(
        KvEventsServicer(args.worker_id, lambda: worker.core.worker.engine.kv_events), server)
    kv_receiver.add_to_server(server)
    return start_serving(server, address, drain, worker.idle, worker.dead_reason, args.drain_timeout_s,
                         stops=(kv_receiver.close, worker.stop), endpoint=endpoint,
                         extras={"worker": worker, "kv_receiver": kv_receiver})


def main(argv: list[str] | None = None) -> None:
    role, prefill_args, decode_args = parse_args(argv)
    run_worker_process(decode_args, lambda: start_worker(role, prefill_args, decode_args), role=role, switchable=True)


if __name__ == "__main__":
    main()
