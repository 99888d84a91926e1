"""A worker that changes role in its process: one loaded model, one KV cache, one gRPC server; the
role's engine core (a `PrefillWorker` or a `DecodeWorker` with its servicer) is swapped.

Switching (`ElasticWorker.switch`, one at a time):
1. The current core stops admitting work: its servicer refuses new calls with UNAVAILABLE (the
   router retries them elsewhere) and GetInfo reports ``healthy: false`` with
   ``unhealthy_reason: "switching to <role>"``.
2. It finishes what it holds (`_finish_or_migrate`): it waits until the core is idle. A later
   `migrate_out` hook (live KV migration) may move running sequences away first; waiting stays
   the fallback. When the work does not finish within the deadline the switch is abandoned and the
   worker serves on in its old role (`SwitchTimeout`).
3. The old core's engine loop stops; a new core for the new role is built on the same loaded model
   and the same `KVCache` tensor (every block free again: the pool is re-purposed, not reallocated).

Invariants: exactly one core serves at a time; a request is admitted only by the core of the role it
was routed for (a Prefill call to a decode-role worker, or a Generate call to a prefill-role worker,
gets UNAVAILABLE); KV pushes reach the shared KV receiver, which accepts only transfers the current
decode core expects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.servicer import DecodeServicer
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.elastic_worker.config import COLOCATED, PREFILL, ROLES
from pdserve.engine.config import EngineConfig
from pdserve.engine.fault_injection import InjectedFaults
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.metrics import WorkerMetrics
from pdserve.engine.model_loader import LoadedModel
from pdserve.kv_transfer import KvTransferServicer
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.faults import FaultInjector
from pdserve.prefill_worker.servicer import PrefillServicer
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.worker.runtime import Drain

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02


class SwitchTimeout(TimeoutError):
    """The old role's work did not finish in time; the worker kept its old role."""


class RoleDrain(Drain):
    """Draining when the process drains (SIGTERM) or while this core's role is being left."""

    def __init__(self, process: Drain) -> None:
        super().__init__()
        self._process = process
        self.leaving_for = ""  # the role being switched to, while switching

    @property
    def draining(self) -> bool:
        return self._process.draining or self._event.is_set()

    def leave(self, role: str) -> None:
        self.leaving_for = role
        self._event.set()

    def stay(self) -> None:
        self.leaving_for = ""
        self._event.clear()


@dataclass
class RoleCore:
    """What serves one role: the engine-owning worker, its servicer and its drain."""

    role: str
    worker: PrefillWorker | DecodeWorker
    servicer: PrefillServicer | DecodeServicer
    drain: RoleDrain

    def idle(self) -> bool:
        return bool(self.worker.idle())

    def stop(self) -> None:
        self.worker.stop()


@dataclass(frozen=True)
class ElasticSettings:
    """Everything both roles need besides the model: each role's config, its engine config."""

    worker_id: str
    address: str
    prefill: PrefillWorkerConfig
    decode: DecodeWorkerConfig
    prefill_config: EngineConfig
    decode_config: EngineConfig
    prefill_chunk_tokens: int | None


