"""The pdserve processes as Ray actors: a worker actor (prefill or decode) and the router actor.

A worker actor's ``__init__`` builds exactly what ``python -m pdserve.prefill_worker`` / ``python -m
pdserve.decode_worker`` build, by calling the same library entry point (the process module's
``start_worker``) with the same typed config: the launcher turns the worker's config document
(`cluster.deploy_config.worker_document`) and any extra flags into it with the process's own parser
(`worker_config`), and Ray hands the frozen object to the actor, which parses nothing. Both
deployment modes share one code path: the worker serves gRPC on its own port, and the router
talks to it as it talks to a local process. The actor adds what a launcher needs: ``address()``,
``info()``, ``state()``, ``drain()``, ``is_idle()``, ``stop()``; a decode actor also takes KV from the Ray
object store (``receive_kv`` for a whole request, ``receive_kv_part`` for layer-wise parts: the "ray" KV
backend's receiving end).

An elastic worker actor (``serve --ray --elastic`` / ``--autoscale``: its document is
{"prefill": ..., "decode": ...}, `is_elastic_document`, so its config an `ElasticWorkerConfig`)
runs ``pdserve.elastic_worker.process``'s ``start_worker`` instead: one loaded model and KV pool,
every role's services on one port, and RoleControl.SetRole (the router's SwitchRole, `pdserve
role`) changes its role in place. ``role`` and ``state()`` then report the current role (the
controller's watcher reads it).

The router actor, started from its typed config (`router_process`), serves the public gRPC API;
``add_worker`` / ``remove_worker`` change its worker set at runtime (the controller calls them when
workers are added, removed or restarted).

These classes are plain Python; ``cluster.ray_cluster`` wraps them with ``ray.remote`` options
(resources, placement, restarts). Heavy imports happen inside the actors, so the router actor
never loads torch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeAlias

from pdserve.decode_worker import config as decode_config
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.elastic_worker import config as elastic_config
from pdserve.elastic_worker.config import ElasticWorkerConfig
from pdserve.prefill_worker import config as prefill_config
from pdserve.prefill_worker.config import PrefillWorkerConfig

WORKER_ROLES = ("prefill", "decode")
#: What a worker actor starts from (torch-free objects: the launcher builds them).
WorkerProcessConfig: TypeAlias = "PrefillWorkerConfig | DecodeWorkerConfig | ElasticWorkerConfig"
ELASTIC_KINDS = frozenset(WORKER_ROLES)


def is_elastic_document(document: dict[str, Any]) -> bool:
    """An elastic worker's document: {"prefill": <prefill document>, "decode": <decode document>}."""
    return set(document) == ELASTIC_KINDS and all(isinstance(v, dict) for v in document.values())


def worker_config(role: str, document: dict[str, Any], extra_argv: tuple[str, ...] = ()) -> WorkerProcessConfig:
    """The typed config of a worker actor, built on the launcher's side: its config document (an
    elastic one gives an `ElasticWorkerConfig` starting in `role`) with `extra_argv` (tests' extra
    flags, e.g. fault injection) on top, read by the worker process's own parser and `from_args`, as
    ``python -m`` reads them. ValueError when the parser refuses them (it names the cause on stderr)."""
    try:
        if is_elastic_document(document):
            return ElasticWorkerConfig.from_args(
                *elastic_config.parse_args(["--role", role, *extra_argv], document=document)
            )
        if role == "prefill":
            return PrefillWorkerConfig.from_args(prefill_config.parse_args(list(extra_argv), document=document))
        if role == "decode":
            return DecodeWorkerConfig.from_args(decode_config.parse_args(list(extra_argv), document=document))
    except SystemExit:  # argparse's way of refusing; a launcher keeps running
        raise ValueError(f"{role} worker: its document or flags {list(extra_argv)} were refused") from None
    raise ValueError(f"role must be one of {', '.join(WORKER_ROLES)}, got {role!r}")


def start_worker(config: WorkerProcessConfig) -> Any:  # noqa: ANN401 - worker.runtime.StartedWorker
    """`start_worker` of the process module of `config`'s kind, imported here, inside the actor: it pulls torch."""
    if isinstance(config, ElasticWorkerConfig):
        from pdserve.elastic_worker import process as elastic_process

        return elastic_process.start_worker(config)
    if isinstance(config, PrefillWorkerConfig):
        from pdserve.prefill_worker import process as prefill_process

        return prefill_process.start_worker(config)
    from pdserve.decode_worker import process as decode_process

    return decode_process.start_worker(config)


