"""The SLO autoscaler on a Ray deployment (`pdserve serve --ray --autoscale --slo ...`).

The decision core and the control loop are `cluster.autoscaler`'s (`Autoscaler`, `AutoscalerLoop`),
unchanged: the loop reads Router.GetStatus, the core decides, role switches go through
Router.SwitchRole (the elastic worker actors switch in place). What Ray adds is the actuator for
the other two decisions, `RayActuator` (the loop's ``resize``):

- ``add``: `Controller.add_worker(role)`: a new elastic worker actor in a placement group of its own,
  registered with the router once it serves;
- ``remove``: `Controller.remove_worker(name)`: the worker drains first (reports unhealthy, takes no
  new work; the router live-migrates the requests running on a decode worker to the others), then
  leaves the router and its actor is killed.

Both are bounded by ``--min-workers`` / ``--max-workers`` here as well as in the core (the actuator
counts the controller's live workers, the core the router's healthy ones; they can differ while a
worker starts or drains), and a remove never takes the last worker of a role.

Where the loop runs: in the controller actor (`RayAutoscaler`, started by `Controller.__init__`),
not in the `serve` driver, because the controller owns the worker set (a resize is a method call
under the same lock as `pdserve scale`, not a Ray round trip from outside), sits pinned on the head
node, learns the router's new address when a restarted router moves (`follow`), and lives exactly
as long as the deployment, whichever process started it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from pdserve.cluster.autoscaler import (
    Autoscaler,
    AutoscalerLoop,
    Decision,
    Observation,
    PlannerFactory,
    autoscaler_config,
)

log = logging.getLogger(__name__)


class WorkerSet(Protocol):
    """What the actuator needs of the controller (`cluster.ray_cluster.Controller`)."""

    def workers(self) -> list[dict[str, Any]]: ...

    def add_worker(self, role: str) -> str: ...

    def remove_worker(self, name: str) -> bool: ...


class RayActuator:
    """`AutoscalerLoop.resize` on Ray: carries out ``add`` and ``remove`` decisions within
    [min_workers, max_workers]; every call is recorded in `actions` (time, decision, outcome)."""

    def __init__(self, workers: WorkerSet, min_workers: int, max_workers: int) -> None:
        if not 1 <= min_workers <= max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {min_workers}, {max_workers}")
        self.workers = workers
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.actions: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def live(self) -> list[dict[str, Any]]:
        """The workers that count: started and not draining."""
        return [w for w in self.workers.workers() if not w["draining"]]

    def __call__(self, decision: Decision, obs: Observation | None = None) -> str:
        """Carry out `decision`; returns the outcome ("added NAME", "removed NAME" or "refused: why")."""
        with self._lock:
            started = time.monotonic()
            try:
                outcome = self._apply(decision)
            except Exception as exc:  # noqa: BLE001 - recorded; the loop goes on
                outcome = f"failed: {type(exc).__name__}: {exc}"
            log.info(
                "autoscaler on Ray: %s %s %s -> %s", decision.kind, decision.role, decision.worker_id or "-", outcome
            )
            self.actions.append(
                {
                    "at": time.time(),
                    "took_s": time.monotonic() - started,
                    "kind": decision.kind,
                    "role": decision.role,
                    "worker_id": decision.worker_id,
                    "reason": decision.reason,
                    "outcome": outcome,
                }
            )
            return outcome

    def _apply(self, decision: Decision) -> str:
        live = self.live()
        if decision.kind == "add":
            if len(live) >= self.max_workers:
                return f"refused: {len(live)} workers, max_workers {self.max_workers}"
            return f"added {self.workers.add_worker(decision.role)}"
        if decision.kind == "remove":
            if len(live) <= self.min_workers:
                return f"refused: {len(live)} workers, min_workers {self.min_workers}"
            name = decision.worker_id or self._victim(live, decision.role)
            if not name:
                return f"refused: no {decision.role} worker to remove"
            if not self.workers.remove_worker(name):
                return f"refused: no live worker {name}"
            return f"removed {name}"
        return f"refused: {decision.kind!r} is not a resize"

    @staticmethod
    def _victim(live: list[dict[str, Any]], role: str) -> str:
        """The newest worker of `role`, unless it is the last one."""
        of_role = [w["name"] for w in live if w["role"] == role]
        return of_role[-1] if len(of_role) > 1 else ""


class RayAutoscaler:
    """The autoscaler loop of a Ray deployment, run inside the controller actor."""

    def __init__(
        self,
        workers: WorkerSet,
        router_address: str,
        options: Any,  # noqa: ANN401 - AutoscaleOptions
        token: str | None = None,
        tls_ca_file: str | None = None,
        make_planner: PlannerFactory | None = None,
    ) -> None:
        """`tls_ca_file`: the router's TLS certificate, read on this (the head) node, as trust root.
        `make_planner`: what builds the planner (the CLI's, from the profile; None: pressure only)."""
        config = autoscaler_config(options, can_resize=True)
        planner = make_planner(config) if make_planner else None
        self.core = Autoscaler(config, planner)
        self.actuator = RayActuator(workers, options.min_workers, options.max_workers)
        self.interval_s = options.interval_s
        self.token = token
        self.tls_ca_file = tls_ca_file
        self._lock = threading.Lock()
        self.loop = self._start(router_address)
        log.info(
            "autoscaler on Ray: keeping %s with %d..%d workers, %s",
            options.slo,
            options.min_workers,
            options.max_workers,
            "planner on " + options.profile if planner else "no planner",
        )

    def _start(self, router_address: str) -> AutoscalerLoop:
        return AutoscalerLoop(
            router_address,
            self.core,
            self.interval_s,
            self.token,
            resize=lambda decision, obs: self.actuator(decision, obs),
            tls_ca_file=self.tls_ca_file,
        ).start()

    def follow(self, router_address: str) -> None:
        """The router moved (restarted on a new port or node): go on against the new address, with
        the same decision core (its hysteresis and cool-down state) and history."""
        with self._lock:
            if router_address == self.loop.router_address:
                return
            old = self.loop
            old.stop()
            self.loop = self._start(router_address)
            self.loop.history = old.history
            self.loop.metrics = old.metrics

    def status(self) -> dict[str, Any]:
        """What the latest tick measured, every decision the loop made, and the resizes' outcomes."""
        return {
            "last": dict(self.core.last),
            "decisions": list(self.loop.history),
            "resizes": list(self.actuator.actions),
        }

    def stop(self) -> None:
        self.loop.stop()
