"""The typed settings of a pdserve deployment: one frozen dataclass per section (`ModelSection`,
`RouterSection`, the pools, ...), each field carrying its default, help, flag, bounds or choices and
the modes that honour it (`opt`), and `add_section_flags`, which turns fields into argparse flags.

Every section setting has its default here and nowhere else (the two top-level settings, `mode`
and `startup_timeout_s`, are `DeploymentConfig`'s): `pdserve serve` (`cluster.deploy_config`,
which composes the sections into `DeploymentConfig`) and each process's own command line (the
router, prefill, decode, colocated and elastic workers) generate their flags from these fields, so a
process started by hand gets the same defaults as one a launcher configured.

`SectionFlags` ties a process's flags to its typed per-process config: the settings of one section
that a process takes go on its command line (`add_to`) and come back from the parsed flags as that
section (`section_of`), so a worker's config object and its flags are generated from one list.

Pure Python (no torch, no numpy); lives beside the other shared modules so the engine's and the
router's parsers can import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.constants import (
    ENGINES,
    KV_BACKENDS,
    KV_CHECKSUMS,
    KV_STREAMING,
    LOG_FORMATS,
    LOG_LEVELS,
    LOOPBACK,
    MODES,
    PLACEMENTS,
    POLICY_NAMES,
    REQUEST_TIMEOUT_S,
)
from pdserve.devices import DEVICE_HELP, DTYPE_HELP, DTYPE_NAMES, check_device_name
from pdserve.limits import GRPC_CALLS_PER_PEER, GRPC_CALLS_TOTAL, GRPC_CONNECTION_IDLE_S
from pdserve.model_cache import MODEL_NAME


def opt(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[Any, ...] | None = None,  # noqa: A002, ANN401
    min: float | None = None,
    gt: float | None = None,
    max: float | None = None,  # noqa: A002
    modes: tuple[str, ...] = MODES,
    why: str = "",
    check: Callable[[Any], Any] | None = None,
) -> Any:  # noqa: ANN401
    """A config field with its documentation: `flag` (default: derived from section and name), bounds,
    choices, `check` (raises ValueError for a malformed value), and the `modes` that honour it (`why`:
    the reason the others cannot)."""
    meta = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "min": min,
        "gt": gt,
        "max": max,
        "modes": modes,
        "why": why,
        "check": check,
    }
    return field(default=default, metadata=meta)


# ----- sections ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSection:
    """What every worker runs."""

    path: str | None = opt(None, "local Hugging Face folder (default: the default model)", flag="--model")
    name: str | None = opt(None, "model id of the HTTP API (default: the model folder's name)", flag="--model-name")
    device: str = opt("auto", "every worker's device: " + DEVICE_HELP, flag="--device", check=check_device_name)
    dtype: str = opt("auto", "every worker's dtype: " + DTYPE_HELP, flag="--dtype", choices=DTYPE_NAMES)
    block_size: int = opt(16, "tokens per KV block (the same on every worker)", flag="--block-size", min=1)
    engine: str = opt(
        "model",
        "model: run the model; sim: workers wait a latency profile's pass times (no weights)",
        flag="--engine",
        choices=ENGINES,
    )
    profile: str | None = opt(None, "latency profile (JSON) of the sim engine", flag="--profile")
    speedup: float = opt(1.0, "sim engine: modelled durations are divided by this", flag="--speedup", gt=0)
    compile: bool = opt(
        False,
        "run decode passes through a torch.compile'd decoder layer (needs a C++ compiler; "
        "each worker compiles for tens of seconds on its first decode passes; falls back to "
        "eager with a log line when compiling fails; see 'Compiled decode layer' above)",
        flag="--compile",
    )
    deterministic: bool = opt(
        False,
        "batch-invariant mode: a request's tokens do not depend on what else is in its "
        "batch, on the prefill/decode split, or on a failover or migration (greedy and "
        "seeded sampling, float32 and bfloat16; needs the native CPU kernels and a "
        "Llama-family model; costs throughput, docs/performance.md)",
        flag="--deterministic",
    )
    kernel_table: str | None = opt(
        None,
        "the linear-kernel table every worker uses (JSON, or a file written by "
        "`python -m pdserve.engine.kernel_table`); default: the launcher times one per "
        "deployment and hands it to every worker",
        flag="--kernel-table",
    )

    @property
    def served_name(self) -> str:
        """The model id of the HTTP API: as configured, else the model folder's name."""
        if self.name:
            return self.name
        return Path(self.path).name if self.path else MODEL_NAME


