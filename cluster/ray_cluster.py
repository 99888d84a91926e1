"""RayCluster: the router and the prefill/decode pools as Ray actors, kept in shape by a controller.

Layout (namespace :data:`NAMESPACE`):
- ``pdserve-controller`` (detached, named, pinned to the head node: it owns the router and worker
  actors, which share its fate, so it must not sit on a node that can be lost alone): reserves the
  placement (`resolve_placement`: ``auto`` is ``spread`` on a cluster of several live nodes, else
  ``pack``). ``pack`` and ``strict_spread``: one placement group (PACK or STRICT_SPREAD) with a bundle
  for the router and one per initial worker. ``spread``: the router's bundle alone (on the head node
  when it has room: its loss ends the cluster anyway), and one SPREAD
  group per pool, so that each pool's workers land on different nodes (a single group over all
  bundles may put two workers of one pool together) and the loss of one node leaves every pool a
  worker. Then it starts the worker actors (``prefill-0``, ``decode-0``, ...; ``max_restarts`` each) and the router
  actor (``pdserve-router``). A watcher
  thread asks every worker for its ``address()`` each ``poll_interval_s``: a restarted worker (new
  port) is re-registered with the router, a worker that died for good is removed; it also notes the
  router's address (a restarted router on port 0 gets a new one). ``scale()`` adds workers in a
  placement group of their own per scale-up (registered once they serve) and drains removed ones:
  ``drain()`` makes the worker report unhealthy and refuse new requests, so the router stops
  routing to it; once idle (or after ``drain_timeout_s``) it leaves the router and its actor is
  killed.
- The router actor has ``max_restarts`` (``router_max_restarts``); a restarted router reads its
  workers from the controller (``router_workers()``), not from its creation arguments.
- Workers and the router keep their gRPC servers; they bind to ``worker_host`` (loopback unless
  told otherwise; ``node`` binds the node's IP, needed when actors span nodes).
- Security: every actor gets the deployment's internal token (the configured
  ``PDSERVE_INTERNAL_TOKEN[_FILE]``, else one the driver generates), so the internal plane needs it on
  every call, loopback or not. The router actor takes the public API's bearer token (read from
  ``auth_token_file`` on the driver) or its tenant tokens (``auth_tokens_file``, read on the driver
  too; they travel as actor arguments, as the token does, and are never logged) and certificate
  files (read on the router's node).

Configuration: the controller gets the deployment's `cluster.deploy_config.DeploymentConfig` (mode
ray), builds each actor's config document (`worker_document`, `router_document`: the same
functions the local launcher uses) and parses it with the process's own parser into the typed
config the actor takes (`ray_actors.worker_config`, `router_process`).

The driver-side :class:`RayCluster` starts a local Ray instance when none is running and no
address is given (and shuts it down on ``stop()``), creates the controller and waits for the
router. ``pdserve scale`` finds the controller by name from another process.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from pdserve.constants import RAY_NAMESPACE
from pdserve.extras import missing_extra

try:
    import ray
    from ray.exceptions import ActorDiedError, RayError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
except ImportError as exc:
    raise missing_extra("ray", "The Ray deployment (pdserve serve --ray, scale, status --address)") from exc

from pdserve.cluster.deploy_config import DeploymentConfig, _abspath, router_document, worker_document
from pdserve.cluster.kernel_tables import with_kernel_table
from pdserve.cluster.launch import LaunchOptions
from pdserve.cluster.local import child_env
from pdserve.cluster.ray_actors import RouterActor, WorkerActor, router_process, worker_config
from pdserve.transport import launcher_token, load_tenant_tokens, load_token, router_token_digest

log = logging.getLogger(__name__)

NAMESPACE = RAY_NAMESPACE
CONTROLLER_NAME = "pdserve-controller"
ROUTER_NAME = "pdserve-router"
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict_spread": "STRICT_SPREAD"}  # + "auto" (resolve_placement)
ROLES = ("prefill", "decode")


def local_num_cpus(config: DeploymentConfig) -> int:
    """Logical CPUs of a local Ray instance: the machine's, but at least 4x what the initial placement
    group takes (router + workers), and room for the autoscaler's max_workers, so that scaling up finds
    room (they are scheduling units only)."""
    workers = config.size("prefill") + config.size("decode")
    if config.elastic.autoscale:
        workers = max(workers, config.elastic.max_workers)
    needed = 1 + (0 if config.ray.gpus_per_worker else workers)
    return max(os.cpu_count() or 1, 4 * needed)


def worker_resources(config: DeploymentConfig, role: str) -> dict[str, float]:
    """What one worker of `role` declares: GPUs when configured, else one CPU; plus its custom resource."""
    gpus = config.ray.gpus_per_worker
    needs: dict[str, float] = {"GPU": gpus} if gpus else {"CPU": 1.0}
    custom = config.ray.prefill_resource if role == "prefill" else config.ray.decode_resource
    if custom:
        needs[custom] = 1.0
    return needs


def router_resources(config: DeploymentConfig) -> dict[str, float]:
    """The router's bundle: one CPU, plus its custom resource when configured."""
    custom = config.ray.router_resource
    return {"CPU": 1.0, **({custom: 1.0} if custom else {})}


