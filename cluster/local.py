"""LocalCluster: a router plus prefill/decode/colocated workers as local subprocesses.

Start-up order: every worker at once (model loading runs in parallel), wait for each READY line, then
the router with the worker addresses, wait for its READY line, then a gRPC health check of every process.
Workers bind to 127.0.0.1; the router binds to ``config.host``.

Security: the router takes the public API's bearer token and certificate (``auth_token_file``,
``tls_cert_file``/``tls_key_file``; `python -m router` flags of the same names). The internal plane
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
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.processes import ManagedProcess, ProcessStartError, stop_all
from pdserve.devices import worker_flags
from pdserve.transport import ENV_TOKEN, internal_token, is_loopback, launcher_token, open_channel
from router.policies import POLICY_NAMES
from telemetry.logs import LOG_FORMATS

WORKER_HOST = "127.0.0.1"
STOP_GRACE_S = 5.0
ROLE_MODULES = {"prefill": "prefill_worker", "decode": "decode_worker", "colocated": "decode_worker"}
_REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # engine.model_fetch.MODEL_NAME (not imported: it pulls numpy)


class ClusterStartError(RuntimeError):
    """The cluster could not start; the message names the process and holds its stderr tail."""


class WorkerProcess(NamedTuple):
    """One running worker: (role, worker_id, address, pid)."""

    role: str
    worker_id: str
    address: str
    pid: int


@dataclass(frozen=True)
class LocalClusterConfig:
    """Topology and process settings. Needs prefill >= 1 and decode >= 1, or colocated >= 1."""

    model: str | None = None
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    threads_per_worker: int | None = None
    device: str = "cpu"  # every worker's --device and --dtype (pdserve.devices names; "auto" allowed)
    dtype: str = "auto"
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    kv_cache_mb: int | None = None
    local_prefill_threshold: int = 0  # decode workers prefill prompts shorter than this themselves
    max_queued_requests: int = 4096  # router's admission queue bound (router --max-queued-requests)
    # extra command-line flags per process kind (experiments, fault injection in tests)
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    startup_timeout_s: float = 180.0
    log_dir: str | None = None
    http_port: int | None = None  # router's OpenAI-compatible HTTP API (0 picks a port; None: off)
    metrics: bool = False  # Prometheus /metrics on a free loopback port per process
    log_format: str = "text"  # "text" or "json" log lines, every process
    log_level: str = "INFO"
    model_name: str | None = None  # model id of the HTTP API (default: the model folder's name)
    auth_token_file: str | None = None  # public API needs "Bearer <first line>" (or PDSERVE_AUTH_TOKEN)
    tls_cert_file: str | None = None  # public gRPC and HTTP API over TLS (with tls_key_file)
    tls_key_file: str | None = None
    metrics_host: str = "127.0.0.1"  # router's /metrics interface; beyond loopback only with a token
    elastic: bool = False  # workers can switch roles at runtime (`python -m elastic_worker`; `pdserve role`)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "colocated"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not ((self.prefill >= 1 and self.decode >= 1) or self.colocated >= 1):
            raise ValueError("need prefill >= 1 and decode >= 1, or colocated >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads_per_worker}")
        worker_flags(self.device, self.dtype)  # ValueError on a bad name
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICY_NAMES:
                raise ValueError(f"{name} must be one of {', '.join(POLICY_NAMES)}, got {getattr(self, name)!r}")
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.kv_cache_mb is not None and self.kv_cache_mb < 1:
            raise ValueError(f"kv_cache_mb must be >= 1, got {self.kv_cache_mb}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together (--tls-cert and --tls-key)")
        if not is_loopback(self.metrics_host) and not (self.auth_token_file or os.environ.get("PDSERVE_AUTH_TOKEN")):
            raise ValueError(f"refusing /metrics on {self.metrics_host}, beyond loopback, without an auth token "
                             "(--auth-token-file)")

    @property
    def served_model_name(self) -> str:
        """The model id of the HTTP API: as configured, else the model folder's name."""
        if self.model_name:
            return self.model_name
        return Path(self.model).name if self.model else DEFAULT_MODEL_NAME

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def threads(self) -> int:
        """Torch threads per worker: as configured, else the CPUs split evenly (at least 1)."""
        return self.threads_per_worker or max(1, _cpu_count() // self.num_workers)

    def worker_names(self) -> list[tuple[str, str]]:
        """(role, worker_id) of every worker, e.g. ("prefill", "prefill-0")."""
        counts = (("prefill", self.prefill), ("decode", self.decode), ("colocated", self.colocated))
        return [(role, f"{role}-{i}") for role, count in counts for i in range(count)]


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_argv(config: LocalClusterConfig, role: str, worker_id: str) -> list[str]:
    """Command line of one worker process."""
    if config.elastic:
        argv = [sys.executable, "-m", "elastic_worker", "--role", role, "--host", WORKER_HOST, "--port", "0"]
    else:
        argv = [sys.executable, "-m", ROLE_MODULES[role], "--host", WORKER_HOST, "--port", "0"]
    argv += ["--worker-id", worker_id, "--threads", str(config.threads)]
    argv += worker_flags(config.device, config.dtype)
    if role == "colocated" and not config.elastic:
        argv.append("--colocated")
    if config.model is not None:
        argv += ["--model", config.model]
    if config.kv_cache_mb is not None:
        argv += ["--kv-cache-mb", str(config.kv_cache_mb)]
    if (role == "decode" or config.elastic) and config.local_prefill_threshold:
        argv += ["--local-prefill-threshold", str(config.local_prefill_threshold)]
    argv += config.prefill_args if role == "prefill" else config.decode_args
    return argv + observability_argv(config)


def observability_argv(config: LocalClusterConfig) -> list[str]:
    """Non-default logging and metrics flags (every pdserve process takes them; a free metrics port each)."""
    argv = [] if config.log_format == "text" else ["--log-format", config.log_format]
    argv += [] if config.log_level == "INFO" else ["--log-level", config.log_level]
    if config.metrics:
        argv += ["--metrics-port", str(free_port())]
    return argv


def free_port(host: str = WORKER_HOST) -> int:
    """A port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def router_argv(config: LocalClusterConfig, workers: list[WorkerProcess]) -> list[str]:
    """Command line of the router process for the given running workers."""
    argv = [sys.executable, "-m", "router", "--host", config.host, "--port", str(config.port)]
    for worker in workers:
        argv += [f"--{worker.role}", worker.address]
    argv += ["--prefill-policy", config.prefill_policy, "--decode-policy", config.decode_policy]
    argv += ["--max-queued-requests", str(config.max_queued_requests)]
    if config.http_port is not None:
        argv += ["--http-port", str(config.http_port), "--model-name", config.served_model_name]
    argv += security_argv(config)
    return argv + observability_argv(config) + list(config.router_args)


def security_argv(config: LocalClusterConfig) -> list[str]:
    """The router's public-API security flags (token file, certificate, metrics interface)."""
    argv = ["--auth-token-file", config.auth_token_file] if config.auth_token_file else []
    if config.tls_cert_file and config.tls_key_file:
        argv += ["--tls-cert", config.tls_cert_file, "--tls-key", config.tls_key_file]
    if config.metrics and config.metrics_host != "127.0.0.1":
        argv += ["--metrics-host", config.metrics_host]
    return argv


def child_env() -> dict[str, str]:
    """Environment of the children: ours, with this checkout (and its stubs) first on PYTHONPATH, and
    the internal token (the configured one, else this launcher's generated one)."""
    paths = [str(_REPO), str(_REPO / "proto")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}
    if internal_token() is None:
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

    def __init__(self, config: LocalClusterConfig) -> None:
        self.config = config
        self.log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-logs-"))
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

    def _launch(self, name: str, argv: list[str]) -> ManagedProcess:
        process = ManagedProcess(name, argv, self.log_dir / f"{name}.log", child_env())
        self._processes.append(process)
        return process

    def _start(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        names = self.config.worker_names()
        launched = [self._launch(wid, worker_argv(self.config, role, wid)) for role, wid in names]
        for (role, worker_id), process in zip(names, launched, strict=True):
            ready = self._wait_ready(process, deadline)
            self._workers.append(WorkerProcess(role, worker_id, str(ready["address"]), process.pid))
            self._note_metrics(worker_id, ready)
        router = self._launch("router", router_argv(self.config, self._workers))
        ready = self._wait_ready(router, deadline)
        self._router_address = str(ready["address"])
        self._http_address = str(ready.get("http_address") or "")
        self._note_metrics("router", ready)
        if not self.config.tls_cert_file:  # over TLS the READY line is the check (the cert may name another host)
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
        """SIGTERM every process (router first), wait up to 5 s, SIGKILL what is left. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        stop_all(list(reversed(self._processes)), STOP_GRACE_S)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
