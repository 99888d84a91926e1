"""Worker selection policies: which prefill worker and which decode worker serve a request.

Contract: ``Policy.pick(candidates)`` gets a snapshot of every worker of one stage (healthy or not) and
returns one healthy candidate, or None when none is healthy. Policies never block and never do I/O;
the worker pool calls them under its lock, so a pick and the in-flight increment that follows it are
atomic (a burst of requests does not all land on the same "least loaded" worker).

Load definitions (lower is better):
- prefill: queued prompt tokens reported by the worker's last GetInfo + estimated prompt tokens the
  router has sent to it that have not produced a first token yet; ties go to fewer in-flight requests.
- decode: kv_blocks_used / kv_blocks_total + max(running_requests, router in-flight requests). The max
  (not the sum) avoids counting the same request twice: the router's count is the fresher of the two.

`kv_aware` (KV-aware routing) adds what each worker already holds of the prompt, from the router's
KV index (router/kv_index.py), in tokens of work ("uncached" = prompt tokens not in that worker's
prefix cache):
- prefill: cost = pending prompt tokens (as above) + uncached tokens there;
- decode: cost = request_tokens x max(running, in flight) + kv_tokens x KV fraction + uncached tokens
  there (what a prefill worker must compute and ship to it, or it must compute itself).
The lowest cost wins; ties rotate. With no hint (no tokenizer, or a prompt the router could not
tokenize) every worker's uncached count is the whole prompt, so the cost is the load alone.
`kv_oracle` is the same cost with the overlap asked from every worker at routing time instead of
read from the index: the exact baseline that benchmarks compare the index against.
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.constants import KV_POLICIES, POLICY_NAMES
from pdserve.settings import RouterSection
from pdserve.v1 import router_pb2

PREFILL = "prefill"
DECODE = "decode"
COLOCATED = "colocated"
ROLES = (PREFILL, DECODE, COLOCATED)
#: kv_aware's decode weights (tokens of prompt work one running request / a full KV pool is worth):
#: the router section's defaults, chosen on the multi-turn sim benchmark (docs/performance.md).
DEFAULT_REQUEST_TOKENS = RouterSection.kv_aware_request_tokens
DEFAULT_KV_TOKENS = RouterSection.kv_aware_kv_tokens
PREFIX_KEY_CHARS = 256  # how much of a prompt decides its prefill worker under prefix_affinity
CHARS_PER_TOKEN_ESTIMATE = 4
MESSAGE_OVERHEAD_TOKENS = 8


@dataclass(frozen=True)
class Candidate:
    """Snapshot of one worker as the policies see it (values from the last poll + router counters)."""

    address: str
    role: str
    healthy: bool
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
    queued_prompt_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    running_requests: int = 0

    @property
    def kv_fraction(self) -> float:
        """Fraction of the KV pool in use; 0 when the worker reported no pool."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total > 0 else 0.0


@dataclass(frozen=True)
class RouteHint:
    """What the router knows of one request's prompt for KV-aware routing: its length in tokens and,
    per worker address, how many of its tokens that worker's prefix cache holds."""

    prompt_tokens: int
    cached_tokens: Mapping[str, int] = field(default_factory=dict)

    def uncached(self, address: str) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens.get(address, 0))


def prefill_load(candidate: Candidate) -> tuple[float, int]:
    """Load of a prefill worker: (pending prompt tokens, in-flight requests as tie-breaker)."""
    return (float(candidate.queued_prompt_tokens + candidate.in_flight_prompt_tokens), candidate.in_flight)


def decode_load(candidate: Candidate) -> tuple[float, int]:
    """Load of a decode (or colocated) worker: (kv fraction + requests, in-flight as tie-breaker)."""
    requests = max(candidate.running_requests, candidate.in_flight)
    return (candidate.kv_fraction + requests, candidate.in_flight)


class Policy(ABC):
    """Chooses one healthy worker among candidates; unhealthy candidates are never chosen."""

    def pick(self, candidates: Sequence[Candidate], key: str = "", hint: RouteHint | None = None) -> Candidate | None:
        """Return a healthy candidate, or None when no candidate is healthy. `key` identifies the
        request's prompt prefix; only prefix-aware policies use it. `hint`: what each worker caches
        of the prompt; only KV-aware policies use it."""
        healthy = [c for c in candidates if c.healthy]
        if not healthy:
            return None
        if hint is not None and isinstance(self, KvAware):
            return self._choose_hinted(healthy, hint)
        return self._choose_for(healthy, key) if key else self._choose(healthy)

    def _choose_for(self, healthy: Sequence[Candidate], key: str) -> Candidate:
        return self._choose(healthy)

    @abstractmethod
    def _choose(self, healthy: Sequence[Candidate]) -> Candidate:
        """Choose among a non-empty list of healthy candidates."""