#: The `model` settings that choose and tune the engine (`--engine`, `--profile`, `--speedup`).
ENGINE_SETTINGS = ("engine", "profile", "speedup")


@dataclass(frozen=True)
class RouterSection:
    """The router: public address, worker selection, limits, the OpenAI HTTP API."""

    host: str = opt(
        LOOPBACK, "router interface (workers use loopback unless ray.worker_host says otherwise)", flag="--host"
    )
    port: int = opt(50051, "router gRPC port (0 picks a free one)", flag="--port", min=0, max=65535)
    prefill_policy: str = opt(
        "round_robin", "how the router picks a prefill worker", flag="--prefill-policy", choices=POLICY_NAMES
    )
    decode_policy: str = opt(
        "round_robin", "how the router picks a decode worker", flag="--decode-policy", choices=POLICY_NAMES
    )
    max_queued_requests: int = opt(
        4096,
        "requests waiting for a decode slot; one more is refused (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After)",
        flag="--max-queued-requests",
        min=1,
    )
    max_concurrent_streams: int = opt(
        256, "requests at workers at once; more wait in the admission queue", flag="--max-concurrent-streams", min=1
    )
    max_stream_timeout_s: float = opt(
        REQUEST_TIMEOUT_S, "deadline cap of one request's stream (s)", flag="--max-stream-timeout", gt=0
    )
    max_attempts: int = opt(
        3,
        "a request is tried on at most this many (decode, prefill) pairs when workers fail",
        flag="--max-attempts",
        min=1,
    )
    http_port: int | None = opt(
        None,
        "also serve the OpenAI-compatible HTTP API on this port (0 picks one; default off)",
        flag="--http-port",
        min=0,
        max=65535,
    )
    decode_mux: bool = opt(
        False,
        "one GenerateMux stream per decode worker carries every request's tokens, a "
        "decode step's in one message (default: a Generate call per request)",
        flag="--decode-mux",
    )
    kv_aware_request_tokens: float = opt(
        128.0,
        "kv_aware policy: prompt tokens of work one running request on a decode worker counts as",
        flag="--kv-aware-request-tokens",
        min=0,
    )
    kv_aware_kv_tokens: float = opt(
        512.0,
        "kv_aware policy: prompt tokens of work a full KV pool on a decode worker counts as",
        flag="--kv-aware-kv-tokens",
        min=0,
    )
    conditional_disagg_tokens: int = opt(
        0,
        "with a KV-aware policy: requests with fewer prompt tokens uncached on "
        "their decode worker are prefilled there (0: always disaggregate; the best "
        "value depends on the hardware: measure it, docs/performance.md)",
        flag="--conditional-disagg-tokens",
        min=0,
    )
    slo_ttft_s: float = opt(
        0.0,
        "refuse (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After) a request whose predicted "
        "TTFT exceeds this many seconds, unless best_effort (0: off)",
        flag="--slo-ttft",
        min=0,
    )
    drain_timeout_s: float = opt(
        5.0,
        "on stop (SIGTERM, Ctrl-C) the router first refuses new requests (UNAVAILABLE / HTTP 503) and "
        "lets open streams finish for up to this long; those still open then fail UNAVAILABLE, and "
        "only then do the workers stop (0: end them at once)",
        flag="--router-drain-timeout",
        min=0,
    )
    grpc_calls_per_peer: int = opt(
        GRPC_CALLS_PER_PEER,
        "open gRPC calls one client host may hold on the public port; one more is refused (RESOURCE_EXHAUSTED)",
        flag="--grpc-calls-per-peer",
        min=1,
    )
    grpc_calls_total: int = opt(
        GRPC_CALLS_TOTAL,
        "open gRPC calls of all clients together on the public port; one more is refused (RESOURCE_EXHAUSTED)",
        flag="--grpc-calls-total",
        min=1,
    )
    grpc_connection_idle_s: float = opt(
        GRPC_CONNECTION_IDLE_S,
        "a public gRPC connection without an open call "
        "(or that has not finished its handshake) for this long is closed; "
        "clients reconnect on their next call",
        flag="--grpc-connection-idle",
        gt=0,
    )
    grpc_connection_age_s: float = opt(
        3600.0,
        "a public gRPC connection is told to go away (GOAWAY) after this "
        "long; its open calls keep running up to the stream deadline cap "
        "(max_stream_timeout_s), then it is closed (0: no age cap)",
        flag="--grpc-connection-age",
        min=0,
    )