def worker_actor_options(config: DeploymentConfig, role: str, name: str) -> dict[str, Any]:
    """Ray actor options of a worker (all but its placement)."""
    options: dict[str, Any] = {
        "name": name,
        "namespace": NAMESPACE,
        "max_restarts": config.ray.max_restarts,
        "max_concurrency": 64,  # a threaded actor: KV intake calls run while others wait
    }
    resources = worker_resources(config, role)
    if "GPU" in resources:  # (decided before the pops: a GPU worker asks for GPUs, not CPUs)
        options["num_gpus"] = resources.pop("GPU")
    else:
        options["num_cpus"] = resources.pop("CPU", 1.0)
    if resources:
        options["resources"] = resources
    return options


def router_actor_options(config: DeploymentConfig) -> dict[str, Any]:
    """Ray actor options of the router (all but its placement)."""
    custom = config.ray.router_resource
    return {
        "name": ROUTER_NAME,
        "namespace": NAMESPACE,
        "num_cpus": 1,
        "max_concurrency": 16,
        "max_restarts": config.ray.router_max_restarts,
        "resources": {custom: 1.0} if custom else None,
    }


def drain_timeout_s(config: DeploymentConfig) -> float:
    """How long the controller waits for removed workers to finish: the longer pool's drain."""
    return max(config.prefill.drain_timeout_s, config.decode.drain_timeout_s)


def ray_worker_document(config: DeploymentConfig, role: str, worker_id: str) -> dict[str, Any]:
    """The config document a worker actor gets (`worker_host` "node" resolved on this node). With
    elastic roles (`elastic.enabled` or `elastic.autoscale`) it is {"prefill": ..., "decode": ...},
    both roles' documents, as `python -m pdserve.elastic_worker` takes it: the actor can switch roles."""
    host = ray.util.get_node_ip_address() if config.ray.worker_host == "node" else config.ray.worker_host
    return worker_actor_document(config, role, worker_id, host)


def worker_actor_document(config: DeploymentConfig, role: str, worker_id: str, host: str) -> dict[str, Any]:
    """`ray_worker_document` on a given host (no Ray needed)."""
    if config.elastic.switchable:
        return {kind: worker_document(config, kind, worker_id, host) for kind in ROLES}
    return worker_document(config, role, worker_id, host)


def resolve_placement(placement: str, live_nodes: int) -> str:
    """The placement a deployment gets: ``auto`` is ``spread`` on a cluster of several live nodes (a
    node loss then leaves every pool a worker), ``pack`` on one; any other is itself."""
    if placement != "auto":
        return placement
    return "spread" if live_nodes > 1 else "pack"


def live_node_count() -> int:
    return sum(1 for node in ray.nodes() if node.get("Alive"))


@dataclass
class _Worker:
    name: str
    role: str
    handle: Any  # ray ActorHandle
    address: str = ""  # as registered with the router ("" before it serves)
    probe: Any = None  # pending address() call of the watcher
    draining: bool = False
    pg: Any = None  # placement group of a worker added by scale() (None: the initial group)


