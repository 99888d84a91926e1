"""The latency profile of one device + model pair (JSON, format ``pdserve-profile`` version 1).

A profile says how long a forward pass, a decode step and a KV hand-off take on some hardware,
and what the engine there can hold. The simulated engine (`engine.sim_runner`) waits these times
instead of running a model; the planner (`capacity.simulator`) replays them in a discrete-event
model. Both read the same object, so what the planner predicts and what a sim cluster measures
differ only by what the serving stack adds (see `overhead`).

Document (every time in seconds, every size in bytes or tokens)::

    {
      "format": "pdserve-profile", "version": 1,
      "name": "...", "description": "...", "source": "where the numbers come from (cite it)",
      "model": {"name": "...", "kv_bytes_per_token": 131072, "max_model_len": 8192},
      "device": {...free-form description...},
      "contention_workers": 1,            # how many workers shared the machine while measuring
      "prefill": {"coef": [a, b, c]},     # pass: a + b*new_tokens + c*sum_i new_i*(cached_i + new_i)
      "decode": {"coef": [a, b, c]},      # step: a + b*batch + c*total_context_tokens
      "transfer": {"shm": {"latency_s": x, "bytes_per_s": y}, "grpc": {...}, "ray": {...}},
      "engine": {"block_size": 16, "kv_capacity_tokens": N, "max_num_seqs": 64,
                 "max_batched_tokens": 4096, "prefill_chunk_tokens": 512},
      "overhead": {"per_pass_s": 0.0, "per_seq_s": 0.0, "per_request_s": 0.0, "jitter_sigma": 0.0,
                   "wake_s": 0.0, "wake_sigma": 0.0, "pass_sigma": 0.0},
      "points": {...raw measurements, optional...}
    }

Pass model: a pass with prefill items (new_i tokens on top of cached_i) costs the prefill formula
(the last term is attention work, c*N^2 for one whole prompt of N tokens, DistServe's form); a
pass of B decoding sequences holding C context tokens in total costs the decode formula; a mixed
pass (prefill items joining a decode step) costs both minus the smaller constant term, which is
counted once. A KV hand-off of T tokens over a backend costs latency_s + T*kv_bytes_per_token /
bytes_per_s. ``overhead`` is what the serving stack adds on the machine that runs a sim cluster
(wall seconds, scaled by the speedup like any wall time): per pass, per sequence in a pass (the
loop thread's scheduling, sampling, detokenizing and streaming of each sequence's token), the pass
overhead multiplied by a random factor of mean 1 (lognormal, log-space deviation ``jitter_sigma``:
late wake-ups and stalls of a process on a busy machine), a delay per pass whatever its batch
(mean ``wake_s``, lognormal with log-space deviation ``wake_sigma``), and once per request.
``pass_sigma`` spreads the pass model's own time (a random factor of mean 1, lognormal): the
planner draws it, the sim engine does not (it waits the mean).

Invariants: `Profile.from_json(p.to_json()) == p`; loading rejects another format, another
version, missing fields and negative coefficients with a ValueError that names the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "pdserve-profile"
PROFILE_VERSION = 1
TRANSFER_BACKENDS = ("shm", "grpc", "ray")


def _coef(doc: Mapping[str, Any], name: str, count: int) -> tuple[float, ...]:
    values = doc.get("coef")
    if not isinstance(values, list | tuple) or len(values) != count:
        raise ValueError(f"{name}.coef: need a list of {count} numbers, got {values!r}")
    out = tuple(float(v) for v in values)
    if any(v < 0 for v in out):
        raise ValueError(f"{name}.coef: coefficients must be >= 0, got {list(out)}")
    return out


def split_pass(items: Iterable[tuple[int, int]]) -> tuple[list[tuple[int, int]], int, int]:
    """A pass's sequences, each (new tokens, cached tokens), in the pass model's terms: the prompt
    chunks (new, cached), the decode batch, and its context tokens in total (this pass's token
    included). A decode item is one new token on a cached prefix."""
    prefill: list[tuple[int, int]] = []
    batch = context = 0
    for new, cached in items:
        if new == 1 and cached > 0:
            batch += 1
            context += cached + 1
        else:
            prefill.append((new, cached))
    return prefill, batch, context


def prefill_terms(items: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(new tokens, attention work sum(new_i * (cached_i + new_i))) of prompt chunks (new, cached)."""
    return sum(n for n, _ in items), sum(n * (cached + n) for n, cached in items)


