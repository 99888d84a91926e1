"""The SLO autoscaler: a control loop that reads the router's status and moves workers between prefill
and decode (and, on Ray, adds or removes workers within bounds) to keep TTFT and TPOT SLOs.

Split in two so the policy is testable without servers:
- `Autoscaler.decide(Observation) -> list[Decision]` is the decision core: it keeps only the
  hysteresis state (when it last acted, which direction it wants and since when) and is fed plain
  dataclasses (`Observation`), e.g. a synthetic metric trace in tests.
- `AutoscalerLoop` turns `Router.GetStatus` (workers' WorkerInfo plus the requests that finished
  recently) into Observations every `interval_s`, runs the core, and executes its decisions
  (`Router.SwitchRole`; on Ray the controller's `scale`). Every decision is logged with its reason
  and counted in Prometheus metrics (`AutoscalerMetrics`).

Policy, per tick:
1. Over the requests that finished in the last `window_s` (and after the last action, whose effect
   they would not show), measure TTFT and TPOT attainment and the workload mix (prompt and output
   lengths, arrival rate).
2. Backlog first (leading signals: finished requests lag behind a shift): requests waiting in the
   router for a decode slot (>= `decode_backlog_requests`) want a decode worker; prompt tokens
   queued per prefill worker (>= `prefill_backlog_tokens`) want a prefill worker.
   Otherwise the target split: with a latency profile, the planner (`capacity.planner.max_rate`, as `pdserve plan`)
   finds for the mix the prefill:decode split of the current worker count with the highest goodput
   (cached per mix bucket); without one, the pressure signals choose: TTFT misses while prefill
   workers hold queued prompt tokens want a prefill worker; TPOT misses, or requests waiting in the
   router's admission queue for a decode slot, want a decode worker.
3. Hysteresis: the wanted direction must hold for `confirm_s` without a break, and an SLO must be
   missed (attainment below `target` by more than two binomial standard deviations of the
   window's sample count, so noise around a met target is not a miss) or the planner must predict
   `min_gain` more goodput; reversing the previous move needs twice `confirm_s`. After any action
   nothing happens for `cooldown_s`. One worker moves per action; a stage never drops below one worker.
4. On Ray, when SLOs are missed and no switch helps (the split already matches the target), add a
   worker of the wanted role below `max_workers`; when attainment stays >= `scale_in_attainment` and
   the workers are lightly used for `scale_in_s`, remove one above `min_workers`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: PREFILL,
    common_pb2.WORKER_ROLE_DECODE: DECODE,
    common_pb2.WORKER_ROLE_COLOCATED: "colocated",
}


# ----- what the core sees and says ----------------------------------------------------------------
@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    role: str  # "prefill", "decode" or "colocated"
    healthy: bool = True
    queue_depth: int = 0
    queued_prompt_tokens: int = 0
    running: int = 0
    max_running: int = 0
    kv_used: int = 0
    kv_total: int = 0


@dataclass(frozen=True)
class Sample:
    """One finished request (Router StatusResponse.recent)."""

    finished_at: float  # seconds, on the Observation's clock
    ttft_s: float
    tpot_s: float
    prompt_tokens: int
    output_tokens: int
    ok: bool = True
    queue_s: float = 0.0


@dataclass(frozen=True)
class Observation:
    now: float  # seconds (any monotonic clock, the samples' too)
    workers: tuple[WorkerView, ...]
    samples: tuple[Sample, ...]  # finished recently, any order
    router_queued: int = 0  # requests waiting in the router for a decode slot


@dataclass(frozen=True)
class Decision:
    """`switch`: worker_id to role; `add`: one worker of role; `remove`: worker_id."""

    kind: str
    role: str
    reason: str
    worker_id: str = ""


@dataclass(frozen=True)
class Mix:
    """The workload of the window: mean prompt and output tokens, and requests per second."""

    prompt_tokens: float
    output_tokens: float
    rate: float


@dataclass(frozen=True)
class AutoscalerConfig:
    ttft_s: float | None = None
    tpot_s: float | None = None
    target: float = 0.9  # attainment under which an SLO counts as missed
    window_s: float = 10.0  # finished requests looked at
    min_samples: int = 8  # fewer in the window: no decision
    confirm_s: float = 3.0  # a wanted direction must hold this long
    cooldown_s: float = 8.0  # quiet time after an action
    min_gain: float = 0.15  # planner: act on a split predicted this much better even while SLOs hold
    decode_backlog_requests: int = 8  # this many waiting in the router for a decode slot: decode is short
    prefill_backlog_tokens: int = 16384  # queued prompt tokens per prefill worker: prefill is short
    min_workers: int = 2
    max_workers: int = 8
    can_resize: bool = False  # Ray: add/remove workers; local: switch roles only
    scale_in_attainment: float = 0.99
    scale_in_utilization: float = 0.3
    scale_in_s: float = 60.0

    def __post_init__(self) -> None:
        if self.ttft_s is None and self.tpot_s is None:
            raise ValueError("the autoscaler needs a TTFT or a TPOT SLO")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be in (0, 1], got {self.target}")
        for name in ("window_s", "confirm_s", "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 2 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 2 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}")


#: (mix, number of workers) -> {prefill workers: predicted goodput}; None without a profile.
SplitPlanner = Callable[[Mix, int], dict[int, float]]


# ----- the decision core --------------------------------------------------------------------------
class Autoscaler:
    """Decides from Observations; see the module docstring. Not thread-safe (one loop calls it)."""

    def __init__(self, config: AutoscalerConfig, planner: SplitPlanner | None = None) -> None:
        self.config = config
        self.planner = planner
        self.last_action_at = -math.inf
        self.last_direction = ""  # role the last switch moved a worker to
        self._wanted = ""  # direction wanted now ("prefill", "decode" or "")
        self._wanted_since = 0.0
        self._quiet_since: float | None = None  # scale-in: since when the workers are lightly used
        self._grow = ""  # scale-out: the role wanted, and since when
        self._grow_since = 0.0
        self.last: dict[str, Any] = {}  # what the latest tick measured (metrics, logs)

    def decide(self, obs: Observation) -> list[Decision]:
        c = self.config
        since = max(obs.now - c.window_s, self.last_action_at)
        samples = [s for s in obs.samples if s.finished_at >= since]
        healthy = [w for w in obs.workers if w.role in (PREFILL, DECODE)]  # a switching worker is unhealthy
        prefill = [w for w in healthy if w.role == PREFILL]
        decode = [w for w in healthy if w.role == DECODE]
        self.last = {"samples": len(samples), "prefill": len(prefill), "decode": len(decode)}
        if len(samples) < c.min_samples or obs.now - self.last_action_at < c.cooldown_s:
            self._wanted = ""
            return []
        ttft_ok, tpot_ok = self._attainment(samples)
        missed = min(ttft_ok, tpot_ok) < self._miss_line(len(samples))
        mix = _mix(samples, obs.now - since)
        direction, why, target_p = self._direction(obs, prefill, decode, mix, ttft_ok, tpot_ok, missed)
        self.last.update(
            ttft_attainment=ttft_ok,
            tpot_attainment=tpot_ok,
            target_prefill=target_p,
            prompt_tokens=mix.prompt_tokens,
            output_tokens=mix.output_tokens,
            rate=mix.rate,
        )
        if not self._confirmed(direction, obs.now):
            return self._maybe_resize(obs, healthy, missed, direction or self._pressure_role(prefill, ttft_ok, tpot_ok))
        decision = self._switch(direction, prefill, decode, why)
        if decision is None:
            return self._maybe_resize(obs, healthy, missed, direction)
        self._acted(obs.now, direction)
        return [decision]

    # direction -----------------------------------------------------------------------------------
    def _direction(
        self,
        obs: Observation,
        prefill: list[WorkerView],
        decode: list[WorkerView],
        mix: Mix,
        ttft_ok: float,
        tpot_ok: float,
        missed: bool,
    ) -> tuple[str, str, int | None]:
        """(role to move one worker to or "", why, the planner's prefill count or None)."""
        backlog = self._backlog(obs, prefill)
        if backlog:  # a leading signal: the finished requests (and the mix they show) lag behind it
            return backlog
        n = len(prefill) + len(decode)
        if self.planner is not None and n >= 2:
            rates = self.planner(mix, n)
            if rates:
                best = max(rates, key=lambda p: (rates[p], -abs(p - len(prefill))))
                current = rates.get(len(prefill), 0.0)
                gain = rates[best] / current - 1 if current > 0 else math.inf
                if best != len(prefill) and (missed or gain >= self.config.min_gain):
                    role = PREFILL if best > len(prefill) else DECODE
                    return (
                        role,
                        (
                            f"planner: {best}P{n - best}D sustains {rates[best]:.2f} req/s vs "
                            f"{current:.2f} for {len(prefill)}P{len(decode)}D at {_fmt_mix(mix)}"
                        ),
                        best,
                    )
                if not missed:
                    return "", "", best
                # missed although the planner likes this split for the mix of the requests that
                # finished: the mix is shifting (they lag behind); follow the pressure signals
                role = self._pressure_role(prefill, ttft_ok, tpot_ok, obs.router_queued)
                return (
                    role,
                    f"SLO missed at the planner's split (ttft {ttft_ok:.2f}, tpot {tpot_ok:.2f}); pressure on {role}",
                    best,
                )
        if not missed:
            return "", "", None
        role = self._pressure_role(prefill, ttft_ok, tpot_ok, obs.router_queued)
        return role, f"SLO missed (ttft {ttft_ok:.2f}, tpot {tpot_ok:.2f}); pressure on {role}", None

    def _backlog(self, obs: Observation, prefill: list[WorkerView]) -> tuple[str, str, None] | None:
        """A queue that only one stage builds: requests waiting in the router for a decode slot, or
        prompt tokens waiting on the prefill workers (per worker)."""
        c = self.config
        if obs.router_queued >= c.decode_backlog_requests:
            return DECODE, f"{obs.router_queued} requests wait in the router for a decode slot", None
        queued = sum(w.queued_prompt_tokens for w in prefill) / max(1, len(prefill))
        if prefill and queued >= c.prefill_backlog_tokens:
            return PREFILL, f"{queued:.0f} prompt tokens queued per prefill worker", None
        return None

    def _miss_line(self, n: int) -> float:
        """Attainment under which the window counts as missing the target: the target less two
        binomial standard deviations of n samples (noise around a met target does not count)."""
        t = self.config.target
        return t - 2 * math.sqrt(t * (1 - t) / max(n, 1))

    def _pressure_role(self, prefill: list[WorkerView], ttft_ok: float, tpot_ok: float, router_queued: int = 0) -> str:
        """Which stage is short: decode when TPOT misses or requests wait for decode slots, else
        prefill when TTFT misses while prefill workers hold queued prompts."""
        line = self._miss_line(self.last.get("samples", 0))
        if tpot_ok < line or router_queued > 0:
            return DECODE
        if ttft_ok < line and any(w.queue_depth or w.queued_prompt_tokens for w in prefill):
            return PREFILL
        return DECODE if ttft_ok < line else ""

    def _confirmed(self, direction: str, now: float) -> bool:
        if direction != self._wanted:
            self._wanted, self._wanted_since = direction, now
        if not direction:
            return False
        needed = self.config.confirm_s * (2 if self.last_direction and direction != self.last_direction else 1)
        return now - self._wanted_since >= needed

    def _switch(self, role: str, prefill: list[WorkerView], decode: list[WorkerView], why: str) -> Decision | None:
        source = decode if role == PREFILL else prefill
        if len(source) <= 1:  # never empty a stage
            return None
        # the worker that empties soonest: fewest requests held
        worker = min(source, key=lambda w: (w.running + w.queue_depth, w.queued_prompt_tokens, w.worker_id))
        return Decision("switch", role, why, worker.worker_id)

    def _acted(self, now: float, direction: str) -> None:
        self.last_action_at = now
        self.last_direction = direction
        self._wanted = ""
        self._quiet_since = None

    # resize (Ray) ----------------------------------------------------------------------------------
    def _maybe_resize(self, obs: Observation, workers: list[WorkerView], missed: bool, role: str) -> list[Decision]:
        c = self.config
        if not c.can_resize:
            return []
        n = len(workers)
        if not missed:
            self._grow = ""
        if missed and role and n < c.max_workers and self._confirmed_resize(obs.now, role):
            self._acted(obs.now, role)
            return [Decision("add", role, f"SLO missed with {n} workers; adding a {role} worker")]
        busy = max((w.running / w.max_running for w in workers if w.max_running), default=0.0)
        quiet = not missed and busy <= c.scale_in_utilization and self._attained(obs) >= c.scale_in_attainment
        if not quiet:
            self._quiet_since = None
            return []
        self._quiet_since = obs.now if self._quiet_since is None else self._quiet_since
        if n > c.min_workers and obs.now - self._quiet_since >= c.scale_in_s:
            by_role = {r: [w for w in workers if w.role == r] for r in (PREFILL, DECODE)}
            role = DECODE if len(by_role[DECODE]) >= len(by_role[PREFILL]) else PREFILL
            if len(by_role[role]) > 1:
                victim = min(by_role[role], key=lambda w: (w.running + w.queue_depth, w.worker_id))
                self._acted(obs.now, "")
                return [
                    Decision(
                        "remove",
                        role,
                        f"SLOs held >= {c.scale_in_attainment:.2f} at <= "
                        f"{c.scale_in_utilization:.0%} use for {c.scale_in_s:.0f}s",
                        victim.worker_id,
                    )
                ]
        return []

    def _confirmed_resize(self, now: float, role: str) -> bool:
        if role != self._grow:
            self._grow, self._grow_since = role, now
        return now - self._grow_since >= self.config.confirm_s

    def _attained(self, obs: Observation) -> float:
        samples = [s for s in obs.samples if s.finished_at >= max(obs.now - self.config.window_s, self.last_action_at)]
        return min(self._attainment(samples)) if samples else 0.0

    def _attainment(self, samples: Sequence[Sample]) -> tuple[float, float]:
        """(TTFT attainment, TPOT attainment); 1.0 for an SLO not set. A failed request misses both."""
        c = self.config
        n = len(samples)
        if not n:
            return 1.0, 1.0
        ttft = 1.0 if c.ttft_s is None else sum(s.ok and s.ttft_s <= c.ttft_s for s in samples) / n
        tpot = 1.0 if c.tpot_s is None else sum(s.ok and s.tpot_s <= c.tpot_s for s in samples) / n
        return ttft, tpot


def _mix(samples: Sequence[Sample], span_s: float) -> Mix:
    n = len(samples)
    return Mix(
        sum(s.prompt_tokens for s in samples) / n, sum(s.output_tokens for s in samples) / n, n / max(span_s, 1e-3)
    )


def _fmt_mix(mix: Mix) -> str:
    return f"{mix.rate:.2f} req/s, {mix.prompt_tokens:.0f} prompt / {mix.output_tokens:.0f} output tokens"


# ----- the planner, handed in -------------------------------------------------------------------
#: Builds the SplitPlanner for the loop's config (its SLOs). `capacity.splits` makes one from a latency
#: profile; the autoscaler never imports capacity: the CLI hands it this (a factory, so that a Ray
#: controller builds the planner on its own node).
PlannerFactory = Callable[[AutoscalerConfig], SplitPlanner]


# ----- metrics ------------------------------------------------------------------------------------
class AutoscalerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "pdserve_autoscaler_decisions",
            "Autoscaler actions by kind and role",
            ["kind", "role", "outcome"],
            registry=r,
        )
        self.workers = Gauge(
            "pdserve_autoscaler_workers", "Workers per role as the autoscaler saw them", ["role"], registry=r
        )
        self.attainment = Gauge(
            "pdserve_autoscaler_slo_attainment", "SLO attainment over the window", ["slo"], registry=r
        )
        self.target_prefill = Gauge(
            "pdserve_autoscaler_target_prefill_workers",
            "Prefill workers the planner recommends for the current mix (-1: none)",
            registry=r,
        )
        self.last_decision = Gauge(
            "pdserve_autoscaler_last_decision_timestamp_seconds",
            "Unix time of the autoscaler's latest action (0: none yet)",
            registry=r,
        )

    def observe(self, last: dict[str, Any]) -> None:
        for role in (PREFILL, DECODE):
            if role in last:
                self.workers.labels(role).set(last[role])
        for slo in ("ttft", "tpot"):
            if f"{slo}_attainment" in last:
                self.attainment.labels(slo).set(last[f"{slo}_attainment"])
        target = last.get("target_prefill")
        self.target_prefill.set(-1 if target is None else target)


