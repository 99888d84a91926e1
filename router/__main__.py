"""``python -m router``: run the router process.

Protocol shared with the worker processes: once serving, print exactly one line to stdout,
``PDSERVE_READY {"address": "HOST:PORT", "worker_id": "router", "pid": N}``, and flush; logs go to
stderr. SIGTERM / SIGINT stop the server gracefully (open streams get 5 s) and exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from router.config import RouterConfig
from router.policies import POLICY_NAMES
from router.server import serve

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
        help="server threads, i.e. Generate streams served at once (default 256)",
    )
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
    )


def ready_line(address: str, worker_id: str, pid: int) -> str:
    """The one stdout line announcing a serving pdserve process."""
    return f"{READY_PREFIX} {json.dumps({'address': address, 'worker_id': worker_id, 'pid': pid})}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s router %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    server, _port = serve(config)
    print(ready_line(server.address, "router", os.getpid()), flush=True)
    stop.wait()
    logging.getLogger(__name__).info("stopping (grace %.0f s)", STOP_GRACE_S)
    server.stop(STOP_GRACE_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
