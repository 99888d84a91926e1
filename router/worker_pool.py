"""The router's view of its workers: one channel and stub per worker, health from GetInfo polls,
router-side in-flight counters, and atomic assignment of (decode, prefill) pairs.

Invariants:
- A worker is healthy iff its last GetInfo poll succeeded within the deadline and reported healthy.
  Until the first poll finishes a worker is unhealthy; ``start()`` runs one poll before returning.
- Picking workers and incrementing their in-flight counters happen under one lock (``assign``).
- Every Lease is released exactly once (``Lease.release`` is idempotent); in-flight counters never go
  negative and are back to 0 when no request is in flight.
- With ``require_room``, a decode worker is picked only while its router-side in-flight count is below
  its slots (`slots_of`: the sequences it decodes at once, as it reports them, plus room for those
  still prefilling); when every healthy one is full, ``assign`` raises `Busy` and the router queues.
- ``on_change`` (if set) is called after every poll and every release: capacity may have changed.
- KV targets: every poll also registers the kv_address of each decode worker with every prefill
  worker (`PrefillWorker.SetKvTargets`); a prefill worker pushes KV only to registered targets, and
  the pool pairs a decode worker only with prefill workers that acknowledged its kv_address.
- Nothing from before a role switch lands after it: a poll answer is recorded only on the worker
  state it was sent for (a switch replaces the state and polls it itself), and registrations run one
  at a time, so the last one sent is computed from the roles as they are after the switch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.router.admission import Busy
from pdserve.router.kv_index import KvEventFeed
from pdserve.router.policies import COLOCATED, DECODE, PREFILL, ROLES, Candidate, Policy, RouteHint
from pdserve.transport import open_channel, router_metadata
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

ROLE_PB = {
    PREFILL: common_pb2.WORKER_ROLE_PREFILL,
    DECODE: common_pb2.WORKER_ROLE_DECODE,
    COLOCATED: common_pb2.WORKER_ROLE_COLOCATED,
}


class NoHealthyWorker(RuntimeError):
    """No healthy worker of a needed stage; the message says which. `stage` is "decode" or "prefill";
    `waiting` counts the stage's workers still in the pool that may come back (registered, not
    draining: one whose process died stays registered while its launcher restarts it)."""

    def __init__(self, message: str, stage: str = "", waiting: int = 0) -> None:
        super().__init__(message)
        self.stage = stage
        self.waiting = waiting


class SwitchRefused(RuntimeError):
    """A role switch that is not possible now (another switch of that worker runs, or it would leave a
    stage without workers); the message says why."""


@dataclass(frozen=True)
class WorkerEndpoint:
    """A configured worker: its gRPC address and role (PREFILL, DECODE or COLOCATED)."""

    address: str
    role: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.address or ":" not in self.address:
            raise ValueError(f"address must be host:port, got {self.address!r}")


@dataclass
class _WorkerState:
    """Mutable state of one worker, guarded by the pool lock (except the channel/stubs, set once)."""

    endpoint: WorkerEndpoint
    channel: grpc.Channel
    info_call: grpc.UnaryUnaryMultiCallable
    # prefill workers: where they push prompts' K/V; decode and colocated workers: where they may push
    # a migrated request's K/V (Router.Migrate)
    set_kv_targets: grpc.UnaryUnaryMultiCallable | None = None
    # the kv_addresses it acknowledged (prefill: of decode workers; decode: of decode and colocated
    # workers); None when it does not restrict its targets (a worker without SetKvTargets, such as a
    # test double)
    kv_targets: frozenset[str] | None = frozenset()
    info: common_pb2.WorkerInfo | None = None
    healthy: bool = False
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
    held: bool = False  # a role switch is under way: no new request is assigned to it

    def candidate(self) -> Candidate:
        info = self.info or common_pb2.WorkerInfo()
        return Candidate(
            address=self.endpoint.address,
            role=self.endpoint.role,
            healthy=self.healthy,
            in_flight=self.in_flight,
            in_flight_prompt_tokens=self.in_flight_prompt_tokens,
            queued_prompt_tokens=info.queued_prompt_tokens,
            kv_blocks_used=info.kv_blocks_used,
            kv_blocks_total=info.kv_blocks_total,
            running_requests=info.running_requests,
        )


@dataclass
class Lease:
    """The workers assigned to one request; counts as in flight on both until released."""

    decode_address: str
    prefill_address: str  # empty when the decode worker is colocated
    prompt_tokens: int
    _pool: WorkerPool
    #: why it has (or has not) a prefill worker: "colocated", "disaggregated", "pinned", "migration",
    #: or, with conditional disaggregation, "local_cached" / "local_prefill_busy"
    route: str = ""
    _prefill_pending: bool = True
    _released: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def released(self) -> bool:
        return self._released

    def prefill_done(self) -> None:
        """The first token arrived: the prompt no longer loads the prefill worker (idempotent)."""
        if not self._prefill_pending:  # every later token: it only ever goes from True to False
            return
        with self._lock:
            pending, self._prefill_pending = self._prefill_pending, False
        if pending:
            self._pool._end_prefill(self)

    def release(self) -> None:
        """The request ended (any way): drop it from every counter (idempotent)."""
        self.prefill_done()
        with self._lock:
            released, self._released = self._released, True
        if not released:
            self._pool._end_decode(self)


class WorkerPool:
    """Channels, stubs, health and load of the configured workers; polls GetInfo in a daemon thread."""

    def __init__(
        self, endpoints: Sequence[WorkerEndpoint], poll_interval_s: float = 0.5, info_timeout_s: float = 2.0
    ) -> None:
        addresses = [e.address for e in endpoints]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"worker addresses must be unique, got {addresses}")
        self._poll_interval_s = poll_interval_s
        self._info_timeout_s = info_timeout_s
        self._lock = threading.Lock()
        # register_kv_targets one at a time: a registration computed before a role switch must not
        # reach the workers (or be recorded) after the one the switch sends
        self._register_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers = {e.address: _open(e) for e in endpoints}
        self.on_change: Callable[[], None] | None = None
        self._kv_feed: KvEventFeed | None = None

    def attach_kv_feed(self, feed: KvEventFeed) -> None:
        """Follow every worker's KV events (now and as workers are added) into `feed`'s index; a
        removed worker leaves the index (KV-aware routing)."""
        with self._lock:
            self._kv_feed = feed
            states = list(self._workers.items())
        for address, state in states:
            feed.watch(address, state.channel)

    def kv_block_size(self) -> int:
        """The KV block size the workers report (the first that reports one; 0 before any does)."""
        with self._lock:
            for state in self._workers.values():
                if state.info is not None and state.info.kv_block_size > 0:
                    return state.info.kv_block_size
        return 0

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def start(self) -> None:
        """Poll every worker once (waits at most info_timeout_s), then keep polling in the background."""
        self.poll_once()
        self._thread = threading.Thread(target=self._poll_loop, name="router-worker-poll", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop polling and close every channel (in-flight calls on them fail with CANCELLED)."""
        self._stop.set()
        if self._kv_feed is not None:
            self._kv_feed.close()
        if self._thread is not None:
            self._thread.join(timeout=self._info_timeout_s + 1.0)
        for state in self._workers.values():
            state.channel.close()

    def add(self, endpoint: WorkerEndpoint) -> None:
        """Start routing to a new worker (after its first successful poll). ValueError if the address
        is already in the pool."""
        state = _open(endpoint)
        with self._lock:
            if endpoint.address in self._workers:
                state.channel.close()
                raise ValueError(f"worker {endpoint.address} is already in the pool")
            self._workers[endpoint.address] = state
        log.info("worker %s (%s) added", endpoint.address, endpoint.role)
        if self._kv_feed is not None:
            self._kv_feed.watch(endpoint.address, state.channel)
        self._record_poll(
            endpoint.address, state, state.info_call.future(worker_pb2.InfoRequest(), timeout=self._info_timeout_s)
        )
        self.register_kv_targets()  # a new decode worker is paired only once prefill workers know it

    def remove(self, address: str) -> bool:
        """Stop routing to `address` and close its channel (calls still on it fail); False if unknown."""
        with self._lock:
            state = self._workers.pop(address, None)
        if state is None:
            return False
        log.info("worker %s (%s) removed", address, state.endpoint.role)
        if self._kv_feed is not None:
            self._kv_feed.unwatch(address)
        state.channel.close()
        return True

    def addresses(self) -> dict[str, str]:
        """Address -> role of every worker in the pool."""
        with self._lock:
            return {a: s.endpoint.role for a, s in self._workers.items()}

    def poll_once(self) -> None:
        """Send GetInfo to all workers concurrently and record the answers (or failures)."""
        with self._lock:
            states = list(self._workers.items())  # the set may change at runtime (add/remove)
        futures = {
            address: (state, state.info_call.future(worker_pb2.InfoRequest(), timeout=self._info_timeout_s))
            for address, state in states
        }
        for address, (state, future) in futures.items():
            self._record_poll(address, state, future)
        self.register_kv_targets()
        self._changed()

    def register_kv_targets(self) -> None:
        """Tell every prefill worker the kv_address of every decode worker (concurrently); remember
        what each acknowledged. A failed call keeps the last acknowledged set. One registration at a
        time (a poll's and a role switch's do not interleave)."""
        with self._register_lock:
            self._register_kv_targets_serialized()

    def _register_kv_targets_serialized(self) -> None:
        with self._lock:
            targets = sorted(
                {
                    s.info.kv_address
                    for s in self._workers.values()
                    if s.endpoint.role == DECODE and s.info is not None and s.info.kv_address
                }
            )
            migration = sorted(
                {
                    s.info.kv_address
                    for s in self._workers.values()
                    if s.endpoint.role in (DECODE, COLOCATED) and s.info is not None and s.info.kv_address
                }
            )
            calls = [
                (a, s.set_kv_targets, targets if s.endpoint.role == PREFILL else migration)
                for a, s in self._workers.items()
                if s.set_kv_targets is not None and (s.endpoint.role == PREFILL or s.healthy or _draining(s))
            ]
        metadata = router_metadata()  # only the router's credential may set them (workers check its digest)
        futures = {
            a: (
                call.future(worker_pb2.KvTargets(targets=t), timeout=self._info_timeout_s, metadata=metadata or None),
                t,
            )
            for a, call, t in calls
        }
        for address, (future, sent) in futures.items():
            acknowledged: frozenset[str] | None = frozenset(sent)
            try:
                future.result()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    log.warning(
                        "registering KV targets with %s failed: %s: %s", address, exc.code().name, exc.details()
                    )
                    continue
                acknowledged = None
            with self._lock:
                state = self._workers.get(address)
                if state is not None:
                    state.kv_targets = acknowledged

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._poll_interval_s):
            try:
                self.poll_once()
            except Exception:  # a bug here must not kill health tracking silently
                log.exception("worker poll failed")

    def _record_poll(self, address: str, polled: _WorkerState, future: grpc.Future) -> None:
        """Record the GetInfo answer (or failure) `future` of the worker state `polled`."""
        try:
            info, error = future.result(), None
        except grpc.RpcError as exc:
            info, error = None, f"{exc.code().name}: {exc.details()}"
        with self._lock:
            state = self._workers.get(address)
            if state is not polled:  # removed meanwhile, or a role switch replaced it (and polled it itself):
                return  # an answer from before the switch ("switching to ...", unhealthy) is stale
            was_healthy = state.healthy
            state.healthy = info is not None and info.healthy
            state.info = info if info is not None else state.info
        if was_healthy != state.healthy:
            reason = error or ("reported healthy" if state.healthy else "reported unhealthy")
            log.log(
                logging.INFO if state.healthy else logging.WARNING,  # coming up is no news to warn of
                "worker %s (%s) is now %s: %s",
                address,
                state.endpoint.role,
                "healthy" if state.healthy else "unhealthy",
                reason,
            )

    def candidates(self, roles: Sequence[str]) -> list[Candidate]:
        """Snapshots of every worker whose role is in ``roles``, in configuration order."""
        with self._lock:
            return [s.candidate() for s in self._workers.values() if s.endpoint.role in roles]

    def assign(
        self,
        decode_policy: Policy,
        prefill_policy: Policy,
        prompt_tokens: int,
        avoid: frozenset[str] = frozenset(),
        prefix_key: str = "",
        require_room: bool = False,
        hint: RouteHint | None = None,
        local_below: int = 0,
    ) -> Lease:
        """Pick a decode (or colocated) worker and, unless colocated, a prefill worker; count them in
        flight. Workers in `avoid` (they just failed this request) are picked only when no other
        healthy one is left. Raises NoHealthyWorker when a needed stage has no healthy worker, and
        (with `require_room`) Busy when every healthy decode worker is full.

        Conditional disaggregation (`hint` and `local_below` > 0): the decode worker is picked first;
        it prefills the request itself (no prefill worker) when fewer than `local_below` of the
        prompt's tokens are uncached there ("local_cached"), or when the best prefill worker's
        pending work plus the prompt exceeds twice the decode worker's own (local prefill stalls
        its decoding, hence the factor; "local_prefill_busy")."""
        with self._lock:
            candidates = self._candidates_locked((DECODE, COLOCATED), avoid)
            # a decode worker that no prefill worker has acknowledged yet (it just turned healthy, and
            # the registration is in flight) takes no request while a paired one can
            prefills = self._candidates_locked((PREFILL,), avoid)
            candidates = [
                c for c in candidates if c.role != DECODE or self._registered_with_locked(c.address, prefills)
            ] or candidates
            if require_room:
                roomy = [c for c in candidates if self._has_room_locked(c.address)]
                if not roomy and any(c.healthy for c in candidates):
                    raise Busy("every healthy decode worker is at capacity")
                candidates = roomy or candidates
            decode = decode_policy.pick(candidates, prefix_key, hint)
            if decode is None:
                raise self._missing_locked((DECODE, COLOCATED), "decode")
            if decode.role != DECODE:
                return self._lease_locked(decode.address, "", prompt_tokens, "colocated")
            if hint is not None and local_below > 0 and hint.uncached(decode.address) < local_below:
                return self._lease_locked(decode.address, "", prompt_tokens, "local_cached")
            paired = self._registered_with_locked(decode.address, prefills)
            prefill = prefill_policy.pick(paired, prefix_key, hint)
            if prefill is None:
                if not prefills or paired:
                    raise self._missing_locked((PREFILL,), "prefill")
                raise NoHealthyWorker(
                    f"no prefill worker has registered decode worker {decode.address} as a KV target yet",
                    "prefill",
                    len(prefills),
                )
            if hint is not None and local_below > 0:
                remote = prefill.queued_prompt_tokens + prefill.in_flight_prompt_tokens + hint.uncached(prefill.address)
                local = decode.in_flight_prompt_tokens + hint.uncached(decode.address)
                if remote > 2 * local:
                    return self._lease_locked(decode.address, "", prompt_tokens, "local_prefill_busy")
            return self._lease_locked(decode.address, prefill.address, prompt_tokens, "disaggregated")

    def _registered_with_locked(self, decode_address: str, candidates: list[Candidate]) -> list[Candidate]:
        """The prefill candidates that acknowledged this decode worker's kv_address as a KV target."""
        info = self._workers[decode_address].info
        target = info.kv_address if info is not None else ""
        if not target:
            return candidates
        return [c for c in candidates if _accepts(self._workers[c.address].kv_targets, target)]

    def _has_room_locked(self, address: str) -> bool:
        state = self._workers[address]
        slots = slots_of(state.info)
        return slots == 0 or state.in_flight < slots

    def total_slots(self) -> int:
        """Requests the healthy decode and colocated workers take at once (0: unknown / no limit)."""
        with self._lock:
            return sum(slots_of(s.info) for s in self._workers.values() if s.endpoint.role != PREFILL and s.healthy)

    def _candidates_locked(self, roles: Sequence[str], avoid: frozenset[str] = frozenset()) -> list[Candidate]:
        states = [s for s in self._workers.values() if s.endpoint.role in roles and not s.held]
        preferred = [s for s in states if s.endpoint.address not in avoid and s.healthy]
        return [s.candidate() for s in (preferred or states)]

    def migration_target(self, source: str, to_worker: str, policy: Policy) -> str:
        """The decode (or colocated) worker a request on `source` may move to: `to_worker` (a worker id
        or address) or, when empty, the policy's pick among the others. It must be healthy, report a
        kv_address, and be registered as a KV target with `source`. ValueError says why none is."""
        with self._lock:
            if source not in self._workers:
                raise ValueError(f"decode worker {source} is no longer in the pool")
            accepted = self._workers[source].kv_targets
            states = [s for a, s in self._workers.items() if s.endpoint.role in (DECODE, COLOCATED) and a != source]
            if to_worker:
                states = [s for s in states if to_worker in (s.endpoint.address, s.info.worker_id if s.info else "")]
                if not states:
                    raise ValueError(f"no decode worker {to_worker!r} other than the request's own ({source})")
            eligible = [
                s
                for s in states
                if s.healthy and s.info is not None and s.info.kv_address and _accepts(accepted, s.info.kv_address)
            ]
            if not eligible:
                raise ValueError(
                    f"no healthy decode worker registered as a KV target of {source}"
                    + (f" matches {to_worker!r}" if to_worker else "")
                )
            picked = policy.pick([s.candidate() for s in eligible], "")
            if picked is None:
                raise ValueError("the decode policy picked no migration target")
            return picked.address

    def lease_decode(self, address: str) -> Lease:
        """Count one more request in flight on decode worker `address` (a migration target: no prefill)."""
        with self._lock:
            if address not in self._workers:
                raise ValueError(f"decode worker {address} is no longer in the pool")
            return self._lease_locked(address, "", 0, "migration")

    def lease_pinned(self, address: str, prompt_tokens: int) -> Lease | None:
        """A lease on decode (or colocated) worker `address` with no prefill worker (it prefills the
        request itself, from the blocks it caches), or None when that worker is not healthy, is held
        for a role switch, or is full. The choices after the first of an n > 1 request."""
        with self._lock:
            state = self._workers.get(address)
            if (
                state is None
                or state.endpoint.role == PREFILL
                or not state.healthy
                or state.held
                or not self._has_room_locked(address)
            ):
                return None
            return self._lease_locked(address, "", prompt_tokens, "pinned")

    def draining(self) -> frozenset[str]:
        """Decode and colocated workers whose last poll said they are draining."""
        with self._lock:
            return frozenset(a for a, s in self._workers.items() if s.endpoint.role != PREFILL and _draining(s))

    def suspect(self, address: str) -> None:
        """A call to `address` just failed: take it out of rotation until its next successful poll."""
        with self._lock:
            state = self._workers.get(address)
            if state is not None:
                state.healthy = False

    def _missing_locked(self, roles: Sequence[str], stage: str) -> NoHealthyWorker:
        configured = [a for a, s in self._workers.items() if s.endpoint.role in roles]
        if not configured:
            return NoHealthyWorker(f"no {stage} worker configured", stage)
        waiting = sum(not s.held and not _draining(s) for s in self._workers.values() if s.endpoint.role in roles)
        return NoHealthyWorker(f"no healthy {stage} worker (configured: {', '.join(configured)})", stage, waiting)

    def _lease_locked(self, decode_address: str, prefill_address: str, prompt_tokens: int, route: str = "") -> Lease:
        decode = self._workers[decode_address]
        decode.in_flight += 1
        target = self._workers[prefill_address] if prefill_address else decode
        if prefill_address:
            target.in_flight += 1
        target.in_flight_prompt_tokens += prompt_tokens
        return Lease(decode_address, prefill_address, prompt_tokens, self, route=route)

    def _end_prefill(self, lease: Lease) -> None:
        with self._lock:
            target = self._workers.get(lease.prefill_address or lease.decode_address)
            if target is None:  # removed while the request ran
                return
            target.in_flight_prompt_tokens -= lease.prompt_tokens
            if lease.prefill_address:
                target.in_flight -= 1

    def _end_decode(self, lease: Lease) -> None:
        with self._lock:
            if lease.decode_address in self._workers:  # else removed while the request ran
                self._workers[lease.decode_address].in_flight -= 1
        self._changed()

    # ----- role switches (Router.SwitchRole) -------------------------------------------------------
    def hold_for_switch(self, worker: str, role: str) -> tuple[str, str]:
        """Stop assigning new requests to `worker` (its worker_id or address) before it switches to
        `role`; return (address, current role). KeyError for an unknown worker; SwitchRefused when it
        is already switching or the switch would leave decode workers without a prefill worker, or
        no worker to decode. A switch to the role it has holds nothing."""
        with self._lock:
            address = self._address_of_locked(worker)
            state = self._workers[address]
            if state.held:
                raise SwitchRefused(f"worker {address} is already switching roles")
            if state.endpoint.role == role:
                return address, role
            roles = [s.endpoint.role for a, s in self._workers.items() if a != address] + [role]
            if DECODE in roles and PREFILL not in roles:
                raise SwitchRefused(
                    f"switching {address} to {role} would leave the decode workers without a prefill worker"
                )
            if DECODE not in roles and COLOCATED not in roles:
                raise SwitchRefused(f"switching {address} to {role} would leave no worker that decodes")
            state.held = True
            return address, state.endpoint.role

    def _address_of_locked(self, worker: str) -> str:
        if worker in self._workers:
            return worker
        for address, state in self._workers.items():
            if state.info is not None and state.info.worker_id == worker:
                return address
        raise KeyError(f"no worker {worker!r} (neither a worker_id nor an address the router knows)")

    def release_hold(self, address: str) -> None:
        """A switch was abandoned: assign requests to the worker again, in its old role."""
        with self._lock:
            state = self._workers.get(address)
            if state is not None:
                state.held = False

    def prefill_backlogs(self) -> dict[str, int]:
        """Each healthy worker that may prefill a request (every healthy worker: a decode worker
        prefills what it is sent without a prefill worker) -> its `pending_prompt_tokens`."""
        with self._lock:
            return {
                address: (s.info.queued_prompt_tokens if s.info is not None else 0) + s.in_flight_prompt_tokens
                for address, s in self._workers.items()
                if s.healthy
            }

    def pending_prompt_tokens(self, address: str) -> int:
        """Prompt tokens waiting for a first token at `address`: its last reported queue plus what the
        router sent it since (0 for an unknown address)."""
        with self._lock:
            state = self._workers.get(address)
            if state is None:
                return 0
            queued = state.info.queued_prompt_tokens if state.info is not None else 0
            return queued + state.in_flight_prompt_tokens

    def in_flight_of(self, address: str) -> int:
        """Requests the router has at `address` (0 for an unknown address)."""
        with self._lock:
            state = self._workers.get(address)
            return state.in_flight if state is not None else 0

    def info_of(self, address: str) -> common_pb2.WorkerInfo:
        with self._lock:
            return _status_info(self._workers[address])

    def set_role(self, address: str, role: str) -> common_pb2.WorkerInfo:
        """The worker at `address` switched to `role`: poll it with the stubs of that role, register the
        KV targets again (a new decode worker becomes a target of every prefill worker, a former one
        stops being one; a new prefill worker learns them), then assign requests to it again.
        Blocking (gRPC calls); returns its info."""
        with self._lock:
            old = self._workers[address]
            state = _open(WorkerEndpoint(address, role), old.channel)
            state.held = True  # not yet: until its targets are registered
            self._workers[address] = state
        self._record_poll(
            address, state, state.info_call.future(worker_pb2.InfoRequest(), timeout=self._info_timeout_s)
        )
        self.register_kv_targets()
        with self._lock:
            state.held = False
            info = _status_info(state)
        self._changed()
        return info

    def snapshot(self) -> list[common_pb2.WorkerInfo]:
        """Latest WorkerInfo of every worker, with address, role and healthy as the router sees them."""
        with self._lock:
            return [_status_info(s) for s in self._workers.values()]

    def in_flight_total(self) -> int:
        """Router-side in-flight requests summed over decode and colocated workers."""
        with self._lock:
            return sum(s.in_flight for s in self._workers.values() if s.endpoint.role != PREFILL)


