"""``python -m pdserve.router``: run the router process.

Protocol shared with the worker processes: once serving, print exactly one line to stdout,
``PDSERVE_READY {"address": "HOST:PORT", "worker_id": "router", "pid": N}`` (plus ``http_address`` and
``metrics_address`` when those are on), and flush; logs go to stderr (``--log-format text|json``).
SIGTERM / SIGINT stop the server gracefully (open streams get 5 s) and exit 0.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from typing import Any

from pdserve.limits import GRPC_CALLS_PER_PEER, GRPC_CALLS_TOTAL
from pdserve.process_config import add_config_arg, parse_with_document
from pdserve.router.auth import load_tenant_tokens
from pdserve.router.config import RouterConfig
from pdserve.router.policies import POLICY_NAMES
from pdserve.router.server import RouterServer, serve
from pdserve.serving import ready_line
from pdserve.telemetry.logs import LOG_FORMATS, configure_logging
from pdserve.telemetry.memory import bound_heap
from pdserve.telemetry.prometheus import start_metrics_endpoint
from pdserve.transport import is_loopback, load_token, use_internal_token_file

STOP_GRACE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pdserve.router", description="pdserve router (gRPC).")
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
        help="requests at workers at once; more wait in the admission queue (default 256)",
    )
    parser.add_argument("--max-queued-requests", type=int, default=4096, metavar="N",
                        help="requests waiting for a decode slot; one more is refused with RESOURCE_EXHAUSTED "
                             "(HTTP 429, with a retry-after hint) (default 4096)")
    parser.add_argument("--decode-mux", action="store_true",
                        help="send every request to a decode worker on one GenerateMux stream per worker, which "
                             "carries the tokens of a decode step in one message (default: one Generate call per "
                             "request)")
    parser.add_argument("--max-attempts", type=int, default=3, metavar="N",
                        help="a request is tried on at most N (decode, prefill) pairs when workers fail (default 3)")
    parser.add_argument("--worker-restart-wait", type=float, default=0.0, metavar="S",
                        help="when no worker of a stage is healthy but some are still registered (their launcher "
                             "restarts them), requests wait up to S seconds for one instead of failing (default 0: "
                             "fail at once; `pdserve serve --ray` sets it from router.worker_restart_wait_s)")
    parser.add_argument("--tokenizer", default="", metavar="DIR",
                        help="model folder whose tokenizer the router hashes prompts with, for the kv_aware and "
                             "kv_oracle policies (the launcher passes the served model's)")
    parser.add_argument("--kv-aware-request-tokens", type=float, default=128.0, metavar="T",
                        help="kv_aware: prompt tokens of work one running request on a decode worker counts as "
                             "(default 128)")
    parser.add_argument("--kv-aware-kv-tokens", type=float, default=512.0, metavar="T",
                        help="kv_aware: prompt tokens of work a full KV pool on a decode worker counts as "
                             "(default 512)")
    parser.add_argument("--conditional-disagg-tokens", type=int, default=0, metavar="N",
                        help="with a KV-aware policy: a request with fewer than N prompt tokens uncached on its "
                             "decode worker is prefilled there, not on a prefill worker (default 0: always "
                             "disaggregate)")
    parser.add_argument("--slo-ttft", type=float, default=0.0, metavar="S",
                        help="refuse (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After) a request whose predicted "
                             "TTFT exceeds S seconds, unless it is best_effort (default 0: off)")
    parser.add_argument("--http-port", type=int, default=None, metavar="PORT",
                        help="also serve the OpenAI-compatible HTTP API on this port (0 picks one; default off)")
    parser.add_argument("--model-name", default="default", help="model id the HTTP API serves (default 'default')")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="serve Prometheus /metrics on this port (default 0: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="interface of /metrics (default 127.0.0.1, open); any other needs an auth token, "
                             "and scrapes then need 'Authorization: Bearer <token>'")
    parser.add_argument("--auth-token-file", default=None, metavar="FILE",
                        help="require 'authorization: Bearer <token>' on the public API (token: first line of "
                             "FILE; or set PDSERVE_AUTH_TOKEN)")
    parser.add_argument("--auth-tokens-file", default=None, metavar="FILE",
                        help="several public API tokens, one 'TENANT TOKEN' pair per line: each tenant's requests "
                             "get their own prefix-cache namespace (instead of --auth-token-file)")
    parser.add_argument("--grpc-calls-per-peer", type=int, default=GRPC_CALLS_PER_PEER, metavar="N",
                        help="open gRPC calls one client host may hold; one more is refused with "
                             f"RESOURCE_EXHAUSTED (default {GRPC_CALLS_PER_PEER})")
    parser.add_argument("--grpc-calls-total", type=int, default=GRPC_CALLS_TOTAL, metavar="N",
                        help=f"open gRPC calls of all clients together (default {GRPC_CALLS_TOTAL})")
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="serve the public gRPC port over TLS")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    parser.add_argument("--internal-token-file", default=None, metavar="FILE",
                        help="internal token the workers require (first line of FILE; or set PDSERVE_INTERNAL_TOKEN)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="text lines or JSON lines")
    add_config_arg(parser)
    return parser


def parse_args(argv: list[str] | None = None, document: dict[str, Any] | None = None) -> argparse.Namespace:
    """The router's options: defaults < `document` (or the JSON file of --config) < flags."""
    return parse_with_document(build_parser(), argv, document)


