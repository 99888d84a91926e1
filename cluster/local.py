"""LocalCluster: a router plus prefill/decode/colocated workers as local subprocesses.

Start-up order: every worker at once (model loading runs in parallel), wait for each READY line, then
the router with the worker addresses, wait for its READY line, then a gRPC health check of every process.
Workers bind to 127.0.0.1; the router binds to ``router.host``.

Configuration: a `cluster.deploy_config.DeploymentConfig` (tests and benchmarks build one with
`cluster.launch.local_deployment`), plus `cluster.launch.LaunchOptions`, extra flags per process kind
that no deployment file can set. Each process gets its settings as one JSON document,
``<log_dir>/<name>.config.json`` (`python -m pdserve.router|pdserve.prefill_worker|pdserve.decode_worker
--config FILE`), made by the same `deploy_config.worker_document` / `router_document` the Ray launcher
uses, and validated by the process on arrival. With elastic roles (``elastic`` section) every worker is
`python -m pdserve.elastic_worker --role ROLE --config FILE`, its document holding both roles' worker
documents.

Security: the router takes the public API's bearer token and certificate (``auth_token_file``,
``tls_cert_file``/``tls_key_file``; `python -m pdserve.router` flags of the same names). The internal plane
(router -> workers, decode -> prefill, KV pushes) requires an internal token: the configured one
(``PDSERVE_INTERNAL_TOKEN[_FILE]``), else one generated for this launcher, passed to every child
in its environment (`pdserve.transport.launcher_token`).

Invariants: constructing a LocalCluster starts it (or raises ClusterStartError after stopping whatever
had started); ``stop()`` is idempotent, also runs at interpreter exit, and leaves no child running.
Each child's stderr goes to ``<log_dir>/<name>.log``.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.deploy_config import WORKER_HOST, DeploymentConfig, router_document, worker_document
from pdserve.cluster.kernel_tables import with_kernel_table
from pdserve.cluster.launch import LaunchOptions
from pdserve.cluster.processes import ManagedProcess, ProcessStartError, stop_all
from pdserve.constants import METRICS_ANY_PORT
from pdserve.omp_pool import SHARED_ENV
from pdserve.process_config import write_document
from pdserve.serving import SUPERVISED_ENV
from pdserve.transport import (
    ENV_ROUTER_DIGEST,
    ENV_ROUTER_TOKEN,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    internal_token,
    launcher_router_token,
    launcher_token,
    open_channel,
    router_token_digest,
)

STOP_GRACE_S = 5.0
PROCESS_MODULES = {
    "prefill": "pdserve.prefill_worker",
    "decode": "pdserve.decode_worker",
    "colocated": "pdserve.decode_worker",
    "router": "pdserve.router",
}
_REPO = Path(__file__).resolve().parents[1]


class ClusterStartError(RuntimeError):
    """The cluster could not start; the message names the process and holds its stderr tail."""


class WorkerProcess(NamedTuple):
    """One running worker: (role, worker_id, address, pid)."""

    role: str
    worker_id: str
    address: str
    pid: int


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_threads(config: DeploymentConfig, role: str) -> int:
    """Torch threads of a worker of `role`: the pool's setting, else the CPUs split among the workers
    of its phase (at least 1). Prefill workers form one phase; decode and colocated workers the other.
    The two phases take turns on a request, so a 1P1D pair on one host gives each worker every CPU:
    on 2 cores that served 1.4x the output tok/s of one thread each (docs/performance.md,
    `benchmarks/peer_vllm.py --pd-threads 1|2`)."""
    threads: int | None = getattr(config, role).threads
    if threads:
        return threads
    phase = config.size("prefill") if role == "prefill" else config.size("decode") + config.size("colocated")
    return max(1, _cpu_count() // max(1, phase))


def cores_shared(config: DeploymentConfig) -> bool:
    """Whether the deployment's workers, all on this host, hold more torch threads than it has CPUs
    (a 1P1D pair with every CPU each, say): they then share cores, and each is told so."""
    threads = sum(worker_threads(config, role) for role, _ in config.worker_names())
    return threads > _cpu_count()


def local_worker_document(config: DeploymentConfig, role: str, worker_id: str) -> dict[str, Any]:
    """The config document of one local worker process (loopback; a free /metrics port with metrics on).
    With elastic roles (`elastic.enabled` or `elastic.autoscale`) the worker runs `python -m
    elastic_worker --role ROLE`, and its document holds both roles' documents: {"prefill": ...,
    "decode": ...}, each read by that role's parser (same worker_id, threads and /metrics port)."""
    threads, metrics_port = worker_threads(config, role), _metrics_port(config)
    if config.elastic.switchable:
        return {
            kind: worker_document(config, kind, worker_id, WORKER_HOST, threads, metrics_port)
            for kind in ("prefill", "decode")
        }
    return worker_document(config, role, worker_id, WORKER_HOST, threads, metrics_port)