@dataclass(frozen=True)
class PoolSection:
    """Settings every worker pool has."""

    count: int | None = opt(None, "workers in this pool", min=0)
    threads: int | None = opt(
        None,
        "torch threads per worker (default: the CPUs split among the workers of "
        "its phase locally, Ray's choice with --ray)",
        min=1,
    )
    kv_cache_mb: int = opt(512, "KV cache memory per worker (MB)", min=1)
    max_batched_tokens: int = opt(4096, "token budget of one forward pass", min=1)
    prefix_caching: bool = opt(True, "reuse the K/V of prompt prefixes this worker holds")
    request_timeout_s: float = opt(REQUEST_TIMEOUT_S, "deadline of one request at a worker (s)", gt=0)
    kv_timeout_s: float = opt(120.0, "deadline of one KV transfer or remote prefill (s)", gt=0)
    drain_timeout_s: float = opt(
        30.0, "on stop or scale-down, finish requests in flight for at most this long (s)", gt=0
    )


@dataclass(frozen=True)
class PrefillPool(PoolSection):
    """The prefill pool."""

    count: int | None = opt(None, "prefill workers (default 1, or 0 with colocated workers)", flag="--prefill", min=0)
    kv_cache_mb: int = opt(256, "KV cache memory per worker (MB)", min=1)
    chunk_tokens: int = opt(
        512,
        "at most this many tokens of one prompt per pass, so long prompts do not block short ones (0: whole prompts)",
        flag="--prefill-chunk-tokens",
        min=0,
    )
    request_timeout_s: float = opt(300.0, "deadline of one request at a worker (s)", gt=0)
    kv_timeout_s: float = opt(60.0, "deadline of one KV transfer (s)", gt=0)


@dataclass(frozen=True)
class ColocatedPool(PoolSection):
    """Colocated workers: prefill and decode in one process (the classic server)."""

    count: int | None = opt(
        0,
        "colocated workers (prefill + decode in one)",
        flag="--colocated",
        min=0,
        modes=("local",),
        why="the Ray deployment has prefill and decode pools only",
    )
    max_num_seqs: int = opt(64, "most sequences in one decode batch", min=1)
    chunk_tokens: int = opt(
        512,
        "prompts this worker prefills itself (colocated, short ones, a resumed request that wants its "
        "prompt logprobs) go at most this many tokens per pass; beside running streams their chunks together cost "
        "one such chunk at most (fewer tokens deep in a long prompt), so streams stall one "
        "chunk's time at most (0: whole prompts)",
        min=0,
    )
    admission_timeout_s: float = opt(30.0, "how long a request may wait for a decode slot at the worker (s)", gt=0)


@dataclass(frozen=True)
class DecodePool(ColocatedPool):
    """The decode pool."""

    count: int | None = opt(None, "decode workers (default 1, or 0 with colocated workers)", flag="--decode", min=0)
    local_prefill_threshold: int = opt(
        0,
        "decode workers prefill prompts shorter than this many tokens themselves (0: off)",
        flag="--local-prefill-threshold",
        min=0,
    )