def _use_internal_token(token: str | None) -> None:
    """This actor's process requires and sends the deployment's internal token (one actor per process)."""
    if token:
        from pdserve.transport import ENV_TOKEN

        os.environ[ENV_TOKEN] = token


class WorkerActor:
    """One prefill or decode worker inside a Ray actor, started from its typed config (`worker_config`:
    a `PrefillWorkerConfig`, a `DecodeWorkerConfig`, or an `ElasticWorkerConfig` for a worker that
    can switch roles)."""

    def __init__(self, config: WorkerProcessConfig, internal_token: str | None = None, router_digest: str = "") -> None:
        import ray

        from pdserve.omp_pool import prepare_process

        prepare_process()  # before torch loads here (worker.runtime imports it): its OpenMP reads the env once
        from pdserve.worker.runtime import NODE_HOST_ENV, NODE_ID_ENV, configure_worker

        _use_internal_token(internal_token)
        if router_digest:  # only the deployment's router may set this worker's KV targets
            from pdserve.transport import ENV_ROUTER_DIGEST

            os.environ[ENV_ROUTER_DIGEST] = router_digest
        elastic = isinstance(config, ElasticWorkerConfig)
        role = "prefill" if isinstance(config, PrefillWorkerConfig) else config.role
        if role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {', '.join(WORKER_ROLES)}, got {role!r}")
        os.environ[NODE_ID_ENV] = ray.get_runtime_context().get_node_id()  # reported in WorkerInfo.node_id
        os.environ[NODE_HOST_ENV] = ray.util.get_node_ip_address()
        decode = config.decode if isinstance(config, ElasticWorkerConfig) else config  # or a prefill worker's
        configure_worker(decode)  # an elastic worker's shared settings are its decode config's
        self.started = start_worker(config)
        from pdserve.omp_pool import dedicate_engine_thread

        dedicate_engine_thread()  # the engine thread computes from here on (see pdserve/omp_pool.py)
        self._elastic: Any = self.started.extras["worker"] if elastic else None  # the ElasticWorker
        self._role = role
        self.worker_id = decode.worker_id
        self._ray_receiver: Any = None
        if isinstance(decode, DecodeWorkerConfig) and decode.kv.backend == "ray":
            from pdserve.kv_transfer.ray_backend import RayKvReceiver

            self._ray_receiver = RayKvReceiver(self.started.extras["kv_receiver"], decode.pool.kv_timeout_s)

    @property
    def role(self) -> str:
        """The current role (an elastic actor's changes with each switch)."""
        return str(self._elastic.role) if self._elastic is not None else self._role

    def state(self) -> dict[str, Any]:
        """address, current role and whether it can switch roles (the controller's watcher polls this)."""
        return {"address": self.started.address, "role": self.role, "elastic": self._elastic is not None}

    def address(self) -> str:
        """host:port of this worker's gRPC server (changes when the actor restarts)."""
        return self.started.address

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "role": self.role,
            "worker_id": self.worker_id,
            "address": self.started.address,
            "elastic": self._elastic is not None,
            "role_switches": self._elastic.switches if self._elastic else 0,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": ray.util.get_node_ip_address(),
            "draining": self.started.drain.draining,
            "idle": self.started.is_idle(),
            "ray_kv_transfers": self._ray_receiver.transfers_received if self._ray_receiver else 0,
            "ray_kv_parts": self._ray_receiver.parts_received if self._ray_receiver else 0,
        }

    def drain(self) -> None:
        """Report unhealthy and refuse new requests; the ones held here keep being served."""
        self.started.start_draining()

    def is_idle(self) -> bool:
        return bool(self.started.is_idle())

    def stop(self) -> None:
        """Drain (bounded by --drain-timeout-s), stop the server and the engine."""
        self.started.stop()

    def receive_kv(self, header: dict[str, Any], refs: list[Any]) -> dict[str, Any]:
        """The "ray" KV backend's receiving end: one request's header and [ObjectRef] (decode, --kv-backend ray)."""
        if self._ray_receiver is None:
            return {"ok": False, "error": f"{self.worker_id} does not take KV through Ray", "bytes_received": 0}
        return dict(self._ray_receiver.receive(header, refs))

    def receive_kv_part(self, header: dict[str, Any], part: dict[str, Any], refs: list[Any]) -> dict[str, Any]:
        """Layer-wise receiving end: one part (a layer range and its [ObjectRef]) of a request, or the
        sender's abort; parts arrive in any order and concurrently (the actor is threaded)."""
        if self._ray_receiver is None:
            return {"ok": False, "error": f"{self.worker_id} does not take KV through Ray", "bytes_received": 0}
        return dict(self._ray_receiver.receive_part(header, part, refs))


