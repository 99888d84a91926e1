"""The router process (``python -m pdserve.router``, and the Ray router actor): its flags and start-up.

Protocol shared with the worker processes: once serving, print exactly one line to stdout,
``PDSERVE_READY {"address": "HOST:PORT", "worker_id": "router", "pid": N}`` (plus ``http_address`` and
``metrics_address`` when those are on), and flush; logs go to stderr (``--log-format text|json``).
SIGTERM / SIGINT stop the server gracefully and exit 0: new requests are refused (UNAVAILABLE, HTTP
503), open streams get ``--router-drain-timeout`` seconds (5) to finish and then fail UNAVAILABLE.
Started by a launcher (PDSERVE_SUPERVISED=1) only SIGTERM stops it: the launcher stops it first.

Start-up has the workers' shape: `parse_args` reads the flags (over a process document), then
`RouterProcess.from_args` turns them into the typed, frozen config (`RouterConfig` plus the process's
logs and internal credential) that `main` and the Ray router actor start from.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from pdserve.process_config import add_config_arg, parse_with_document
from pdserve.router.config import RouterConfig
from pdserve.router.server import RouterServer, serve
from pdserve.serving import on_stop_signal, ready_line
from pdserve.settings import ObservabilitySection, RouterSection, SecuritySection, add_section_flags
from pdserve.telemetry.logs import configure_logging
from pdserve.telemetry.memory import bound_heap
from pdserve.telemetry.prometheus import start_metrics_endpoint
from pdserve.transport import is_loopback, load_tenant_tokens, load_token, use_internal_token_file

STOP_GRACE_S = 5.0


#: The router's settings of the deployment's other sections (its own are every RouterSection field).
ROUTER_SETTINGS = (
    (ObservabilitySection, ("metrics_host", "log_level", "log_format")),
    (SecuritySection, ("auth_token_file", "auth_tokens_file", "tls_cert", "tls_key", "internal_token_file")),
)


def build_parser() -> argparse.ArgumentParser:
    """The router's flags: its worker addresses and what only a launcher knows (the tokenizer folder,
    the served model's name, restart waits, the metrics port) by hand, defaulting to RouterConfig's;
    every deployment setting generated from its section, with that section's default."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.router", description="pdserve router (gRPC).")
    parser.add_argument("--prefill", action="append", default=[], metavar="ADDR", help="prefill worker")
    parser.add_argument("--decode", action="append", default=[], metavar="ADDR", help="decode worker")
    parser.add_argument("--colocated", action="append", default=[], metavar="ADDR", help="colocated worker")
    add_section_flags(parser, RouterSection, [f.name for f in dataclasses.fields(RouterSection)])
    parser.add_argument(
        "--worker-restart-wait",
        type=float,
        default=RouterConfig.worker_restart_wait_s,
        metavar="S",
        help="when no worker of a stage is healthy but some are still registered (their launcher "
        "restarts them), requests wait up to S seconds for one instead of failing (default 0: "
        "fail at once; `pdserve serve --ray` sets it from ray.restart_wait_s)",
    )
    parser.add_argument(
        "--tokenizer",
        default=RouterConfig.tokenizer,
        metavar="DIR",
        help="model folder whose tokenizer the router hashes prompts with, for the kv_aware and "
        "kv_oracle policies (the launcher passes the served model's)",
    )
    parser.add_argument(
        "--model-name",
        default=RouterConfig.model_name,
        help="model id the HTTP API serves (default 'default'; the launcher passes the served model's name)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=RouterConfig.metrics_port,
        metavar="PORT",
        help="serve Prometheus /metrics on this port (default 0: off; -1: any free port, announced in the ready line)",
    )
    for section, names in ROUTER_SETTINGS:
        add_section_flags(parser, section, names)
    add_config_arg(parser)
    return parser


def parse_args(argv: list[str] | None = None, document: dict[str, Any] | None = None) -> argparse.Namespace:
    """The router's options: defaults < `document` (or the JSON file of --config) < flags."""
    return parse_with_document(build_parser(), argv, document)