@dataclass(frozen=True)
class KvTransferSection:
    """How KV moves from prefill to decode workers."""

    backend: str = opt(
        "auto",
        "grpc (streamed to the decode worker's port), shm (same-host shared memory; local "
        "only), ray (the object store; --ray only), auto (for a same-host prefill worker: cuda_ipc, "
        "device to device, when both KV caches are on CUDA, else shm, with a log line; else grpc; "
        "grpc with --ray)",
        flag="--kv-backend",
        choices=KV_BACKENDS,
    )
    streaming: str = opt(
        "request",
        "layer: ship each layer's K/V while the prefill pass still runs",
        flag="--kv-streaming",
        choices=KV_STREAMING,
    )
    checksum: str = opt(
        "",
        "shm backend: checksum the copied blocks (xxh3 or crc32; '' off); the gRPC stream always checksums",
        flag="--kv-checksum",
        choices=KV_CHECKSUMS,
        modes=("local",),
        why="it checks the shm backend, which is local only",
    )
    shared_cache: bool = opt(
        True,
        "prefill workers keep their KV cache in shared memory (the shm backend's source)",
        flag="--shared-kv-cache",
    )


_RAY_ONLY = ("ray",)
_RAY_WHY = "Ray placement applies to `serve --ray` only"


@dataclass(frozen=True)
class RaySection:
    """Ray placement and restarts (`pdserve serve --ray`)."""

    address: str | None = opt(
        None,
        "Ray cluster to join (e.g. auto); default: start a local Ray instance",
        flag="--address",
        modes=_RAY_ONLY,
        why=_RAY_WHY,
    )
    placement: str = opt(
        "auto",
        "where the actors go: spread (each pool's workers over different nodes, so a node "
        "loss leaves every pool a worker), pack (all on as few nodes as possible), strict_spread "
        "(every worker and the router on its own node), auto (spread on a cluster of several "
        "nodes, else pack)",
        flag="--placement",
        choices=PLACEMENTS,
        modes=_RAY_ONLY,
        why=_RAY_WHY,
    )
    worker_host: str = opt(
        LOOPBACK,
        "interface of the workers' gRPC servers; 'node' = the node's IP (needed across nodes)",
        flag="--worker-host",
        modes=_RAY_ONLY,
        why=_RAY_WHY,
    )
    gpus_per_worker: float | None = opt(
        None, "GPUs per worker actor (default: 1 CPU)", flag="--gpus-per-worker", gt=0, modes=_RAY_ONLY, why=_RAY_WHY
    )
    prefill_resource: str | None = opt(
        None,
        "custom Ray resource each prefill worker needs (e.g. prefill_gpu)",
        flag="--prefill-resource",
        modes=_RAY_ONLY,
        why=_RAY_WHY,
    )
    decode_resource: str | None = opt(
        None,
        "custom Ray resource each decode worker needs (e.g. decode_gpu)",
        flag="--decode-resource",
        modes=_RAY_ONLY,
        why=_RAY_WHY,
    )
    router_resource: str | None = opt(
        None,
        "custom Ray resource the router actor needs, e.g. one only the head node has",
        flag="--router-resource",
        modes=_RAY_ONLY,
        why=_RAY_WHY,
    )
    max_restarts: int = opt(
        3, "restarts of a worker actor that died", flag="--max-restarts", min=0, modes=_RAY_ONLY, why=_RAY_WHY
    )
    restart_wait_s: float = opt(
        60.0,
        "when no worker of a pool is healthy but one is restarting, requests (new and "
        "in flight) wait this long for it, within their deadline, instead of failing (0: "
        "fail at once)",
        flag="--restart-wait",
        min=0,
        modes=_RAY_ONLY,
        why=_RAY_WHY,
    )
    router_max_restarts: int = opt(
        3,
        "restarts of the router actor (it re-reads its workers)",
        flag="--router-max-restarts",
        min=0,
        modes=_RAY_ONLY,
        why=_RAY_WHY,
    )
    poll_interval_s: float = opt(
        1.0,
        "how often the controller checks worker addresses and roles (s)",
        flag="--ray-poll-interval",
        gt=0,
        modes=_RAY_ONLY,
        why=_RAY_WHY,
    )