def local_router_document(config: DeploymentConfig, workers: list[WorkerProcess]) -> dict[str, Any]:
    """The config document of the local router process for the given running workers."""
    addresses: dict[str, list[str]] = {}
    for worker in workers:
        addresses.setdefault(worker.role, []).append(worker.address)
    return router_document(config, addresses, _metrics_port(config))


def _metrics_port(config: DeploymentConfig) -> int:
    """Each process binds a free port itself and announces it (a port picked here could be taken by
    another process before the worker, busy loading its model, binds it)."""
    return METRICS_ANY_PORT if config.observability.metrics else 0


def child_env(internal_token_file: str | None = None) -> dict[str, str]:
    """Environment of the children: ours, with this checkout first on PYTHONPATH, and
    the internal token (the configured file, else the environment's, else this launcher's generated one)."""
    # a source checkout first (pdserve/__init__.py maps its folders; an installed package needs nothing)
    paths = [str(_REPO)] if (_REPO / "pdserve" / "__init__.py").is_file() else []
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}
    if internal_token_file:  # the processes get it in their config too; this covers the launcher's own calls
        env.pop(ENV_TOKEN, None)
        env[ENV_TOKEN_FILE] = str(Path(internal_token_file).resolve())
    elif internal_token() is None:
        env[ENV_TOKEN] = launcher_token()
    return env