def config_from_args(
    args: argparse.Namespace, auth_token: str | None = None, auth_tokens: dict[str, str] | None = None
) -> RouterConfig:
    """RouterConfig of parsed options; `auth_token` and `auth_tokens` (token -> tenant), the Ray
    launcher's, read on its driver, win over --auth-token-file, PDSERVE_AUTH_TOKEN and --auth-tokens-file."""
    return RouterConfig(
        host=args.host,
        port=args.port,
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        colocated=tuple(args.colocated),
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        max_stream_timeout_s=args.max_stream_timeout,
        max_concurrent_streams=args.max_concurrent_streams,
        max_queued_requests=args.max_queued_requests,
        max_attempts=args.max_attempts,
        drain_timeout_s=args.router_drain_timeout,
        decode_mux=args.decode_mux,
        worker_restart_wait_s=args.worker_restart_wait,
        tokenizer=args.tokenizer,
        kv_request_tokens=args.kv_aware_request_tokens,
        kv_kv_tokens=args.kv_aware_kv_tokens,
        conditional_disagg_tokens=args.conditional_disagg_tokens,
        slo_ttft_s=args.slo_ttft,
        auth_token=auth_token or load_token(args.auth_token_file, os.environ.get("PDSERVE_AUTH_TOKEN")),
        auth_tokens=tuple((auth_tokens or _tenant_tokens(args.auth_tokens_file)).items()),
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        model_name=args.model_name,
        grpc_calls_per_peer=args.grpc_calls_per_peer,
        grpc_calls_total=args.grpc_calls_total,
        grpc_connection_idle_s=args.grpc_connection_idle,
        grpc_connection_age_s=args.grpc_connection_age,
    )


def _tenant_tokens(path: str | None) -> dict[str, str]:
    return load_tenant_tokens(path) if path else {}


@dataclass(frozen=True)
class RouterProcess:
    """The typed config of a router process: the router's own (`RouterConfig`), the process's logs
    (`observability.log_level`, `log_format`) and its internal token file (None: the environment's)."""

    router: RouterConfig
    observability: ObservabilitySection = field(default_factory=ObservabilitySection)
    internal_token_file: str | None = None

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, auth_token: str | None = None, auth_tokens: dict[str, str] | None = None
    ) -> RouterProcess:
        """The config of parsed options (`parse_args`); reads the token files they name (OSError,
        ValueError); `auth_token` and `auth_tokens` as in `config_from_args`."""
        return cls(
            config_from_args(args, auth_token, auth_tokens),
            ObservabilitySection(log_level=args.log_level, log_format=args.log_format),
            args.internal_token_file,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        process = RouterProcess.from_args(args)
        use_internal_token_file(process.internal_token_file)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging("router", process.observability.log_level, process.observability.log_format)
    bound_heap()
    config = process.router
    stop = threading.Event()
    on_stop_signal(stop.set)
    server, _port = serve(config)
    extras = start_extras(config, server)
    # start-up objects (modules, grpc, aiohttp, protobuf descriptors) go to the permanent generation:
    # the collections that the per-token garbage of the relay triggers no longer scan them
    gc.freeze()
    print(ready_line(server.address, "router", **extras.addresses), flush=True)
    stop.wait()
    log = logging.getLogger(__name__)
    log.info("stopping: refusing new requests, open ones get %g s (router.drain_timeout_s)", config.drain_timeout_s)
    ended = server.drain(config.drain_timeout_s)
    log.info("drained%s", f" ({ended} requests still open were ended: UNAVAILABLE)" if ended else "")
    extras.stop()
    server.stop(STOP_GRACE_S)
    return 0


class Extras:
    """The optional front ends of a router process: the OpenAI HTTP API and the /metrics endpoint."""

    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}
        self._stops: list[Any] = []

    def on_stop(self, stop: Any) -> None:
        self._stops.append(stop)

    def stop(self) -> None:
        for stop in self._stops:
            stop()


def start_extras(config: RouterConfig, server: RouterServer) -> Extras:
    """Start the /metrics endpoint when config asks for it; name the HTTP API the server started."""
    extras = Extras()
    tls = (config.tls_cert_file, config.tls_key_file) if config.tls_cert_file and config.tls_key_file else None
    guarded = not is_loopback(config.metrics_host)  # beyond loopback: bearer token (config checked it is set)
    endpoint = start_metrics_endpoint(
        server.metrics.prom.registry,
        config.metrics_port,
        config.metrics_host,
        config.auth_token if guarded else None,
        tls if guarded else None,
    )
    if endpoint is not None:
        extras.addresses["metrics_address"] = f"{endpoint.host}:{endpoint.port}"
        extras.on_stop(endpoint.stop)
    if server.http_port is not None:
        extras.addresses["http_address"] = f"{config.host}:{server.http_port}"
    return extras


if __name__ == "__main__":
    raise SystemExit(main())