@dataclass(frozen=True)
class SecuritySection:
    """Credentials of the public API and of the internal plane (docs/security.md)."""

    auth_token_file: str | None = opt(
        None,
        "require 'authorization: Bearer <token>' on gRPC and /v1/* HTTP "
        "(token: first line of FILE; or set PDSERVE_AUTH_TOKEN)",
        flag="--auth-token-file",
    )
    tls_cert: str | None = opt(None, "serve the router's gRPC and HTTP API over TLS (PEM)", flag="--tls-cert")
    tls_key: str | None = opt(None, "private key of tls_cert (PEM)", flag="--tls-key")
    internal_token_file: str | None = opt(
        None,
        "internal token of router -> worker and KV calls (first line of "
        "FILE; default: PDSERVE_INTERNAL_TOKEN[_FILE], else one generated per "
        "launch)",
        flag="--internal-token-file",
    )
    internal_grpc_calls_per_peer: int = opt(
        GRPC_CALLS_PER_PEER,
        "open gRPC calls one peer host (the router, a "
        "worker) may hold on each worker's internal port; one more is refused "
        "(RESOURCE_EXHAUSTED)",
        flag="--internal-grpc-calls-per-peer",
        min=1,
    )
    internal_grpc_calls_total: int = opt(
        GRPC_CALLS_TOTAL,
        "open gRPC calls of all peers together on each worker's internal port",
        flag="--internal-grpc-calls-total",
        min=1,
    )
    auth_tokens_file: str | None = opt(
        None,
        "several public API tokens, one 'TENANT TOKEN' pair per line: each "
        "tenant's requests get their own prefix-cache namespace (no shared blocks, "
        "no cached_tokens across tenants); instead of auth_token_file",
        flag="--auth-tokens-file",
    )


@dataclass(frozen=True)
class ObservabilitySection:
    """Logs and metrics of every process."""

    log_level: str = opt("INFO", "log level of every process", flag="--log-level", choices=LOG_LEVELS)
    log_format: str = opt("text", "log lines of every process", flag="--log-format", choices=LOG_FORMATS)
    log_dir: str | None = opt(
        None,
        "per-process logs (default: a new temp dir)",
        flag="--log-dir",
        modes=("local",),
        why="Ray keeps actor logs in its session folder",
    )
    metrics: bool = opt(
        False,
        "Prometheus /metrics on every process (free ports)",
        flag="--metrics",
        modes=("local",),
        why="the Ray deployment serves no Prometheus /metrics yet (use Ray's own)",
    )
    metrics_host: str = opt(
        LOOPBACK,
        "interface of the router's /metrics; beyond loopback needs an auth token",
        flag="--metrics-host",
        modes=("local",),
        why="the Ray deployment serves no /metrics",
    )


@dataclass(frozen=True)
class ElasticSection:
    """Elastic roles and the SLO autoscaler: workers that switch between prefill and
    decode at runtime (`pdserve role`), and a loop that switches them to keep the SLOs (on Ray it
    also adds and removes workers within min_workers..max_workers)."""

    enabled: bool = opt(
        False,
        "workers can switch between prefill and decode at runtime (`pdserve role`; "
        "`python -m pdserve.elastic_worker`, or elastic worker actors with --ray)",
        flag="--elastic",
    )
    autoscale: bool = opt(
        False,
        "switch worker roles to keep elastic.slo, and with --ray add or remove workers "
        "within min/max_workers (implies elastic.enabled)",
        flag="--autoscale",
    )
    slo: str = opt("", "SLOs the autoscaler keeps, e.g. ttft_ms=500,tpot_ms=50 (needs elastic.autoscale)", flag="--slo")
    min_workers: int = opt(
        2,
        "the autoscaler's lower bound of the worker count (--ray: it never removes below it)",
        flag="--min-workers",
        min=2,
    )
    max_workers: int = opt(
        8,
        "the autoscaler's upper bound of the worker count (--ray: it never adds above it)",
        flag="--max-workers",
        min=2,
    )
    interval_s: float = opt(1.0, "the autoscaler's control loop period (s)", flag="--autoscale-interval", gt=0)

    @property
    def switchable(self) -> bool:
        """Workers run as `python -m pdserve.elastic_worker` (elastic roles, or the autoscaler that needs them)."""
        return self.enabled or self.autoscale