def router_process(
    document: dict[str, Any], auth_token: str | None = None, auth_tokens: dict[str, str] | None = None
) -> Any:  # noqa: ANN401
    """The router actor's typed config (`router.process.RouterProcess`), built on the launcher's side
    from its config document by the router process's own parser; `auth_token` and `auth_tokens`
    (token -> tenant; the launcher's, read on its driver) win over the document's token files.
    ValueError when the parser refuses the document."""
    from pdserve.router.process import RouterProcess, parse_args

    try:
        return RouterProcess.from_args(parse_args([], document=document), auth_token, auth_tokens)
    except SystemExit:  # argparse's way of refusing; a launcher keeps running
        raise ValueError("router: its document was refused") from None


class RouterActor:
    """The router (public gRPC API and, with http_port, the OpenAI HTTP API) inside a Ray actor,
    started from its typed config (`router_process`)."""

    def __init__(
        self,
        process: Any,
        internal_token: str | None = None,  # noqa: ANN401 - RouterProcess
        router_token: str | None = None,
    ) -> None:
        _use_internal_token(internal_token)
        if router_token:  # the credential of the calls only the router makes (SetKvTargets)
            from pdserve.transport import ENV_ROUTER_TOKEN

            os.environ[ENV_ROUTER_TOKEN] = router_token
        from pdserve.router.server import serve
        from pdserve.telemetry.logs import configure_logging

        configure_logging("router", process.observability.log_level, process.observability.log_format)
        self.config = _workers_after_restart(process.router)
        self.server, self.port = serve(self.config)

    def address(self) -> str:
        return self.server.address

    def http_address(self) -> str:
        """host:port of the OpenAI-compatible HTTP API ("" when off)."""
        return f"{self.server.host}:{self.server.http_port}" if self.server.http_port is not None else ""

    def add_worker(self, address: str, role: str) -> None:
        from pdserve.router.worker_pool import WorkerEndpoint

        if address in self.server.pool.addresses():  # a restarted router may have learned it already
            return
        self.server.pool.add(WorkerEndpoint(address, role))

    def remove_worker(self, address: str) -> bool:
        return self.server.pool.remove(address)

    def workers(self) -> dict[str, str]:
        """Address -> role of every worker the router routes to."""
        return self.server.pool.addresses()

    def status(self) -> list[dict[str, Any]]:
        """What the router knows about each worker (address, role, healthy, in flight)."""
        from google.protobuf.json_format import MessageToDict

        return [MessageToDict(info, preserving_proto_field_name=True) for info in self.server.pool.snapshot()]

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "address": self.server.address,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "restarted": ray.get_runtime_context().was_current_actor_reconstructed,
        }

    def stop(self) -> None:
        """Drain (new requests refused, open ones get `router.drain_timeout_s`), then stop; the
        controller stops the workers after this returns."""
        self.server.drain(self.config.drain_timeout_s)
        self.server.stop(5.0)


def _workers_after_restart(config: Any) -> Any:  # noqa: ANN401 - router.config.RouterConfig
    """`config`, or for a router actor that Ray restarted (``max_restarts``) `config` with the workers
    the controller knows now: the addresses it was created with may be stale (restarted workers serve
    on new ports, scale() added and removed some)."""
    import ray

    if not ray.get_runtime_context().was_current_actor_reconstructed:
        return config
    from pdserve.cluster.ray_cluster import CONTROLLER_NAME, NAMESPACE

    controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    workers = ray.get(controller.router_workers.remote(), timeout=60)
    return dataclasses.replace(
        config, **{role: tuple(w["address"] for w in workers if w["role"] == role) for role in ("prefill", "decode")}
    )