def _draining(state: _WorkerState) -> bool:
    return state.info is not None and state.info.unhealthy_reason == "draining"


def _accepts(kv_targets: frozenset[str] | None, target: str) -> bool:
    return kv_targets is None or target in kv_targets


def slots_of(info: common_pb2.WorkerInfo | None) -> int:
    """Requests a decode worker is given at once: the sequences it decodes together plus a quarter
    more (at least 2) that are still being prefilled; 0 when it does not say (no limit)."""
    running = info.max_running_requests if info is not None else 0
    return running + max(2, running // 4) if running > 0 else 0


def _open(endpoint: WorkerEndpoint, channel: grpc.Channel | None = None) -> _WorkerState:
    channel = channel or open_channel(endpoint.address)
    if endpoint.role == PREFILL:
        prefill = worker_pb2_grpc.PrefillWorkerStub(channel)
        return _WorkerState(endpoint, channel, prefill.GetInfo, prefill.SetKvTargets)
    decode = worker_pb2_grpc.DecodeWorkerStub(channel)
    return _WorkerState(endpoint, channel, decode.GetInfo, decode.SetKvTargets)


def _status_info(state: _WorkerState) -> common_pb2.WorkerInfo:
    info = common_pb2.WorkerInfo()
    if state.info is not None:
        info.CopyFrom(state.info)
    info.address = state.endpoint.address
    info.role = ROLE_PB[state.endpoint.role]
    info.healthy = state.healthy
    return info