def config_from_args(args: argparse.Namespace, auth_token: str | None = None) -> RouterConfig:
    """RouterConfig of parsed options; `auth_token` (the Ray launcher's, read on its driver) wins over
    --auth-token-file and PDSERVE_AUTH_TOKEN."""
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
        decode_mux=args.decode_mux,
        worker_restart_wait_s=args.worker_restart_wait,
        tokenizer=args.tokenizer,
        kv_request_tokens=args.kv_aware_request_tokens,
        kv_kv_tokens=args.kv_aware_kv_tokens,
        conditional_disagg_tokens=args.conditional_disagg_tokens,
        slo_ttft_s=args.slo_ttft,
        auth_token=auth_token or load_token(args.auth_token_file, os.environ.get("PDSERVE_AUTH_TOKEN")),
        auth_tokens=tuple(load_tenant_tokens(args.auth_tokens_file).items()) if args.auth_tokens_file else (),
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        model_name=args.model_name,
        grpc_calls_per_peer=args.grpc_calls_per_peer,
        grpc_calls_total=args.grpc_calls_total,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("router", args.log_level, args.log_format)
    bound_heap()
    try:
        use_internal_token_file(args.internal_token_file)
        config = config_from_args(args)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    server, _port = serve(config)
    extras = start_extras(config, server)
    # start-up objects (modules, grpc, aiohttp, protobuf descriptors) go to the permanent generation:
    # the collections that the per-token garbage of the relay triggers no longer scan them
    gc.freeze()
    print(ready_line(server.address, "router", **extras.addresses), flush=True)
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


def start_extras(config: RouterConfig, server: RouterServer) -> Extras:
    """Start the /metrics endpoint when config asks for it; name the HTTP API the server started."""
    extras = Extras()
    tls = (config.tls_cert_file, config.tls_key_file) if config.tls_cert_file and config.tls_key_file else None
    guarded = not is_loopback(config.metrics_host)  # beyond loopback: bearer token (config checked it is set)
    endpoint = start_metrics_endpoint(server.metrics.prom.registry, config.metrics_port, config.metrics_host,
                                      config.auth_token if guarded else None, tls if guarded else None)
    if endpoint is not None:
        extras.addresses["metrics_address"] = f"{endpoint.host}:{endpoint.port}"
        extras.on_stop(endpoint.stop)
    if server.http_port is not None:
        extras.addresses["http_address"] = f"{config.host}:{server.http_port}"
    return extras


if __name__ == "__main__":
    raise SystemExit(main())