def wait_serving(address: str, timeout_s: float, internal: bool = True) -> None:
    """Poll grpc.health.v1 (service "") until SERVING; ClusterStartError after ``timeout_s``.
    `internal`: a worker (mTLS when configured) rather than the router's public port."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with open_channel(address) if internal else grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(0.1)
    raise ClusterStartError(f"{address} not SERVING after {timeout_s:.0f} s ({last})")


class LocalCluster:
    """Router + workers as subprocesses; starts on construction, use as a context manager or call stop()."""

    def __init__(self, config: DeploymentConfig, options: LaunchOptions | None = None) -> None:
        if config.mode != "local":
            raise ValueError(f"LocalCluster runs mode local, got a config of mode {config.mode!r}")
        self.config, self.options = config, options or LaunchOptions()
        log_dir = self.config.observability.log_dir
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="pdserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        print(f"pdserve: process logs in {self.log_dir}", file=sys.stderr, flush=True)
        self._processes: list[ManagedProcess] = []
        self._workers: list[WorkerProcess] = []
        self._router_address = ""
        self._http_address = ""
        self._metrics_addresses: dict[str, str] = {}
        self._stopped = False
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    @property
    def router_address(self) -> str:
        """host:port of the router."""
        return self._router_address

    @property
    def http_address(self) -> str:
        """host:port of the router's OpenAI-compatible HTTP API ("" when off)."""
        return self._http_address

    @property
    def metrics_addresses(self) -> dict[str, str]:
        """Process name ("router", "prefill-0", ...) -> host:port of its /metrics (empty when off)."""
        return dict(self._metrics_addresses)

    @property
    def workers(self) -> list[WorkerProcess]:
        """Running workers as (role, worker_id, address, pid), prefill first, then decode, then colocated."""
        return list(self._workers)

    def _launch(self, name: str, kind: str, document: dict[str, Any]) -> ManagedProcess:
        """Start `python -m <module of kind> --config <name>.config.json` (plus the kind's extra flags);
        a worker with elastic roles: `python -m pdserve.elastic_worker --role <kind> --config ...`."""
        path = write_document(self.log_dir / f"{name}.config.json", document)
        if kind != "router" and self.config.elastic.switchable:
            module = ["pdserve.elastic_worker", "--role", kind]
        else:
            module = [PROCESS_MODULES[kind]]
        argv = [sys.executable, "-m", *module, "--config", str(path), *self.options.args_for(kind)]
        env = child_env(self.config.security.internal_token_file)
        env[SUPERVISED_ENV] = "1"  # a terminal's Ctrl-C is ours alone: `stop` stops the children in order
        # the router holds its credential; workers only its digest, to check SetKvTargets callers
        env.pop(ENV_ROUTER_TOKEN, None)
        if kind == "router":
            env[ENV_ROUTER_TOKEN] = launcher_router_token()
        else:
            env[ENV_ROUTER_DIGEST] = router_token_digest(launcher_router_token())
        if kind != "router" and SHARED_ENV not in os.environ:  # else the user's own "0" or "1" stands
            # libgomp's own throttle suits workers that share cores (pdserve/omp_pool.py)
            env[SHARED_ENV] = "1" if cores_shared(self.config) else "0"
        process = ManagedProcess(name, argv, self.log_dir / f"{name}.log", env)
        self._processes.append(process)
        return process

    def _start(self) -> None:
        decode_role = "decode" if self.config.size("decode") else "colocated"
        config = self.config = with_kernel_table(
            self.config, worker_threads(self.config, decode_role), child_env(self.config.security.internal_token_file)
        )
        deadline = time.monotonic() + config.startup_timeout_s
        names = config.worker_names()
        launched = [self._launch(wid, role, local_worker_document(config, role, wid)) for role, wid in names]
        for (role, worker_id), process in zip(names, launched, strict=True):
            ready = self._wait_ready(process, deadline)
            self._workers.append(WorkerProcess(role, worker_id, str(ready["address"]), process.pid))
            self._note_metrics(worker_id, ready)
        router = self._launch("router", "router", local_router_document(config, self._workers))
        ready = self._wait_ready(router, deadline)
        self._router_address = str(ready["address"])
        self._http_address = str(ready.get("http_address") or "")
        self._note_metrics("router", ready)
        if not config.security.tls_cert:  # over TLS the READY line is the check (the cert may name another host)
            wait_serving(self._router_address, max(1.0, deadline - time.monotonic()), internal=False)
        for worker in self._workers:
            wait_serving(worker.address, max(1.0, deadline - time.monotonic()))

    def _note_metrics(self, name: str, ready: dict[str, object]) -> None:
        if ready.get("metrics_address"):
            self._metrics_addresses[name] = str(ready["metrics_address"])

    @staticmethod
    def _wait_ready(process: ManagedProcess, deadline: float) -> dict[str, object]:
        try:
            return process.wait_ready(deadline - time.monotonic())
        except ProcessStartError as exc:
            raise ClusterStartError(str(exc)) from None

    def stop(self) -> None:
        """Stop in order: SIGTERM the router and wait for it to drain (it refuses new requests and
        gives open ones `router.drain_timeout_s`, then fails the rest) and exit; only then SIGTERM the
        workers, which have nothing left to serve; wait up to 5 s, SIGKILL what is left. So no worker
        goes while the router still relays or polls it. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        routers = [p for p in self._processes if p.name == "router"]
        stop_all(routers, self.config.router.drain_timeout_s + STOP_GRACE_S)
        stop_all([p for p in reversed(self._processes) if p not in routers], STOP_GRACE_S)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
