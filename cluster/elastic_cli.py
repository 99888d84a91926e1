"""`pdserve role`, and the autoscaler options behind the ``elastic`` section of `pdserve serve`
(pdserve.settings.ElasticSection: --elastic, --autoscale, --slo, --min-workers, --max-workers,
--autoscale-interval; `DeploymentConfig.autoscale_options` builds `AutoscaleOptions`).

    pdserve role [--url ROUTER] WORKER_ID {prefill,decode,colocated}
    pdserve serve --elastic ...                       workers can switch roles (`pdserve role`)
    pdserve serve --autoscale --slo ttft_ms=500,tpot_ms=50 [--min-workers N --max-workers M] ...
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import grpc

from pdserve.cluster.client import DEFAULT_ADDRESS, status_rows
from pdserve.cluster.tables import format_table
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

ROLE_PB = {
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
    "colocated": common_pb2.WORKER_ROLE_COLOCATED,
}
SLO_KEYS = ("ttft_ms", "tpot_ms")


def add_role(commands: argparse._SubParsersAction) -> None:
    role = commands.add_parser("role", help="switch a worker between prefill and decode without a restart")
    role.add_argument("worker_id", metavar="WORKER_ID", help="worker_id (as `pdserve status` shows it) or address")
    role.add_argument("role", choices=tuple(ROLE_PB), help="the new role")
    role.add_argument("--url", default=DEFAULT_ADDRESS, help=f"router address (default {DEFAULT_ADDRESS})")
    role.add_argument(
        "--token",
        default=None,
        help="bearer token for a router started with an auth token (default: $PDSERVE_AUTH_TOKEN)",
    )
    role.add_argument("--tls-ca", default=None, metavar="PEM", help="trust this CA/certificate and use TLS")
    role.add_argument(
        "--drain-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="how long the worker may take to finish the work of its old role (default 120)",
    )
    role.set_defaults(func=_cmd_role)


def switch_role(
    url: str,
    worker_id: str,
    role: str,
    drain_timeout_s: float = 120.0,
    token: str | None = None,
    tls_ca_file: str | None = None,
) -> router_pb2.SwitchRoleResponse:
    """Router.SwitchRole; raises grpc.RpcError."""
    if tls_ca_file:
        with open(tls_ca_file, "rb") as f:
            channel = grpc.secure_channel(url, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(url)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with channel:
        return router_pb2_grpc.RouterStub(channel).SwitchRole(
            router_pb2.SwitchRoleRequest(worker_id=worker_id, role=ROLE_PB[role], drain_timeout_s=drain_timeout_s),
            timeout=drain_timeout_s + 30.0,
            metadata=metadata,
        )


def _cmd_role(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("PDSERVE_AUTH_TOKEN") or None
    try:
        result = switch_role(args.url, args.worker_id, args.role, args.drain_timeout, token, args.tls_ca)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    row = status_rows(router_pb2.StatusResponse(workers=[result.worker]))[0]
    before = common_pb2.WorkerRole.Name(result.previous_role).removeprefix("WORKER_ROLE_").lower()
    print(
        f"{row['worker_id'] or args.worker_id}: {before} -> {row['role']} (finished old work in "
        f"{result.drain_s:.2f} s, switch {result.switch_s:.2f} s)"
    )
    print(
        format_table(
            ("role", "worker_id", "address", "healthy"),
            [[str(row["role"]), str(row["worker_id"]), str(row["address"]), str(row["healthy"])]],
        )
    )
    return 0


@dataclass(frozen=True)
class AutoscaleOptions:
    """`serve --autoscale` (the ``elastic`` section; `DeploymentConfig.autoscale_options`): the SLOs it
    keeps and the bounds of the worker count (a local deployment keeps its workers and switches their
    roles; a Ray deployment also adds and removes workers within the bounds: cluster.ray_elastic)."""

    slo: dict[str, float] = field(default_factory=dict)  # "ttft_ms", "tpot_ms" -> limit in ms
    min_workers: int = 2
    max_workers: int = 8
    interval_s: float = 1.0
    profile: str | None = None  # latency profile for the planner (default: the sim engine's, if any)

    def __post_init__(self) -> None:
        if not self.slo:
            raise ValueError("--autoscale needs --slo ttft_ms=..,tpot_ms=..")
        if not 2 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 2 <= --min-workers <= --max-workers, got {self.min_workers}, {self.max_workers}")
        if not self.interval_s > 0:
            raise ValueError(f"--autoscale-interval must be > 0, got {self.interval_s}")


def parse_slo(text: str) -> dict[str, float]:
    """ "ttft_ms=500,tpot_ms=50" -> {"ttft_ms": 500.0, "tpot_ms": 50.0} (ValueError naming the bad item)."""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo items look like ttft_ms=500 or tpot_ms=50, got {item!r}")
        limit = float(value)
        if not limit > 0:
            raise ValueError(f"--slo {key} must be > 0, got {value}")
        out[key] = limit
    return out
