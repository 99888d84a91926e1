"""`pdserve migrate --url ROUTER REQUEST_ID [--to WORKER_ID]`: move a running request live to another
decode worker (Router.Migrate). Its KV blocks and state move; the client's stream goes on unchanged.

Prints one line (or a JSON object with --json); exit 1 with ``error: <CODE>: <details>`` on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from pdserve.cluster.client import DEFAULT_ADDRESS, PdserveClient


def add_migrate(commands: argparse._SubParsersAction) -> None:
    migrate = commands.add_parser("migrate", help="move a running request to another decode worker")
    migrate.add_argument("request_id", help="the request's id (the client's, when unique, or the router's internal id)")
    migrate.add_argument("--url", default=DEFAULT_ADDRESS, help=f"router address (default {DEFAULT_ADDRESS})")
    migrate.add_argument(
        "--to",
        default="",
        metavar="WORKER_ID",
        help="target decode worker (worker id or address; default: the router's pick)",
    )
    migrate.add_argument(
        "--token",
        default=None,
        help="bearer token for a router started with an auth token (default: $PDSERVE_AUTH_TOKEN)",
    )
    migrate.add_argument("--tls-ca", default=None, metavar="PEM", help="trust this CA/certificate and use TLS")
    migrate.add_argument("--timeout", type=float, default=130.0, metavar="S")
    migrate.add_argument("--json", action="store_true")
    migrate.set_defaults(func=_cmd_migrate)


def _cmd_migrate(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("PDSERVE_AUTH_TOKEN") or None
    try:
        with PdserveClient(args.url, args.timeout, token, args.tls_ca) as client:
            done = client.migrate(args.request_id, args.to)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(MessageToDict(done, preserving_proto_field_name=True)))
    else:
        print(
            f"migrated {done.request_id} from {done.from_address} to {done.to_address}: {done.num_tokens} tokens, "
            f"{done.kv_bytes} KV bytes in {done.migrate_s:.3f} s"
        )
    return 0