# ----- the loop -----------------------------------------------------------------------------------
def observation_from_status(status: router_pb2.StatusResponse, now: float) -> Observation:
    """A router StatusResponse (with `recent`) as the core's Observation, on the clock `now`."""
    workers = tuple(
        WorkerView(
            w.worker_id or w.address,
            ROLE_NAMES.get(w.role, "unknown"),
            w.healthy,
            w.queue_depth,
            w.queued_prompt_tokens,
            w.running_requests,
            w.max_running_requests,
            w.kv_blocks_used,
            w.kv_blocks_total,
        )
        for w in status.workers
    )
    samples = tuple(
        Sample(now - r.finished_ago_s, r.ttft_s, r.tpot_s, r.prompt_tokens, r.output_tokens, r.ok, r.queue_s)
        for r in status.recent
    )
    return Observation(now, workers, samples, status.queued_requests)


@dataclass
class AutoscalerLoop:
    """Runs `Autoscaler` against a router every `interval_s` in a daemon thread; `execute` carries
    out decisions (default: Router.SwitchRole; `resize` for add/remove, e.g. a Ray controller)."""

    router_address: str
    core: Autoscaler
    interval_s: float = 1.0
    token: str | None = None
    resize: Callable[[Decision, Observation], object] | None = None
    tls_ca_file: str | None = None  # a router serving TLS: PEM to trust (serve passes its own certificate)
    metrics: AutoscalerMetrics = field(default_factory=AutoscalerMetrics)
    history: list[dict[str, Any]] = field(default_factory=list)  # every action: time, decision, outcome

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        if self.tls_ca_file:
            with open(self.tls_ca_file, "rb") as f:
                self._channel = grpc.secure_channel(self.router_address, grpc.ssl_channel_credentials(f.read()))
        else:
            self._channel = grpc.insecure_channel(self.router_address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._metadata = (("authorization", f"Bearer {self.token}"),) if self.token else None
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)

    def start(self) -> AutoscalerLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=30)
        self._channel.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except grpc.RpcError as exc:
                log.warning("autoscaler: router unreachable: %s: %s", exc.code().name, exc.details())
            except Exception:  # a bug here must not stop serving
                log.exception("autoscaler tick failed")

    def tick(self) -> list[Decision]:
        status = self._stub.GetStatus(
            router_pb2.StatusRequest(recent_window_s=self.core.config.window_s), timeout=10, metadata=self._metadata
        )
        obs = observation_from_status(status, time.monotonic())
        decisions = self.core.decide(obs)
        self.metrics.observe(self.core.last)
        for decision in decisions:
            self._execute(decision, obs)
        return decisions

    def _execute(self, decision: Decision, obs: Observation) -> None:
        fields = {
            "decision": decision.kind,
            "worker_id": decision.worker_id,
            "role": decision.role,
            "reason": decision.reason,
        }
        log.info(
            "autoscaler: %s %s -> %s: %s",
            decision.kind,
            decision.worker_id or "-",
            decision.role,
            decision.reason,
            extra=fields,
        )
        started = time.monotonic()
        outcome = "done"
        try:
            if decision.kind == "switch":
                from pdserve.cluster.elastic_cli import ROLE_PB

                self._stub.SwitchRole(
                    router_pb2.SwitchRoleRequest(
                        worker_id=decision.worker_id, role=ROLE_PB[decision.role], drain_timeout_s=120.0
                    ),
                    timeout=150,
                    metadata=self._metadata,
                )
            elif self.resize is not None:
                self.resize(decision, obs)
            else:
                outcome = "unsupported"
        except grpc.RpcError as exc:
            outcome = exc.code().name
            log.warning(
                "autoscaler: %s of %s failed: %s: %s", decision.kind, decision.worker_id, outcome, exc.details()
            )
        took = time.monotonic() - started
        self.metrics.decisions.labels(decision.kind, decision.role, outcome).inc()
        self.metrics.last_decision.set_to_current_time()
        log.info(
            "autoscaler: %s %s -> %s %s in %.2f s",
            decision.kind,
            decision.worker_id or "-",
            decision.role,
            outcome,
            took,
            extra={**fields, "outcome": outcome, "took_s": round(took, 3)},
        )
        self.history.append(
            {
                "at": started,
                "took_s": time.monotonic() - started,
                "kind": decision.kind,
                "worker_id": decision.worker_id,
                "role": decision.role,
                "reason": decision.reason,
                "outcome": outcome,
            }
        )