# ----- flags ------------------------------------------------------------------------------------


def section_field(section: type, name: str) -> dataclasses.Field[Any]:
    """The dataclass field `name` of `section` (KeyError naming both when there is none)."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    if name not in fields:
        raise KeyError(f"{section.__name__} has no setting {name!r}")
    return fields[name]


def section_default(section: type, name: str) -> Any:  # noqa: ANN401
    """The default of setting `name` of `section`: for a hand-written flag whose shape the generator
    does not make (e.g. an optional value), so its default still lives only in the section."""
    return section_field(section, name).default


def field_type(section: type, name: str) -> tuple[type, bool]:
    """(int|float|str|bool, optional) of a setting, from its type annotation."""
    hint = typing.get_type_hints(section)[name]
    args = typing.get_args(hint)
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    return base, type(None) in args


def flag_kwargs(section: type, name: str, default: Any) -> dict[str, Any]:  # noqa: ANN401
    """argparse keywords of a setting's flag (type or action, choices, metavar, help with the field's
    default) with `default` as the parsed default (the field's own, or SUPPRESS for "not given")."""
    f = section_field(section, name)
    base, _ = field_type(section, name)
    text = f.metadata["help"] + ("" if f.default is None or base is bool else f" (default {f.default})")
    kwargs: dict[str, Any] = {"default": default, "help": text}
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        return kwargs
    kwargs["type"] = base
    if f.metadata["choices"] is not None:
        kwargs["choices"] = f.metadata["choices"]
    kwargs["metavar"] = (
        None
        if f.metadata["choices"]
        else "N"
        if base is int
        else "S"
        if name.endswith("_s")
        else "X"
        if base is float
        else name.upper()
    )
    return kwargs


def process_flag(section: type, name: str, flags: Mapping[str, str] | None = None) -> str:
    """The flag of setting `name` on a process's own command line: `flags[name]` when the process
    spells it differently, else the setting's `pdserve serve` flag, else --<name>."""
    if flags and name in flags:
        return flags[name]
    return str(section_field(section, name).metadata["flag"] or "--" + name.replace("_", "-"))


def add_section_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    section: type,
    names: Iterable[str],
    flags: Mapping[str, str] | None = None,
) -> None:
    """Add one flag per setting in `names` of `section` to a process's parser, defaulting to the
    field's default (so a process started by hand behaves as one a launcher configured). `flags`:
    the settings this process spells differently (`internal_grpc_calls_per_peer` is a worker's
    `--grpc-calls-per-peer`). The dest stays argparse's (the flag's name with underscores): it is
    the key of the process's JSON document (`pdserve.process_config`)."""
    for name in names:
        kwargs = flag_kwargs(section, name, default=section_default(section, name))
        check = section_field(section, name).metadata["check"]
        if check is not None:
            kwargs["type"] = check
        parser.add_argument(process_flag(section, name, flags), **kwargs)


@dataclass(frozen=True)
class SectionFlags:
    """The settings `names` of `section` on one process's command line, both ways: `add_to` adds
    their flags (spelled as in `flags` where the process spells them otherwise), `section_of` reads
    the parsed flags back as a `section` instance (its other settings keep their defaults: the
    process does not read them). `by_hand`: names among `names` whose flag the process adds itself
    (a shape the generator does not make, e.g. an optional value); read back all the same."""

    section: type
    names: tuple[str, ...]
    flags: Mapping[str, str] = field(default_factory=dict)
    by_hand: tuple[str, ...] = ()

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        add_section_flags(parser, self.section, [n for n in self.names if n not in self.by_hand], self.flags)

    def dest(self, name: str) -> str:
        """The parsed flags' attribute of setting `name` (argparse's dest of its flag)."""
        return process_flag(self.section, name, self.flags).lstrip("-").replace("-", "_")

    def section_of(self, args: argparse.Namespace) -> Any:  # noqa: ANN401 - an instance of self.section
        return self.section(**{name: getattr(args, self.dest(name)) for name in self.names})