@dataclass(frozen=True)
class PrefillCost:
    """a + b*new_tokens + c*sum(new_i * (cached_i + new_i)) seconds per pass."""

    a: float
    b: float
    c: float

    def seconds(self, items: Sequence[tuple[int, int]]) -> float:
        """items: (new tokens, cached tokens) of each prompt chunk in the pass."""
        new, attention = prefill_terms(items)
        return self.a + self.b * new + self.c * attention

    def to_json(self) -> dict[str, Any]:
        return {"coef": [self.a, self.b, self.c]}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PrefillCost:
        return cls(*_coef(doc, "prefill", 3))


@dataclass(frozen=True)
class DecodeCost:
    """a + b*batch + c*total_context_tokens seconds per step."""

    a: float
    b: float
    c: float

    def seconds(self, batch: int, context_tokens: int) -> float:
        return self.a + self.b * batch + self.c * context_tokens

    def to_json(self) -> dict[str, Any]:
        return {"coef": [self.a, self.b, self.c]}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> DecodeCost:
        return cls(*_coef(doc, "decode", 3))


@dataclass(frozen=True)
class LinkCost:
    """latency_s + bytes / bytes_per_s seconds per KV hand-off."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not self.bytes_per_s > 0:
            raise ValueError(f"transfer: need latency_s >= 0 and bytes_per_s > 0, got {self}")

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def to_json(self) -> dict[str, Any]:
        return {"latency_s": self.latency_s, "bytes_per_s": self.bytes_per_s}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LinkCost:
        return cls(float(doc["latency_s"]), float(doc["bytes_per_s"]))


@dataclass(frozen=True)
class EngineLimits:
    """What one worker of the profiled deployment can hold and batch."""

    block_size: int = 16
    kv_capacity_tokens: int = 186_368
    max_num_seqs: int = 64
    max_batched_tokens: int = 4096
    prefill_chunk_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_capacity_tokens", "max_num_seqs", "max_batched_tokens", "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name}: must be >= 1, got {getattr(self, name)}")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError("engine.kv_capacity_tokens: must hold at least one block")

    @property
    def num_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def to_json(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in ("block_size", "kv_capacity_tokens", "max_num_seqs", "max_batched_tokens", "prefill_chunk_tokens")
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> EngineLimits:
        return cls(**{k: int(doc[k]) for k in cls().to_json() if k in doc})


@dataclass(frozen=True)
class Overhead:
    """Wall seconds the serving stack adds on the machine running a sim cluster."""

    per_pass_s: float = 0.0
    per_request_s: float = 0.0
    per_seq_s: float = 0.0  # per sequence in a pass (a missing key reads 0: older profiles load)
    # the pass overhead is multiplied by a random factor of mean 1 (lognormal with this log-space
    # deviation; 0: constant): late wake-ups and stalls of a process on a busy machine
    jitter_sigma: float = 0.0
    # a delay added to every pass whatever its batch (a sleep that ends late, a process waiting
    # for a core): mean `wake_s` wall seconds, lognormal with log-space deviation `wake_sigma`
    # (0: constant); both 0 in older profiles (no such delay)
    wake_s: float = 0.0
    wake_sigma: float = 0.0
    # the pass model's own time (prefill / decode formulas, not the overhead above) multiplied by a
    # random factor of mean 1, lognormal with this log-space deviation: how far a real machine's
    # passes spread around the fit (`pdserve plan fit` measures it on a pass log; 0: none, as in
    # older profiles). Only the planner draws it: a sim engine waits the modelled time itself
    pass_sigma: float = 0.0

    def __post_init__(self) -> None:
        if (
            min(
                self.per_pass_s,
                self.per_request_s,
                self.per_seq_s,
                self.jitter_sigma,
                self.wake_s,
                self.wake_sigma,
                self.pass_sigma,
            )
            < 0
        ):
            raise ValueError(f"overhead: must be >= 0, got {self}")

    def pass_s(self, num_seqs: int) -> float:
        """Wall seconds the stack adds to one pass over `num_seqs` sequences."""
        return self.per_pass_s + self.per_seq_s * num_seqs

    def to_json(self) -> dict[str, Any]:
        return {
            "per_pass_s": self.per_pass_s,
            "per_seq_s": self.per_seq_s,
            "per_request_s": self.per_request_s,
            "jitter_sigma": self.jitter_sigma,
            "wake_s": self.wake_s,
            "wake_sigma": self.wake_sigma,
            "pass_sigma": self.pass_sigma,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Overhead:
        return cls(
            float(doc.get("per_pass_s", 0.0)),
            float(doc.get("per_request_s", 0.0)),
            float(doc.get("per_seq_s", 0.0)),
            float(doc.get("jitter_sigma", 0.0)),
            float(doc.get("wake_s", 0.0)),
            float(doc.get("wake_sigma", 0.0)),
            float(doc.get("pass_sigma", 0.0)),
        )


@dataclass(frozen=True)
class Profile:
    """One device + model pair; see the module docstring for the JSON form."""

    name: str
    model_name: str
    kv_bytes_per_token: float
    prefill: PrefillCost
    decode: DecodeCost
    transfer: dict[str, LinkCost]
    engine: EngineLimits = EngineLimits()
    overhead: Overhead = Overhead()
    max_model_len: int = 8192
    contention_workers: int = 1
    description: str = ""
    source: str = ""
    device: dict[str, Any] = field(default_factory=dict)
    points: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
        if not self.kv_bytes_per_token > 0:
            raise ValueError(f"model.kv_bytes_per_token: must be > 0, got {self.kv_bytes_per_token}")
        if not self.transfer:
            raise ValueError("transfer: need at least one backend")
        unknown = set(self.transfer) - set(TRANSFER_BACKENDS)
        if unknown:
            raise ValueError(f"transfer: unknown backends {sorted(unknown)}; known: {list(TRANSFER_BACKENDS)}")
        if self.max_model_len < 2 or self.contention_workers < 1:
            raise ValueError("model.max_model_len must be >= 2 and contention_workers >= 1")

    # ----- the timing model ------------------------------------------------------------------
    def pass_s(self, prefill_items: Sequence[tuple[int, int]], decode_batch: int, decode_context: int) -> float:
        """One forward pass: prefill chunks (new, cached) plus a decode step of `decode_batch`
        sequences holding `decode_context` tokens; a mixed pass pays the constant term once."""
        total = 0.0
        if prefill_items:
            total += self.prefill.seconds(prefill_items)
        if decode_batch:
            total += self.decode.seconds(decode_batch, decode_context)
        if prefill_items and decode_batch:
            total -= min(self.prefill.a, self.decode.a)
        return total

    def link(self, backend: str) -> LinkCost:
        """The link of `backend`, else the first one listed (profiles need not list every backend)."""
        return self.transfer.get(backend) or next(iter(self.transfer.values()))

    def transfer_s(self, backend: str, tokens: int) -> float:
        """Hand-off of `tokens` tokens' K/V through `backend`."""
        return self.link(backend).seconds(tokens * self.kv_bytes_per_token)

    # ----- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "model": {
                "name": self.model_name,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "max_model_len": self.max_model_len,
            },
            "device": self.device,
            "contention_workers": self.contention_workers,
            "prefill": self.prefill.to_json(),
            "decode": self.decode.to_json(),
            "transfer": {k: v.to_json() for k, v in self.transfer.items()},
            "engine": self.engine.to_json(),
            "overhead": self.overhead.to_json(),
            "points": self.points,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Profile:
        if doc.get("format") != PROFILE_FORMAT:
            raise ValueError(f"format: expected {PROFILE_FORMAT!r}, got {doc.get('format')!r}")
        if doc.get("version") != PROFILE_VERSION:
            raise ValueError(f"version: this pdserve reads version {PROFILE_VERSION}, got {doc.get('version')!r}")
        try:
            model = doc["model"]
            return cls(
                name=str(doc["name"]),
                model_name=str(model["name"]),
                kv_bytes_per_token=float(model["kv_bytes_per_token"]),
                max_model_len=int(model.get("max_model_len", 8192)),
                prefill=PrefillCost.from_json(doc["prefill"]),
                decode=DecodeCost.from_json(doc["decode"]),
                transfer={str(k): LinkCost.from_json(v) for k, v in doc["transfer"].items()},
                engine=EngineLimits.from_json(doc.get("engine", {})),
                overhead=Overhead.from_json(doc.get("overhead", {})),
                contention_workers=int(doc.get("contention_workers", 1)),
                description=str(doc.get("description", "")),
                source=str(doc.get("source", "")),
                device=dict(doc.get("device", {})),
                points=dict(doc.get("points", {})),
            )
        except KeyError as exc:
            raise ValueError(f"profile: missing field {exc.args[0]!r}") from None
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"profile: malformed document ({exc})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file (ValueError for a bad document, OSError for a bad path)."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a profile is a JSON object")
    return Profile.from_json(doc)