class Controller:
    """Owns the deployment (wrapped as the named detached actor ``pdserve-controller``)."""

    def __init__(
        self,
        config: DeploymentConfig,
        internal_token: str | None = None,
        auth_token: str | None = None,
        options: LaunchOptions | None = None,
        make_planner: Callable[..., Any] | None = None,
        auth_tokens: dict[str, str] | None = None,
    ) -> None:
        """`make_planner`: the autoscaler's planner factory (`cluster.autoscaler.PlannerFactory`), handed
        in by the CLI when `elastic.autoscale` has a profile. `auth_token` / `auth_tokens` (token ->
        tenant): the public API's token or tenant tokens, read on the driver, handed to the router actor."""
        logging.basicConfig(
            level=config.observability.log_level, format="%(asctime)s controller %(levelname)s %(message)s"
        )
        # one kernel table for every worker (timed here, on the head node, at the decode workers'
        # threads; a worker on another CPU model times its own and says so in `pdserve status`)
        self.config = config = with_kernel_table(config, config.decode.threads or os.cpu_count() or 1, child_env())
        self._internal_token = internal_token
        self._router_token = secrets.token_urlsafe(32)  # the router actor's own credential (SetKvTargets)
        self._auth_token = auth_token
        self._auth_tokens = auth_tokens
        self._options = options or LaunchOptions()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # guards _workers
        self._scale_lock = threading.Lock()  # one scale() at a time
        self._next_index = dict.fromkeys(ROLES, 0)
        self._stop = threading.Event()
        roles = ["prefill"] * config.size("prefill") + ["decode"] * config.size("decode")
        self.placement = resolve_placement(config.ray.placement, live_node_count())
        log.info("placement %s (configured %s, %d live nodes)", self.placement, config.ray.placement, live_node_count())
        self._groups: list[Any] = []  # every placement group this controller reserved and still holds
        if self.placement == "spread":  # the router alone (on this, the head node, if it has room), then a
            # SPREAD group per pool: the node whose loss ends the cluster anyway also holds the entry point
            self._pg = self._reserve(
                [router_resources(config)], "STRICT_PACK", "pdserve", ray.get_runtime_context().get_node_id()
            )
            try:
                # separate groups are placed one after another, not jointly: the most constrained pool
                # first (a custom resource or GPUs, then the larger), so that the others take what is left
                order = sorted(
                    (r for r in ROLES if r in roles),
                    reverse=True,
                    key=lambda r: (set(worker_resources(config, r)) != {"CPU"}, roles.count(r)),
                )
                pools = {
                    role: self._reserve(
                        [worker_resources(config, role)] * roles.count(role), "SPREAD", f"pdserve-{role}"
                    )
                    for role in order
                }
            except BaseException:
                self._remove_groups()
                raise
            placed = [(role, pools[role], roles[:i].count(role)) for i, role in enumerate(roles)]
        else:
            bundles = [router_resources(config)] + [worker_resources(config, role) for role in roles]
            self._pg = self._reserve(bundles, PLACEMENTS[self.placement], "pdserve")
            placed = [(role, None, i + 1) for i, role in enumerate(roles)]
        self._router: Any = None
        self._router_probe: Any = None  # pending address() call of the watcher
        self._autoscaler: Any = None  # cluster.ray_elastic.RayAutoscaler with elastic.autoscale
        try:
            for role, pg, bundle in placed:
                self._workers.append(self._new_worker(role, bundle=bundle, pg=pg))
            self._wait_serving(self._workers)
            self._router = self._start_router(self._workers)
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name="pdserve-watch", daemon=True)
        self._watcher.start()
        options = config.autoscale_options()
        if options is not None:  # `serve --ray --autoscale`: the loop runs here (see cluster.ray_elastic)
            from pdserve.cluster.ray_elastic import RayAutoscaler

            # with tenant tokens the autoscaler's status calls go in the first tenant's name
            self._autoscaler = RayAutoscaler(
                self,
                self.router_address_value,
                options,
                auth_token or next(iter(auth_tokens or {}), None),
                tls_ca_file=config.security.tls_cert or None,
                make_planner=make_planner,
            )

    # ----- placement -------------------------------------------------------------------------
    def _reserve(self, bundles: list[dict[str, float]], strategy: str, name: str = "", near: str | None = None) -> Any:  # noqa: ANN401 - PlacementGroup
        """A placement group of these bundles, ready (RuntimeError when the cluster cannot place it
        within startup_timeout_s); kept in `_groups` until removed. `near`: a node id it prefers
        (STRICT_PACK only; elsewhere when that node has no room)."""
        pg = placement_group(bundles, strategy=strategy, name=name, _soft_target_node_id=near)
        try:
            ray.get(pg.ready(), timeout=self.config.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(
                f"placement group {bundles} ({strategy}) not placed within "
                f"{self.config.startup_timeout_s:.0f} s: not enough resources in the cluster"
            ) from None
        self._groups.append(pg)
        return pg

    def _remove_group(self, pg: Any) -> None:  # noqa: ANN401 - PlacementGroup
        if any(pg is held for held in self._groups):
            self._groups = [held for held in self._groups if held is not pg]
            remove_placement_group(pg)

    def _remove_groups(self) -> None:
        for pg in list(self._groups):
            self._remove_group(pg)

    def placement_name(self) -> str:
        """The placement this deployment got (`resolve_placement` of the configured one)."""
        return self.placement

    # ----- actors ----------------------------------------------------------------------------
    def _new_worker(self, role: str, bundle: int, pg: Any = None) -> _Worker:  # noqa: ANN401 - PlacementGroup
        index = self._next_index[role]
        self._next_index[role] += 1
        name = f"{role}-{index}"
        options = worker_actor_options(self.config, role, name)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self._pg if pg is None else pg, bundle)
        config = worker_config(role, ray_worker_document(self.config, role, name), self._options.args_for(role))
        handle = _RemoteWorker.options(**options).remote(
            config, self._internal_token, router_token_digest(self._router_token)
        )
        return _Worker(name, role, handle, pg=pg)

    def _wait_serving(self, workers: list[_Worker]) -> None:
        addresses = ray.get([w.handle.address.remote() for w in workers], timeout=self.config.startup_timeout_s)
        for worker, address in zip(workers, addresses, strict=True):
            worker.address = address

    def _start_router(self, workers: list[_Worker]) -> Any:  # noqa: ANN401 - ray ActorHandle
        addresses = {role: [w.address for w in workers if w.role == role] for role in ROLES}
        router = _RemoteRouter.options(
            **router_actor_options(self.config),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, 0),
        ).remote(
            router_process(router_document(self.config, addresses), self._auth_token, self._auth_tokens),
            self._internal_token,
            self._router_token,
        )
        timeout = self.config.startup_timeout_s
        self.router_address_value = ray.get(router.address.remote(), timeout=timeout)
        self.router_http_address_value = ray.get(router.http_address.remote(), timeout=30)
        return router

    # ----- queries ---------------------------------------------------------------------------
    def router_address(self) -> str:
        """The router's current host:port (a restarted router on port 0 or on another node has a new one)."""
        return self.router_address_value

    def router_workers(self) -> list[dict[str, str]]:
        """What a (re)starting router must route to: every worker that serves and is not yet forgotten
        (draining ones included: the router sees them unhealthy and routes around them)."""
        with self._lock:
            return [{"address": w.address, "role": w.role} for w in self._workers if w.address]

    def router_http_address(self) -> str:
        """host:port of the router's HTTP API ("" when off)."""
        return self.router_http_address_value

    def workers(self) -> list[dict[str, Any]]:
        """name, role, address (as the router knows it) and draining of every worker, in start order."""
        with self._lock:
            return [
                {"name": w.name, "role": w.role, "address": w.address, "draining": w.draining} for w in self._workers
            ]

    def worker_info(self) -> list[dict[str, Any]]:
        """Each live worker's own info() (pid, node, idle, ...)."""
        with self._lock:
            workers = list(self._workers)
        infos = []
        for worker in workers:
            try:
                infos.append({"name": worker.name, **ray.get(worker.handle.info.remote(), timeout=10)})
            except RayError as exc:
                infos.append({"name": worker.name, "role": worker.role, "error": str(exc)})
        return infos

    # ----- watching --------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.config.ray.poll_interval_s):
            try:
                self.check_workers()
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("watch pass failed")

    def check_router(self) -> None:
        """Watcher pass for the router: note its address (it changes when a restarted router got a new port)."""
        if self._router is None:
            return
        if self._router_probe is None:
            self._router_probe = self._router.address.remote()
        ready, _ = ray.wait([self._router_probe], timeout=0)
        if not ready:
            return
        probe, self._router_probe = self._router_probe, None
        try:
            address = ray.get(probe)
        except RayError:  # restarting (or gone for good: nothing to do but report)
            return
        if address != self.router_address_value:
            log.warning("router moved from %s to %s (restarted)", self.router_address_value, address)
            self.router_address_value = address
            if self._autoscaler is not None:
                self._autoscaler.follow(address)

    def check_workers(self) -> None:
        """One watcher pass: ask each worker its address and role; re-register moved ones, drop dead
        ones, note the new role of one that switched (`pdserve role`, the autoscaler)."""
        self.check_router()
        with self._lock:
            workers = [w for w in self._workers if not w.draining]
        for worker in workers:
            if worker.probe is None:
                worker.probe = worker.handle.state.remote()
            ready, _ = ray.wait([worker.probe], timeout=0)
            if not ready:
                continue
            probe, worker.probe = worker.probe, None
            try:
                state = ray.get(probe)
            except ActorDiedError:
                log.warning("worker %s died for good; removing it from the router", worker.name)
                self._forget(worker)
                self._release_unused_groups([worker])
                continue
            except RayError:  # restarting: ask again next pass
                continue
            if state["address"] != worker.address:
                self._reregister(worker, state["address"], state["role"])
            elif state["role"] != worker.role:  # switched in place; the router switched it itself
                log.info("worker %s is now %s (was %s)", worker.name, state["role"], worker.role)
                worker.role = state["role"]

    def _reregister(self, worker: _Worker, address: str, role: str) -> None:
        """A restarted worker serves on a new port, in the role it was created with (an elastic one
        that had switched starts over in its first role)."""
        log.warning(
            "worker %s moved from %s to %s (restarted, %s); updating the router",
            worker.name,
            worker.address,
            address,
            role,
        )
        # the new address first: requests waiting for a worker of this role (restart_wait_s) never see
        # the pool without one
        ray.get(self._router.add_worker.remote(address, role))
        if worker.address:
            ray.get(self._router.remove_worker.remote(worker.address))
        worker.address, worker.role = address, role

    def _forget(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
        if worker.address:
            ray.get(self._router.remove_worker.remote(worker.address))

    # ----- scaling ---------------------------------------------------------------------------
    def scale(self, prefill: int, decode: int) -> dict[str, list[str]]:
        """Grow or shrink each pool to the given size; returns the names added and removed."""
        if prefill < 1 or decode < 1:
            raise ValueError(f"need prefill >= 1 and decode >= 1, got {prefill} and {decode}")
        with self._scale_lock:
            self.refresh_roles()
            with self._lock:
                current = {r: [w for w in self._workers if w.role == r and not w.draining] for r in ROLES}
            targets = {"prefill": prefill, "decode": decode}
            roles = [r for r in ROLES for _ in range(targets[r] - len(current[r]))]
            removed = [w for r in ROLES for w in current[r][targets[r] :]]
            added = self._add(roles)
            self._retire(removed)
        return {"added": [w.name for w in added], "removed": [w.name for w in removed]}

    def _add(self, roles: list[str]) -> list[_Worker]:
        """Start workers of these roles in a placement group of their own, register them once they serve."""
        if not roles:
            return []
        pg = self._placement_group_for(roles)
        added = [self._new_worker(r, bundle=i, pg=pg) for i, r in enumerate(roles)]
        try:
            self._wait_serving(added)
        except BaseException:  # e.g. no resources for them: take them back, keep the rest as is
            for worker in added:
                ray.kill(worker.handle, no_restart=True)
            self._remove_group(pg)
            raise
        for worker in added:
            ray.get(self._router.add_worker.remote(worker.address, worker.role))
        with self._lock:
            self._workers.extend(added)
        return added

    def refresh_roles(self) -> None:
        """Read every live worker's current role now (the watcher does it each poll; a switch may have
        happened since): `scale`, `add_worker` and `remove_worker` count workers by role."""
        with self._lock:
            workers = [w for w in self._workers if not w.draining and w.address]
        try:
            states = ray.get([w.handle.state.remote() for w in workers], timeout=30)
        except RayError as exc:  # a worker restarting: the watcher sorts it out
            log.warning("reading worker roles: %s", exc)
            return
        for worker, state in zip(workers, states, strict=True):
            if state["address"] == worker.address:
                worker.role = state["role"]

    def add_worker(self, role: str) -> str:
        """Start one worker of `role` and register it once it serves (the autoscaler's scale-out);
        returns its name."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        with self._scale_lock:
            (added,) = self._add([role])
        return added.name

    def remove_worker(self, name: str) -> bool:
        """Retire one worker by name (the autoscaler's scale-in): it drains (reports unhealthy, takes
        no new work; the router migrates the requests running on a decode worker to the others),
        then leaves the router and its actor is killed once idle. False when no live worker has that
        name; ValueError when it is the last worker of its role."""
        with self._scale_lock:
            self.refresh_roles()
            with self._lock:
                live = [w for w in self._workers if not w.draining]
            worker = next((w for w in live if w.name == name), None)
            if worker is None:
                return False
            if sum(w.role == worker.role for w in live) <= 1:
                raise ValueError(f"{name} is the last {worker.role} worker")
            self._retire([worker])
        return True

    def _placement_group_for(self, roles: list[str]) -> Any:  # noqa: ANN401 - PlacementGroup
        """A placement group (the deployment's strategy) with one bundle per worker a scale-up adds.

        Ray cannot add bundles to an existing group, so each scale-up gets a group of its own: the
        strategy holds among the workers added together (and, being bundles, their resources are
        reserved as a unit), not between them and the earlier ones."""
        bundles = [worker_resources(self.config, role) for role in roles]
        return self._reserve(bundles, PLACEMENTS[self.placement])

    def _release_unused_groups(self, retired: list[_Worker]) -> None:
        """Remove the scale-up placement groups none of whose workers is left."""
        with self._lock:
            in_use = {id(w.pg) for w in self._workers if w.pg is not None}
        for pg in {id(w.pg): w.pg for w in retired if w.pg is not None}.values():
            if id(pg) not in in_use:
                self._remove_group(pg)

    def _retire(self, workers: list[_Worker]) -> None:
        """Drain, wait until idle (at most drain_timeout_s), deregister and kill each worker."""
        if not workers:
            return
        for worker in workers:
            worker.draining = True
        ray.get([w.handle.drain.remote() for w in workers], timeout=30)
        time.sleep(2 * 0.5 + 0.2)  # two router health polls: it has stopped routing to them
        deadline = time.monotonic() + drain_timeout_s(self.config)
        pending = list(workers)
        while pending and time.monotonic() < deadline:
            idle = ray.get([w.handle.is_idle.remote() for w in pending], timeout=30)
            pending = [w for w, done in zip(pending, idle, strict=True) if not done]
            time.sleep(0.2)
        for worker in workers:
            self._forget(worker)
            try:
                ray.get(worker.handle.stop.remote(), timeout=10)
            except RayError as exc:
                log.warning("stopping %s: %s", worker.name, exc)
            ray.kill(worker.handle, no_restart=True)
            log.info("worker %s retired", worker.name)
        self._release_unused_groups(workers)

    # ----- the autoscaler (cluster.ray_elastic) -----------------------------------------------
    def resize(self, kind: str, role: str, worker_id: str = "", reason: str = "requested") -> str:
        """Carry out one autoscaler resize decision ("add" a worker of `role`, "remove" `worker_id`
        or, without one, the newest worker of `role`) through the Ray actuator, within the elastic
        section's min/max workers; returns the outcome ("added NAME", "removed NAME", "refused: ...")."""
        from pdserve.cluster.autoscaler import Decision
        from pdserve.cluster.ray_elastic import RayActuator

        if self._autoscaler is not None:
            actuator = self._autoscaler.actuator
        else:
            elastic = self.config.elastic
            actuator = RayActuator(self, elastic.min_workers, elastic.max_workers)
        return actuator(Decision(kind, role, reason, worker_id))

    def autoscaler_status(self) -> dict[str, Any] | None:
        """The autoscaler's latest measurements, decisions and resizes (None: not autoscaling)."""
        return self._autoscaler.status() if self._autoscaler is not None else None

    def autoscaler_tick(self) -> list[dict[str, str]]:
        """Run one autoscaler tick now (as the loop does every elastic.interval_s); its decisions."""
        if self._autoscaler is None:
            raise RuntimeError("the deployment runs no autoscaler (serve --autoscale)")
        return [
            {"kind": d.kind, "role": d.role, "worker_id": d.worker_id, "reason": d.reason}
            for d in self._autoscaler.loop.tick()
        ]

    # ----- teardown --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the autoscaler, the router and every worker, release the placement group."""
        self._stop.set()
        if getattr(self, "_autoscaler", None) is not None:
            self._autoscaler.stop()
        if self._router is not None:
            try:
                ray.get(self._router.stop.remote(), timeout=self.config.router.drain_timeout_s + 15)
            except RayError as exc:
                log.warning("stopping the router: %s", exc)
            ray.kill(self._router, no_restart=True)
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            ray.kill(worker.handle, no_restart=True)
        self._remove_groups()


_RemoteWorker = ray.remote(WorkerActor)
_RemoteRouter = ray.remote(RouterActor)
_RemoteController = ray.remote(Controller)

HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource


def controller_node_id() -> str:
    """The node the controller goes on: the head node (its loss ends the cluster anyway), else this
    driver's node. The router and workers are the controller's (non-detached) actors and die with it:
    left to Ray's scheduler a zero-CPU controller can land on any worker node, and losing that node
    would take the whole deployment down."""
    for node in ray.nodes():
        if node.get("Alive") and HEAD_NODE_RESOURCE in node.get("Resources", {}):
            return str(node["NodeID"])
    return ray.get_runtime_context().get_node_id()


T = TypeVar("T")

#: what Ray's exception says when a new node's raylet did not register within Ray's fixed 30 s
RAY_START_TIMED_OUT = "timed out during startup"


def start_with_retry(
    start: Callable[[], T], attempts: int = 2, pause_s: float = 10.0, cleanup: Callable[[], None] | None = None
) -> T:
    """`start()` (a local ray.init, or a test's multi-node cluster), tried once more when Ray's
    start-up times out: Ray gives a new node's raylet a fixed 30 s to register, which a busy small
    machine, or one where another instance is still stopping, can miss. Between tries: a warning,
    ray.shutdown(), `cleanup()` and a pause. Any other failure, or the last time-out, is raised."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except Exception as exc:  # Ray raises a bare Exception for this
            if RAY_START_TIMED_OUT not in str(exc) or attempt == attempts:
                raise
            log.warning(
                "starting Ray timed out (try %d of %d): %s; trying again in %.0f s", attempt, attempts, exc, pause_s
            )
            ray.shutdown()
            if cleanup is not None:
                cleanup()
            time.sleep(pause_s)
    raise AssertionError("unreachable: the loop returns or raises")


def check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast (ConnectionError) when `address` is a Ray GCS "host:port" that accepts no connection:
    ``ray.init`` would otherwise retry for minutes. "auto", ``ray://`` and None are left to Ray
    ("auto" with no running cluster fails at once by itself)."""
    import socket

    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConnectionError(f"Ray address must be host:port, auto or ray://host:port, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"no Ray cluster at {address}: {exc} (start one with `ray start --head`, "
            f"or pass the head's GCS address, host:6379 by default)"
        ) from None


def _configured_internal_token(config: DeploymentConfig) -> str | None:
    """security.internal_token_file, read here on the driver (the actors get the token itself)."""
    path = config.security.internal_token_file
    if not path:
        return None
    token = Path(path).read_text(encoding="utf-8").splitlines()[0].strip() if Path(path).stat().st_size else ""
    if not token:
        raise ValueError(f"security.internal_token_file: {path} is empty")
    return token


def get_controller(address: str | None = "auto") -> Any:  # noqa: ANN401 - ray ActorHandle
    """The running deployment's controller (connects to Ray at `address` unless connected)."""
    if not ray.is_initialized():
        check_reachable(address)
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)


class RayCluster:
    """Driver-side handle: starts the deployment on construction; ``stop()`` tears it down (idempotent)."""

    def __init__(
        self,
        config: DeploymentConfig,
        make_planner: Callable[..., Any] | None = None,
        options: LaunchOptions | None = None,
    ) -> None:
        """`make_planner`: the autoscaler's planner factory, run in the controller (see Controller);
        `options`: extra worker flags (the router actor takes none)."""
        if config.mode != "ray":
            raise ValueError(f"RayCluster runs mode ray, got a config of mode {config.mode!r}")
        options = options or LaunchOptions()
        if options.router_args:
            raise ValueError("LaunchOptions.router_args: the Ray router actor takes no extra flags")
        self.config = config
        internal = _configured_internal_token(config) or launcher_token()
        auth = load_token(_abspath(config.security.auth_token_file), os.environ.get("PDSERVE_AUTH_TOKEN"))
        tenants_file = config.security.auth_tokens_file  # read here too: the file need not be on the router's node
        tenants = load_tenant_tokens(tenants_file) if tenants_file else None
        self._own_ray = False
        self._stopped = False
        address = config.ray.address
        if not ray.is_initialized():
            check_reachable(address)  # with an address, never start a local instance instead
            if address is None:  # a local instance of our own: its start-up may time out on a busy machine
                num_cpus = local_num_cpus(config)
                start_with_retry(lambda: ray.init(namespace=NAMESPACE, include_dashboard=False, num_cpus=num_cpus))
            else:
                ray.init(address=address, namespace=NAMESPACE, include_dashboard=False)
            self._own_ray = address is None
        atexit.register(self.stop)
        try:
            self._controller = _RemoteController.options(
                name=CONTROLLER_NAME,
                namespace=NAMESPACE,
                lifetime="detached",
                num_cpus=0,
                max_concurrency=16,
                scheduling_strategy=NodeAffinitySchedulingStrategy(controller_node_id(), soft=False),
            ).remote(config, internal, auth, options, make_planner, tenants)
            self.router_address: str = ray.get(
                self._controller.router_address.remote(), timeout=config.startup_timeout_s + 60
            )
            self.http_address: str = ray.get(self._controller.router_http_address.remote(), timeout=60)
            self.placement: str = ray.get(self._controller.placement_name.remote(), timeout=60)
        except BaseException:
            self.stop()
            raise

    @property
    def controller(self) -> Any:  # noqa: ANN401 - ray ActorHandle
        return self._controller

    def current_router_address(self) -> str:
        """The router's address now (``router_address`` is the one it started with; a restarted router
        on port 0, or on another node, has a new one)."""
        return str(ray.get(self._controller.router_address.remote(), timeout=30))

    def workers(self) -> list[dict[str, Any]]:
        return list(ray.get(self._controller.workers.remote()))

    def worker_info(self) -> list[dict[str, Any]]:
        return list(ray.get(self._controller.worker_info.remote()))

    def scale(self, prefill: int, decode: int) -> dict[str, list[str]]:
        """Resize the pools (blocks until added workers serve and removed ones are drained and gone)."""
        timeout = self.config.startup_timeout_s + drain_timeout_s(self.config) + 60
        return dict(ray.get(self._controller.scale.remote(prefill, decode), timeout=timeout))

    def resize(self, kind: str, role: str, worker_id: str = "") -> str:
        """One autoscaler resize through the controller's Ray actuator (`Controller.resize`)."""
        timeout = self.config.startup_timeout_s + drain_timeout_s(self.config) + 60
        return str(ray.get(self._controller.resize.remote(kind, role, worker_id), timeout=timeout))

    def autoscaler_status(self) -> dict[str, Any] | None:
        status: dict[str, Any] | None = ray.get(self._controller.autoscaler_status.remote(), timeout=30)
        return status

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        controller = getattr(self, "_controller", None)
        if controller is not None:
            try:
                ray.get(controller.shutdown.remote(), timeout=60)
            except RayError as exc:
                log.warning("controller shutdown: %s", exc)
            ray.kill(controller, no_restart=True)
        if self._own_ray:
            ray.shutdown()

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