class ElasticWorker:
    """The current role core plus the switch between cores; thread-safe."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: KVCache,
        settings: ElasticSettings,
        role: str,
        kv_receiver: KvTransferServicer,
        metrics: WorkerMetrics,
        process_drain: Drain,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.loaded = loaded
        self.kv_cache = kv_cache
        self.settings = settings
        self.kv_receiver = kv_receiver
        self.metrics = metrics
        self.process_drain = process_drain
        self._switch_lock = threading.Lock()
        #: Moves running sequences elsewhere before the switch waits for the rest (live KV migration;
        #: None: wait until every sequence finished). Called with the core being left.
        self.migrate_out: Callable[[RoleCore], None] | None = None
        self.switches = 0
        self.core = self._build(role)

    @property
    def role(self) -> str:
        return self.core.role

    def idle(self) -> bool:
        return self.core.idle()

    def dead_reason(self) -> str:
        worker = self.core.worker
        if isinstance(worker, DecodeWorker):
            return worker.dead_reason
        return "" if worker.loop_alive() else "engine loop died"

    def switch(self, role: str, drain_timeout_s: float) -> float:
        """Change to `role` (see the module docstring); return the seconds spent finishing the old
        role's work. ValueError for an unknown role; SwitchTimeout when that work did not finish."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        with self._switch_lock:
            old = self.core
            if role == old.role:
                return 0.0
            log.info("switching from %s to %s: finishing the work held", old.role, role)
            started = time.monotonic()
            old.drain.leave(role)
            if not self._finish_or_migrate(old, started + drain_timeout_s):
                old.drain.stay()
                raise SwitchTimeout(
                    f"the {old.role} work held did not finish within {drain_timeout_s:.1f}s; still {old.role}"
                )
            drain_s = time.monotonic() - started
            old.stop()
            self.core = self._build(role)
            self.switches += 1
            log.info(
                "now %s (finished the old role's work in %.3fs, switched in %.3fs)",
                role,
                drain_s,
                time.monotonic() - started,
            )
            return drain_s

    def _finish_or_migrate(self, core: RoleCore, deadline: float) -> bool:
        """Empty `core`: migrate its sequences out when a hook is set, then wait until it is idle."""
        if self.migrate_out is not None:
            self.migrate_out(core)
        while not core.idle():
            if time.monotonic() >= deadline:
                return False
            time.sleep(IDLE_POLL_S)
        return True

    def stop(self) -> None:
        self.core.stop()

    # ----- building a core --------------------------------------------------------------------
    def _build(self, role: str) -> RoleCore:
        drain = RoleDrain(self.process_drain)
        if role == PREFILL:
            return self._build_prefill(drain)
        return self._build_decode(role, drain)

    def _build_prefill(self, drain: RoleDrain) -> RoleCore:
        s, config = self.settings, self.settings.prefill
        injected = InjectedFaults.from_env()  # tests only (engine/fault_injection.py)
        faults = FaultInjector(injected.kv_fault, injected.kv_fault_count)
        worker = PrefillWorker(
            self.loaded,
            s.prefill_config,
            transfer_timeout_s=config.pool.kv_timeout_s,
            metrics=self.metrics,
            faults=faults,
            prefill_chunk_tokens=s.prefill_chunk_tokens,
            prefix_caching=config.pool.prefix_caching,
            kv_streaming=config.kv.streaming,
            kv_cache=self.kv_cache,
        )
        servicer = PrefillServicer(worker, s.worker_id, s.address, config.pool.request_timeout_s, drain)
        return RoleCore(PREFILL, worker, servicer, drain)

    def _build_decode(self, role: str, drain: RoleDrain) -> RoleCore:
        s, config = self.settings, self.settings.decode
        pool = config.pool
        worker = DecodeWorker(
            self.loaded,
            s.decode_config,
            admission_timeout_s=pool.admission_timeout_s,
            metrics=self.metrics,
            kv_cache=self.kv_cache,
        )
        servicer = DecodeServicer(
            worker,
            self.kv_receiver,
            s.worker_id,
            s.address,
            role == COLOCATED,
            pool.local_prefill_threshold,
            pool.request_timeout_s,
            pool.kv_timeout_s,
            drain,
            kv_backend=config.kv.backend,
            kv_target=config.kv_target or s.address,
            kv_checksum=config.kv.checksum,
        )
        return RoleCore(role, worker, servicer, drain)


def prefill_config_of(decode_config: EngineConfig, max_batched_tokens: int, sim: bool) -> EngineConfig:
    """The prefill role's engine config: the decode role's (same model, KV geometry and memory), with
    the prefill flags' token budget (the sim profile's own limits under `--engine sim`)."""
    if sim:
        return replace(decode_config, prefix_caching=False)
    return replace(decode_config, max_num_batched_tokens=max_batched_tokens, prefix_caching=False)