class RoundRobin(Policy):
    """Cycles through the healthy candidates in order (thread-safe)."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def _choose(self, healthy: Sequence[Candidate]) -> Candidate:
        with self._lock:
            index = self._next % len(healthy)
            self._next += 1
        return healthy[index]


class LeastLoaded(Policy):
    """Picks the candidate with the smallest load; equal loads rotate so that ties spread."""

    def __init__(self, load: Callable[[Candidate], tuple[float, int]]) -> None:
        self._load = load
        self._tie_breaker = RoundRobin()

    def _choose(self, healthy: Sequence[Candidate]) -> Candidate:
        best = min(self._load(c) for c in healthy)
        tied = [c for c in healthy if self._load(c) == best]
        return self._tie_breaker._choose(tied)


class PrefixAffinity(LeastLoaded):
    """Requests whose prompts start alike go to the same worker (rendezvous hashing of the prefix
    key), so its prefix cache serves them: a prefill worker's computed prefix, or a decode worker's
    received prefix blocks, which then are not shipped again. A worker whose load exceeds the least
    loaded one's by more than `max_imbalance` is passed over (bounded load). No key: least loaded.

    Loads: prefill workers in pending prompt tokens (default bound 4096), decode workers in running
    requests plus KV fraction (default bound 8)."""

    def __init__(
        self, load: Callable[[Candidate], tuple[float, int]] = prefill_load, max_imbalance: float = 4096
    ) -> None:
        super().__init__(load)
        self._max_imbalance = max_imbalance

    def _choose_for(self, healthy: Sequence[Candidate], key: str) -> Candidate:
        ranked = sorted(
            healthy, key=lambda c: hashlib.blake2b(f"{key}|{c.address}".encode(), digest_size=8).digest(), reverse=True
        )
        lightest = min(self._load(c)[0] for c in healthy)
        for candidate in ranked:
            if self._load(candidate)[0] - lightest <= self._max_imbalance:
                return candidate
        return self._choose(healthy)


class KvAware(Policy):
    """The lowest cost of load plus uncached prompt tokens (the module doc has the cost function)."""

    def __init__(
        self, stage: str, request_tokens: float = DEFAULT_REQUEST_TOKENS, kv_tokens: float = DEFAULT_KV_TOKENS
    ) -> None:
        self.stage = stage
        self.request_tokens = request_tokens
        self.kv_tokens = kv_tokens
        self._tie_breaker = RoundRobin()

    def load(self, candidate: Candidate) -> float:
        """The cost of a candidate before the prompt's uncached tokens (in tokens of work)."""
        if self.stage == PREFILL:
            return float(candidate.queued_prompt_tokens + candidate.in_flight_prompt_tokens)
        requests = max(candidate.running_requests, candidate.in_flight)
        return self.request_tokens * requests + self.kv_tokens * candidate.kv_fraction

    def cost(self, candidate: Candidate, hint: RouteHint) -> float:
        return self.load(candidate) + hint.uncached(candidate.address)

    def _choose_hinted(self, healthy: Sequence[Candidate], hint: RouteHint) -> Candidate:
        costs = [self.cost(c, hint) for c in healthy]
        best = min(costs)
        return self._tie_breaker._choose([c for c, cost in zip(healthy, costs, strict=True) if cost == best])

    def _choose(self, healthy: Sequence[Candidate]) -> Candidate:
        return self._choose_hinted(healthy, RouteHint(0))


def prefix_key(request: router_pb2.GenerateRequest) -> str:
    """What decides prefix affinity: the start of the prompt (text, first chat turns, or token ids)."""
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        return ",".join(map(str, request.token_ids.ids[: PREFIX_KEY_CHARS // 4]))
    if kind == "messages":
        turns = "".join(f"<{m.role}>{m.content}" for m in request.messages.messages)
        return turns[:PREFIX_KEY_CHARS]
    return request.prompt[:PREFIX_KEY_CHARS]


def make_policy(
    name: str, stage: str, request_tokens: float = DEFAULT_REQUEST_TOKENS, kv_tokens: float = DEFAULT_KV_TOKENS
) -> Policy:
    """Build the policy called ``name`` for ``stage`` (PREFILL or DECODE); ValueError if unknown.
    `request_tokens`, `kv_tokens`: kv_aware's decode weights."""
    if stage not in (PREFILL, DECODE):
        raise ValueError(f"stage must be {PREFILL!r} or {DECODE!r}, got {stage!r}")
    if name in KV_POLICIES:
        return KvAware(stage, request_tokens, kv_tokens)
    if name == "round_robin":
        return RoundRobin()
    if name == "prefix_affinity":
        return PrefixAffinity() if stage == PREFILL else PrefixAffinity(decode_load, max_imbalance=8)
    if name == "least_loaded":
        return LeastLoaded(prefill_load if stage == PREFILL else decode_load)
    raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, got {name!r}")


def estimate_prompt_tokens(request: router_pb2.GenerateRequest) -> int:
    """Rough prompt length in tokens (without a KV-aware policy the router does not tokenize): ids
    exactly, text as chars / 4."""
    kind = request.WhichOneof("input")
    if kind == "token_ids":
        return len(request.token_ids.ids)
    if kind == "messages":
        chars = sum(len(m.content) for m in request.messages.messages)
        overhead = MESSAGE_OVERHEAD_TOKENS * len(request.messages.messages)
        return chars // CHARS_PER_TOKEN_ESTIMATE + overhead
    return max(1, len(request.prompt) // CHARS_PER_TOKEN_ESTIMATE)
