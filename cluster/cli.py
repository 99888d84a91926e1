"""The `pdserve` command line: serve a local cluster, generate, show status, fetch the default model.

    pdserve serve [--config deploy.yaml] [--prefill N --decode M] [--colocated K] [--model PATH] [--port P] ...
    pdserve serve --ray [--address ADDR] --prefill N --decode M [--kv-backend ray|grpc] [--gpus-per-worker G]
                  [--placement pack|spread|strict_spread] ...
    pdserve serve --config deploy.yaml --print-config
    pdserve scale --prefill N --decode M [--address ADDR]
    pdserve generate [--url ADDR] [--max-tokens N] [--chat] [--json] [--trace] [--request-id ID] ... PROMPT
    pdserve status [--url ADDR | --address RAY_ADDR] [--json]
    pdserve migrate [--url ADDR] [--to WORKER_ID] REQUEST_ID
    pdserve role [--url ADDR] WORKER_ID {prefill,decode,colocated}
    pdserve serve --elastic | --autoscale --slo ttft_ms=500,tpot_ms=50 [--min-workers N --max-workers M] ...
    pdserve model fetch [--force]
    pdserve bench [--url ADDR] [--rate R] [--num-prompts N] [--input-len 64:512] [--slo ttft_ms=500] ...
    pdserve sweep --workers 2 --rates 0.5,1 [--output-dir DIR] ...
    pdserve plan profile|simulate|validate ...

Exit codes: 0 success, 1 failure (gRPC errors print ``error: <CODE>: <details>`` to stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from pdserve.capacity.cli import add_bench, add_plan, add_sweep
from pdserve.cluster.client import (
    DEFAULT_ADDRESS,
    PdserveClient,
    build_request,
    collect,
    placement_warnings,
    sampling_params,
    status_rows,
)
from pdserve.cluster.deploy_config import DeploymentConfig, add_flags, config_from_args
from pdserve.cluster.elastic_cli import add_role
from pdserve.cluster.local import ClusterStartError, LocalCluster
from pdserve.cluster.migrate_cli import add_migrate
from pdserve.cluster.tables import format_table
from pdserve.cluster.trace_view import trace_lines
from pdserve.constants import REQUEST_TIMEOUT_S
from pdserve.extras import MissingExtra, require
from pdserve.transport import is_loopback
from pdserve.v1 import common_pb2, router_pb2

STATUS_COLUMNS = ("role", "worker_id", "address", "pid", "queue", "kv used/total", "running", "healthy")


def _cmd_model_fetch(args: argparse.Namespace) -> int:
    from pdserve.engine.model_fetch import fetch_default_model

    path = fetch_default_model(force=args.force, progress=lambda s: print(s, file=sys.stderr))
    print(path)
    return 0


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="run a router and workers (local processes, or Ray actors with --ray)",
        description="Run a deployment from one config: a YAML/TOML file (--config), flags on top. Every "
        "setting is listed below by section; `--print-config` shows the effective one. A setting "
        "the mode cannot honour is refused. See docs/configuration.md and examples/.",
    )
    add_flags(serve)
    serve.set_defaults(func=_cmd_serve)


def _add_scale(commands: argparse._SubParsersAction) -> None:
    scale = commands.add_parser("scale", help="resize the pools of a running `serve --ray` deployment")
    scale.add_argument("--prefill", type=int, required=True)
    scale.add_argument("--decode", type=int, required=True)
    scale.add_argument("--address", default="auto", help="Ray cluster of the deployment (default: auto)")
    scale.add_argument("--timeout", type=float, default=900.0, metavar="S")
    scale.set_defaults(func=_cmd_scale)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="stream a generation from a router")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--url", default=DEFAULT_ADDRESS, help=f"router address (default {DEFAULT_ADDRESS})")
    _add_auth_args(gen)
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="send PROMPT as one user chat message")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.add_argument(
        "--trace",
        action="store_true",
        help="print the request's steps as they happen: tokenization, prefill pass, KV hand-off, "
        'each decode step, detokenization holds, finish (with --json: a "trace" list)',
    )
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--request-id",
        default="",
        metavar="ID",
        help="the request's id (printable ASCII): router and workers log it, the response echoes it "
        '("request_id" in --json); default: one the router makes',
    )
    gen.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT_S, metavar="S", help="deadline in seconds")
    gen.set_defaults(func=_cmd_generate)


def _add_status(commands: argparse._SubParsersAction) -> None:
    status = commands.add_parser("status", help="show the router's workers")
    status.add_argument("--url", default=DEFAULT_ADDRESS, help=f"router address (default {DEFAULT_ADDRESS})")
    _add_auth_args(status)
    status.add_argument(
        "--address",
        default=None,
        metavar="RAY_ADDR",
        help="find the router of the `serve --ray` deployment on this Ray cluster (e.g. auto) "
        "instead of --url; prints its address first",
    )
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_cmd_status)


def _add_model(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model", help="manage the default model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    fetch = model_commands.add_parser("fetch", help="fetch and convert SmolLM2-135M-Instruct (cached)")
    fetch.add_argument("--force", action="store_true", help="re-download and re-convert")
    fetch.set_defaults(func=_cmd_model_fetch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_serve,
        _add_scale,
        _add_generate,
        _add_status,
        add_migrate,
        add_role,
        _add_model,
        add_bench,
        add_sweep,
        add_plan,
    ):
        add(commands)
    return parser


def deployment_config(args: argparse.Namespace) -> DeploymentConfig:
    """The effective DeploymentConfig of `pdserve serve` arguments (config file, flags on top)."""
    return config_from_args(args)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _cmd_serve_ray(config: DeploymentConfig) -> int:
    from pdserve.cluster.ray_cluster import RayCluster

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster = RayCluster(config, _planner_factory(config))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - Ray raises many kinds; report and fail
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _interrupt)  # ray.init installed its own (sys.exit(15), skipping our shutdown path)

    def announce() -> None:
        print(f"router: {cluster.router_address}")
        print(
            f"placement: {cluster.placement}"
            + (f" (auto: {_placement_why(cluster.placement)})" if config.ray.placement == "auto" else "")
        )
        print(
            format_table(("name", "role", "address"), [[w["name"], w["role"], w["address"]] for w in cluster.workers()])
        )
        _print_extras(cluster.http_address, {}, bool(config.security.tls_cert))
        if config.elastic.switchable:
            print(f"workers switch roles: `pdserve role --url {cluster.router_address} WORKER_ID {{prefill,decode}}`")
        options = config.autoscale_options()
        if options is not None:  # the loop runs in the controller actor (cluster.ray_elastic)
            print(
                f"autoscaler (in the controller): keeping {config.elastic.slo} with "
                f"{options.min_workers}..{options.max_workers} workers"
            )
        print("`pdserve scale --prefill N --decode M` resizes; Ctrl-C (or SIGTERM) stops everything.", flush=True)

    return _serve_until_interrupt(cluster, announce)


def _placement_why(placement: str) -> str:
    return (
        "each pool's workers on different nodes"
        if placement == "spread"
        else "a single-node cluster; --placement spread spreads the pools once it has more"
    )


def _cmd_scale(args: argparse.Namespace) -> int:
    ray = require("ray", "pdserve scale")
    from pdserve.cluster.ray_cluster import get_controller

    if args.prefill < 1 or args.decode < 1:
        print("error: need --prefill >= 1 and --decode >= 1", file=sys.stderr)
        return 2
    try:
        controller = get_controller(args.address)
        result = ray.get(controller.scale.remote(args.prefill, args.decode), timeout=args.timeout)
        workers = ray.get(controller.workers.remote())
    except Exception as exc:  # noqa: BLE001 - no deployment, Ray unreachable, scale failed
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"added: {', '.join(result['added']) or '-'}  removed: {', '.join(result['removed']) or '-'}")
    print(format_table(("name", "role", "address"), [[w["name"], w["role"], w["address"]] for w in workers]))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = deployment_config(args)
    except (OSError, ValueError) as exc:  # ConfigError names the setting; a YAML/TOML error its line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.to_yaml(), end="", flush=True)
        return 0
    if config.mode == "ray":
        return _cmd_serve_ray(config)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster = LocalCluster(config)
    except ClusterStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0

    scalers: list[Any] = []

    def announce() -> None:
        _print_cluster(cluster.router_address, [w._asdict() for w in cluster.workers])
        _print_extras(cluster.http_address, cluster.metrics_addresses, bool(config.security.tls_cert))
        options = config.autoscale_options()
        if options is not None:  # the SLO autoscaler: switches worker roles through the router
            scalers.extend(_start_autoscaler(cluster, config, options))

    return _serve_until_interrupt(cluster, announce, lambda: [s.stop() for s in scalers])


def _start_autoscaler(cluster: LocalCluster, config: DeploymentConfig, options: Any) -> list[Any]:  # noqa: ANN401
    """The local autoscaler loop in this process: its decisions logged to stderr and to
    `<log_dir>/autoscaler.log`, and (with observability.metrics) its registry served on a /metrics of
    its own, under the router's rules (loopback, or metrics_host with the auth token and TLS).
    Returns what to stop: the loop, then the endpoint."""
    from pdserve.cluster.autoscaler import start_local_autoscaler
    from pdserve.telemetry.logs import make_formatter
    from pdserve.telemetry.prometheus import MetricsEndpoint

    obs = config.observability
    logger = logging.getLogger("pdserve.cluster.autoscaler")
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(cluster.log_dir / "autoscaler.log")):
        handler.setFormatter(make_formatter("autoscaler", obs.log_format))
        logger.addHandler(handler)
    logger.setLevel(obs.log_level.upper())
    logger.propagate = False
    token = _token_of_file(config.security.auth_token_file)
    loop = start_local_autoscaler(
        cluster.router_address,
        options,
        token,
        speedup=config.model.speedup,
        tls_ca_file=config.security.tls_cert or None,  # over TLS: trust our own cert
        make_planner=_planner_factory(config),
    )
    if not obs.metrics:
        return [loop]
    guarded = not is_loopback(obs.metrics_host)  # beyond loopback: bearer token (config checked it is set)
    cert, key = config.security.tls_cert, config.security.tls_key
    tls = (cert, key) if cert and key else None  # the config checked they go together
    endpoint = MetricsEndpoint(
        loop.metrics.registry, 0, obs.metrics_host, token if guarded else None, tls if guarded else None
    )
    print(f"metrics autoscaler: {endpoint.url}", flush=True)
    return [loop, endpoint]


def _planner_factory(config: DeploymentConfig) -> Any:  # noqa: ANN401 - a PlannerFactory or None
    """The autoscaler's planner, from the profile of `elastic.autoscale` (None without one or without
    the autoscaler). The CLI is where cluster and capacity meet: the autoscaler never imports capacity."""
    from pdserve.capacity.splits import planner_factory

    options = config.autoscale_options()
    return planner_factory(options.profile, config.model.speedup) if options is not None else None


def _serve_until_interrupt(
    cluster: Any,
    announce: Callable[[], None],  # noqa: ANN401 - either launcher
    before_stop: Callable[[], object] | None = None,
) -> int:
    """Announce the running deployment, wait for Ctrl-C or SIGTERM, then stop it (once, uninterrupted);
    `before_stop` runs first (the autoscaler loop)."""
    try:
        announce()
        _wait_for_interrupt()
    except KeyboardInterrupt:
        print("pdserve: shutting down", file=sys.stderr, flush=True)
    finally:
        _ignore_signals()
        if before_stop is not None:
            before_stop()
        cluster.stop()
    return 0


def _token_of_file(path: str | None) -> str | None:
    """The public API token the autoscaler sends to its router (the file's first line, or $PDSERVE_AUTH_TOKEN)."""
    if path:
        with open(path) as f:
            return f.readline().strip() or None
    return os.environ.get("PDSERVE_AUTH_TOKEN") or None


def _wait_for_interrupt() -> None:
    """Sleep until Ctrl-C or SIGTERM (both raise KeyboardInterrupt in `serve`)."""
    while True:
        time.sleep(3600)


def _ignore_signals() -> None:
    """While stopping, a second Ctrl-C must not interrupt the clean shutdown."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _print_cluster(router_address: str, workers: list[dict[str, object]]) -> None:
    print(f"router: {router_address}")
    print(format_table(("role", "worker_id", "address", "pid"), [[str(v) for v in w.values()] for w in workers]))
    print("Ctrl-C (or SIGTERM) stops everything.", flush=True)


def _print_extras(http_address: str, metrics_addresses: dict[str, str], tls: bool = False) -> None:
    if http_address:
        print(f"OpenAI-compatible API: {'https' if tls else 'http'}://{http_address}/v1")
    for name, address in metrics_addresses.items():
        guarded = tls and name == "router" and not is_loopback(address.rsplit(":", 1)[0])  # HTTPS + token
        print(f"metrics {name}: {'https' if guarded else 'http'}://{address}/metrics")
    sys.stdout.flush()


def _cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    messages = [("user", args.prompt)] if args.chat else None
    request = build_request(
        prompt=None if args.chat else args.prompt, messages=messages, params=params, request_id=args.request_id
    )
    request.trace = args.trace
    try:
        with PdserveClient(args.url, args.timeout, _token(args), args.tls_ca) as client:
            responses = client.generate(request)
            events: list[common_pb2.TraceEvent] = []
            if args.trace and not args.json:
                responses = _echo_trace(responses)
            elif args.trace:
                responses = _keep_trace(responses, events)
            result = collect(_echo(responses, quiet=args.json or args.trace))
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        doc = result.to_json_dict()
        if args.trace:  # protobuf's JSON mapping: bytes (token pieces) are base64
            doc["trace"] = [MessageToDict(e, preserving_proto_field_name=True) for e in events]
        print(json.dumps(doc), flush=True)
    elif args.trace:
        print(f"text: {json.dumps(result.text, ensure_ascii=False)}", flush=True)
    else:
        print(flush=True)
    if result.finish_reason == "error":
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    return 0


def _echo(responses: Iterator[router_pb2.GenerateResponse], quiet: bool) -> Iterator[router_pb2.GenerateResponse]:
    """Pass responses through, writing each text delta to stdout as it arrives (unless quiet)."""
    for response in responses:
        if response.text and not quiet:
            sys.stdout.write(response.text)
            sys.stdout.flush()
        yield response


def _echo_trace(responses: Iterator[router_pb2.GenerateResponse]) -> Iterator[router_pb2.GenerateResponse]:
    """Pass responses through, printing each trace event as a line when it arrives."""
    start = time.monotonic()
    for response in responses:
        for line in trace_lines(response, time.monotonic() - start):
            print(line, flush=True)
        yield response


def _keep_trace(
    responses: Iterator[router_pb2.GenerateResponse], events: list[common_pb2.TraceEvent]
) -> Iterator[router_pb2.GenerateResponse]:
    for response in responses:
        events.extend(response.trace)
        yield response


def _ray_router_address(address: str) -> tuple[str, int]:
    """The router address of the `serve --ray` deployment on the Ray cluster at `address` (via its
    controller), and how many live nodes that cluster has."""
    ray = require("ray", "pdserve status --address")
    from pdserve.cluster.ray_cluster import get_controller, live_node_count

    try:
        return str(ray.get(get_controller(address).router_address.remote(), timeout=30)), live_node_count()
    finally:
        ray.shutdown()


def _cmd_status(args: argparse.Namespace) -> int:
    nodes = 0  # live Ray nodes (0: not known)
    if args.address is not None:
        try:
            args.url, nodes = _ray_router_address(args.address)
        except Exception as exc:  # noqa: BLE001 - no deployment, Ray unreachable
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"router: {args.url}")
    try:
        with PdserveClient(args.url, 10.0, _token(args), args.tls_ca) as client:
            status = client.status()
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    rows = status_rows(status)
    warnings = placement_warnings(rows, nodes)
    if args.json:
        doc = {
            **({"router_address": args.url} if args.address is not None else {}),
            "workers": rows,
            "warnings": warnings,
            "in_flight_requests": status.in_flight_requests,
            "total_requests": status.total_requests,
            "queued_requests": status.queued_requests,
            "slo_shed_requests": status.slo_shed_requests,
            "max_queued_requests": status.max_queued_requests,
            "mean_queue_time_s": _mean_queue_time(status),
        }
        print(json.dumps(doc))
        return 0
    print(format_table(STATUS_COLUMNS, [_status_cells(r) for r in rows]))
    print(
        f"in flight: {status.in_flight_requests}  total requests: {status.total_requests}  "
        f"queued: {status.queued_requests}/{status.max_queued_requests}  "
        f"mean queue time: {_mean_queue_time(status):.3f} s  shed (SLO): {status.slo_shed_requests}"
    )
    for kernels, workers in _kernel_uses(rows).items():
        print(f"kernels: {kernels}: {', '.join(workers)}")
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _kernel_uses(rows: list[dict[str, object]]) -> dict[str, list[str]]:
    """How each worker's kernels were chosen -> the workers that chose that way (one line each)."""
    uses: dict[str, list[str]] = {}
    for row in rows:
        if row["kernels"]:
            uses.setdefault(str(row["kernels"]), []).append(str(row["worker_id"]))
    return uses


def _mean_queue_time(status: router_pb2.StatusResponse) -> float:
    return status.queue_time_s_sum / status.dequeued_requests if status.dequeued_requests else 0.0


def _status_cells(row: dict[str, object]) -> list[str]:
    kv = f"{row['kv_used']}/{row['kv_total']}"
    healthy = "yes" if row["healthy"] else "NO"
    return [str(row[k]) for k in ("role", "worker_id", "address", "pid", "queue")] + [kv, str(row["running"]), healthy]


def _add_auth_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token",
        default=None,
        help="bearer token for a router started with an auth token (default: $PDSERVE_AUTH_TOKEN)",
    )
    parser.add_argument("--tls-ca", default=None, metavar="PEM", help="trust this CA/certificate and use TLS")


def _token(args: argparse.Namespace) -> str | None:
    return args.token or os.environ.get("PDSERVE_AUTH_TOKEN") or None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except MissingExtra as exc:  # an optional dependency (pdserve[ray], pdserve[capacity]) is not installed
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
