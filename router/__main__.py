"""``python -m router``: run the router process.

Protocol shared with the worker processes: once serving, print exactly one line to stdout,
``PDSERVE_READY {"address": "HOST:PORT", "worker_id": "router", "pid": N}`` (plus ``http_address`` and
``metrics_address`` when those are on), and flush; logs go to stderr (``--log-format text|json``).
SIGTERM / SIGINT stop the server gracefully (open streams get 5 s) and exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from router.auth import load_token
from router.config import RouterConfig
from router.policies import POLICY_NAMES
from router.server import serve
from telemetry.logs import LOG_FORMATS, configure_logging
from telemetry.prometheus import start_metrics_endpoint

READY_PREFIX = "PDSERVE_READY"
STOP_GRACE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m router", description="pdserve router (gRPC).")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one")
    parser.add_argument("--prefill", action="append", default=[], metavar="ADDR", help="prefill worker")
    parser.add_argument("--decode", action="append", default=[], metavar="ADDR", help="decode worker")
    parser.add_argument("--colocated", action="append", default=[], metavar="ADDR", help="colocated worker")
    parser.add_argument("--prefill-policy", choices=POLICY_NAMES, default="round_robin")
    parser.add_argument("--decode-policy", choices=POLICY_NAMES, default="round_robin")
    parser.add_argument(
        "--max-stream-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="deadline cap of a decode stream in seconds (default 600)",
    )
    parser.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=256,
        metavar="N",
        help="Generate streams served at once; more get RESOURCE_EXHAUSTED (default 256)",
    )
    parser.add_argument("--max-attempts", type=int, default=3, metavar="N",
                        help="a request is tried on at most N (decode, prefill) pairs when workers fail (default 3)")
    parser.add_argument("--http-port", type=int, default=None, metavar="PORT",
                        help="also serve the OpenAI-compatible HTTP API on this port (0 picks one; default off)")
    parser.add_argument("--model-name", default="default", help="model id the HTTP API serves (default 'default')")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="serve Prometheus /metrics on this loopback port (default 0: off)")
    parser.add_argument("--auth-token-file", default=None, metavar="FILE",
                        help="require 'authorization: Bearer <token>' on the public API (token: first line of "
                             "FILE; or set PDSERVE_AUTH_TOKEN)")
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="serve the public gRPC port over TLS")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="text lines or JSON lines")
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
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
        max_attempts=args.max_attempts,
        auth_token=load_token(args.auth_token_file, os.environ.get("PDSERVE_AUTH_TOKEN")),
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        model_name=args.model_name,
    )


def ready_line(address: str, worker_id: str, pid: int, **extra: Any) -> str:
    """The one stdout line announcing a serving pdserve process."""
    return f"{READY_PREFIX} {json.dumps({'address': address, 'worker_id': worker_id, 'pid': pid, **extra})}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("router", args.log_level, args.log_format)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    server, port = serve(config)
    extras = start_extras(config, server.bridge_port or port, server.metrics.prom.registry)
    print(ready_line(server.address, "router", os.getpid(), **extras.addresses), flush=True)
    stop.wait()
    logging.getLogger(__name__).info("stopping (grace %.0f s)", STOP_GRACE_S)
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


def start_extras(config: RouterConfig, grpc_port: int, registry: Any) -> Extras:
    """Start what config asks for besides the gRPC server (imported lazily: aiohttp only when asked)."""
    extras = Extras()
    endpoint = start_metrics_endpoint(registry, config.metrics_port)
    if endpoint is not None:
        extras.addresses["metrics_address"] = f"{endpoint.host}:{endpoint.port}"
        extras.on_stop(endpoint.stop)
    if config.http_port is not None:
        from router.http_api import OpenAIHttpServer, loopback_target

        http = OpenAIHttpServer(loopback_target(config.host, grpc_port), config.model_name, config.host,
                                config.http_port, max_streams=config.max_concurrent_streams,
                                timeout_s=config.max_stream_timeout_s)
        http_port = http.start()
        extras.addresses["http_address"] = f"{config.host}:{http_port}"
        extras.on_stop(http.stop)
    return extras


if __name__ == "__main__":
    raise SystemExit(main())