def autoscaler_config(options: Any, can_resize: bool = False, speedup: float = 1.0) -> AutoscalerConfig:
    """AutoscalerConfig from `cluster.elastic_cli.AutoscaleOptions`. The SLOs are in profile time on a
    sim cluster run `speedup` times faster (as `pdserve bench --speedup` reports): the loop, which
    watches the wall clock, keeps them divided by `speedup`."""
    slo = options.slo
    return AutoscalerConfig(
        ttft_s=slo["ttft_ms"] / 1000 / speedup if "ttft_ms" in slo else None,
        tpot_s=slo["tpot_ms"] / 1000 / speedup if "tpot_ms" in slo else None,
        min_workers=options.min_workers,
        max_workers=options.max_workers,
        can_resize=can_resize,
    )


def start_local_autoscaler(
    router_address: str,
    options: Any,
    token: str | None = None,
    speedup: float = 1.0,
    tls_ca_file: str | None = None,
    make_planner: PlannerFactory | None = None,
) -> AutoscalerLoop:
    """Start the loop for a local deployment (role switches only), with the planner `make_planner`
    builds (the CLI passes one when a profile is known)."""
    config = autoscaler_config(options, speedup=speedup)
    planner = make_planner(config) if make_planner else None
    core = Autoscaler(config, planner)
    log.info("autoscaler: keeping %s, %s", options.slo, "planner on " + options.profile if planner else "no planner")
    return AutoscalerLoop(router_address, core, options.interval_s, token, tls_ca_file=tls_ca_file).start()
