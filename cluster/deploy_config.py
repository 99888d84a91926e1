"""DeploymentConfig: the one typed configuration of a pdserve deployment, from `pdserve serve` to
every process.

- Sections (frozen dataclasses): ``model``, ``router``, the pools ``prefill``, ``decode`` and
  ``colocated``, ``kv`` (KV transfer), ``ray``, ``security``, ``observability``, ``elastic`` (role
  switches and the SLO autoscaler; local and Ray), plus ``mode`` ("local" or "ray") and
  ``startup_timeout_s``; the sections live in `pdserve.settings`. Each field carries its help text,
  its flag, its bounds or choices and the modes that honour it (`opt`); `--help`, validation,
  `--print-config` and every process's own flags (`settings.add_section_flags`) all read them.
- Sources: a YAML or TOML file (`load_file`), then `pdserve serve` flags on top (`add_flags`,
  `overrides_from_args`); `from_dict` rejects an unknown key or a bad value naming the dotted key
  (``decode.max_num_seqs``), and a setting the chosen mode cannot honour (`DeploymentConfig.check`).
- Consumers: `router_document` and `worker_document` turn it into each process's JSON document
  (`pdserve.process_config`): the local launcher writes them to files for `--config`, the Ray
  controller hands them to its actors. Both launchers share these two functions, so a setting is
  mapped onto a process in exactly one place.

Pure Python (no torch, no ray import).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.constants import LOOPBACK, MODES
from pdserve.settings import (
    ColocatedPool,
    DecodePool,
    ElasticSection,
    KvTransferSection,
    ModelSection,
    ObservabilitySection,
    PoolSection,
    PrefillPool,
    RaySection,
    RouterSection,
    SecuritySection,
    field_type,
    flag_kwargs,
    opt,
)
from pdserve.transport import is_loopback

WORKER_HOST = LOOPBACK  # local workers always bind loopback


class ConfigError(ValueError):
    """A bad configuration; the message starts with the dotted key."""


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "router": RouterSection,
    "prefill": PrefillPool,
    "decode": DecodePool,
    "colocated": ColocatedPool,
    "kv": KvTransferSection,
    "ray": RaySection,
    "security": SecuritySection,
    "observability": ObservabilitySection,
    "elastic": ElasticSection,
}
POOLS = ("prefill", "decode", "colocated")
GROUP_TITLES = {
    "model": "model",
    "router": "router",
    "prefill": "prefill pool",
    "decode": "decode pool",
    "colocated": "colocated pool",
    "kv": "KV transfer",
    "ray": "Ray (with --ray; see docs/ray.md)",
    "security": "security (see docs/security.md)",
    "observability": "observability",
    "elastic": "elastic roles and the SLO autoscaler (see docs/configuration.md, docs/ray.md)",
}


@dataclass(frozen=True)
class DeploymentConfig:
    """A whole deployment; validated on construction (ConfigError naming the dotted key)."""

    mode: str = opt("local", "local: processes on this machine; ray: Ray actors", flag="--mode", choices=MODES)
    startup_timeout_s: float = opt(300.0, "how long start-up may take (s)", flag="--startup-timeout", gt=0)
    model: ModelSection = field(default_factory=ModelSection)
    router: RouterSection = field(default_factory=RouterSection)
    prefill: PrefillPool = field(default_factory=PrefillPool)
    decode: DecodePool = field(default_factory=DecodePool)
    colocated: ColocatedPool = field(default_factory=ColocatedPool)
    kv: KvTransferSection = field(default_factory=KvTransferSection)
    ray: RaySection = field(default_factory=RaySection)
    security: SecuritySection = field(default_factory=SecuritySection)
    observability: ObservabilitySection = field(default_factory=ObservabilitySection)
    elastic: ElasticSection = field(default_factory=ElasticSection)

    def __post_init__(self) -> None:
        for name, value in _leaves(self):
            _check_field(name, _field_of(name), value)
        if self.colocated.count is None:
            object.__setattr__(self, "colocated", dataclasses.replace(self.colocated, count=0))
        pd_default = 0 if self.size("colocated") > 0 else 1
        for pool in ("prefill", "decode"):
            if getattr(self, pool).count is None:
                object.__setattr__(self, pool, dataclasses.replace(getattr(self, pool), count=pd_default))
        self.check()

    def check(self) -> None:
        """Per-mode and cross-field rules; ConfigError naming the key."""
        for name, value in _leaves(self):
            f = _field_of(name)
            if self.mode not in f.metadata["modes"] and value != _default_of(f):
                why = f.metadata["why"]
                raise ConfigError(
                    f"{name} ({f.metadata['flag'] or flag_of(name)}) is not supported "
                    f"{'with --ray' if self.mode == 'ray' else 'without --ray'}" + (f": {why}" if why else "")
                )
        if self.mode == "ray" and self.colocated != ColocatedPool():
            changed = next(
                f.name for f in dataclasses.fields(ColocatedPool) if getattr(self.colocated, f.name) != f.default
            )
            raise ConfigError(
                f"colocated.{changed} ({flag_of('colocated.' + changed)}) is not supported with --ray: "
                "the Ray deployment has prefill and decode pools only"
            )
        if self.mode == "ray" and self.kv.backend == "shm":
            raise ConfigError("kv.backend: shm is not supported with --ray (use grpc or ray)")
        if self.mode == "local" and self.kv.backend == "ray":
            raise ConfigError("kv.backend: ray (the object store) needs --ray; locally use auto, grpc or shm")
        if not ((self.size("prefill") >= 1 and self.size("decode") >= 1) or self.size("colocated") >= 1):
            raise ConfigError("prefill.count, decode.count: need prefill >= 1 and decode >= 1, or colocated >= 1")
        if (self.security.tls_cert is None) != (self.security.tls_key is None):
            raise ConfigError("security.tls_cert, security.tls_key: go together (--tls-cert and --tls-key)")
        if self.model.engine == "sim":
            if not self.model.profile:
                raise ConfigError("model.profile: the sim engine needs a latency profile (--profile FILE)")
            if not Path(self.model.profile).is_file():
                raise ConfigError(f"model.profile: {self.model.profile}: no such file")
        elif self.model.profile or self.model.speedup != 1.0:
            raise ConfigError("model.profile, model.speedup: need model.engine sim (--engine sim)")
        if not is_loopback(self.observability.metrics_host) and not self._has_auth_token():
            raise ConfigError(
                f"observability.metrics_host: refusing /metrics on {self.observability.metrics_host}, "
                "beyond loopback, without an auth token (--auth-token-file)"
            )
        if self.kv.checksum and self.kv.backend in ("grpc", "ray"):
            raise ConfigError(
                f"kv.checksum: applies to the shm backend only, not to kv.backend {self.kv.backend} "
                "(the gRPC stream checksums every frame itself)"
            )
        self._check_elastic()

    def _check_elastic(self) -> None:
        elastic = self.elastic
        if elastic.slo and not elastic.autoscale:
            raise ConfigError("elastic.slo (--slo): needs elastic.autoscale (--autoscale)")
        if not elastic.autoscale:
            return
        if not elastic.slo:
            raise ConfigError("elastic.autoscale (--autoscale): needs elastic.slo (--slo ttft_ms=..,tpot_ms=..)")
        try:
            self.autoscale_options()
        except ValueError as exc:
            raise ConfigError(f"elastic: {exc}") from None
        if self.mode == "ray" and not elastic.min_workers <= self.num_workers <= elastic.max_workers:
            raise ConfigError(
                f"elastic.min_workers/max_workers: the deployment starts with {self.num_workers} "
                f"workers, outside {elastic.min_workers}..{elastic.max_workers} "
                "(--ray resizes within them)"
            )

    def autoscale_options(self) -> Any:  # noqa: ANN401 - cluster.elastic_cli.AutoscaleOptions (lazy import)
        """The SLO autoscaler's options (`cluster.elastic_cli.AutoscaleOptions`), or None without
        elastic.autoscale. The planner gets the sim engine's latency profile, if any."""
        if not self.elastic.autoscale:
            return None
        from pdserve.cluster.elastic_cli import AutoscaleOptions, parse_slo

        profile = _abspath(self.model.profile) if self.model.engine == "sim" else None
        return AutoscaleOptions(
            parse_slo(self.elastic.slo),
            self.elastic.min_workers,
            self.elastic.max_workers,
            self.elastic.interval_s,
            profile,
        )

    def _has_auth_token(self) -> bool:
        import os

        return bool(self.security.auth_token_file or os.environ.get("PDSERVE_AUTH_TOKEN"))

    # ----- derived ------------------------------------------------------------------------------
    def size(self, pool: str) -> int:
        """Workers in `pool` (prefill, decode or colocated); a count left unset is resolved on construction."""
        count: int | None = getattr(self, pool).count
        return count or 0

    @property
    def num_workers(self) -> int:
        return sum(self.size(pool) for pool in POOLS)

    def worker_names(self) -> list[tuple[str, str]]:
        """(role, worker_id) of every worker, e.g. ("prefill", "prefill-0"): prefill, decode, colocated."""
        return [(pool, f"{pool}-{i}") for pool in POOLS for i in range(self.size(pool))]

    # ----- (de)serialization ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, doc: dict[str, Any], overrides: dict[str, Any] | None = None) -> DeploymentConfig:
        """A config from nested dicts (a parsed file), with `overrides` ({"decode.count": 2}) on top.
        Unknown keys and bad values raise ConfigError naming the dotted key."""
        doc = _merge(doc, overrides or {})
        _check_keys("", cls, doc)
        kwargs: dict[str, Any] = {}
        for key, value in doc.items():
            if key in SECTIONS:
                kwargs[key] = _section_from_dict(key, SECTIONS[key], value)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return str(yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False))


def _section_from_dict(name: str, cls: type, value: Any) -> Any:  # noqa: ANN401
    if value is None:
        return cls()
    _check_keys(name, cls, value)
    return cls(**value)


def _check_keys(name: str, cls: type, value: Any) -> None:  # noqa: ANN401
    """ConfigError unless `value` is a mapping of `cls`'s field names (`name`: its dotted prefix)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{name or '(top level)'}: expected a mapping, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in known:
            where = f" in {name}" if name else ""
            raise ConfigError(
                f"{name + '.' if name else ''}{key}: unknown key (known{where}: {', '.join(sorted(known))})"
            )


def _merge(doc: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (doc or {}).items()}
    for dotted, value in overrides.items():
        section, _, key = dotted.rpartition(".")
        if section:
            current = out.get(section)
            out[section] = {**(current if isinstance(current, dict) else {}), key: value}
        else:
            out[key] = value
    return out


def _leaves(config: DeploymentConfig) -> list[tuple[str, Any]]:
    """("section.name", value) of every setting, top-level fields as ("mode", value)."""
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in SECTIONS:
            out += [(f"{f.name}.{g.name}", getattr(value, g.name)) for g in dataclasses.fields(value)]
        else:
            out.append((f.name, value))
    return out


def field_names() -> list[str]:
    """Every setting's dotted name, in declaration order."""
    return [name for name, _ in _leaves(DeploymentConfig(colocated=ColocatedPool(count=0)))]


def _field_of(dotted: str) -> dataclasses.Field[Any]:
    section, _, name = dotted.rpartition(".")
    cls = SECTIONS[section] if section else DeploymentConfig
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def _default_of(f: dataclasses.Field[Any]) -> Any:  # noqa: ANN401
    return f.default


def _base_type(dotted: str) -> tuple[type, bool]:
    """(int|float|str|bool, optional) of a setting."""
    section, _, name = dotted.rpartition(".")
    return field_type(SECTIONS[section] if section else DeploymentConfig, name)


def _check_field(dotted: str, f: dataclasses.Field[Any], value: Any) -> None:  # noqa: ANN401
    base, optional = _base_type(dotted)
    if value is None:
        if optional or (f.name == "count" and dotted.split(".")[0] in ("prefill", "decode")):
            return
        raise ConfigError(f"{dotted}: must be set (got null)")
    ok = (
        isinstance(value, bool)
        if base is bool
        else isinstance(value, int) and not isinstance(value, bool)
        if base is int
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if base is float
        else isinstance(value, str)
    )
    if not ok:
        raise ConfigError(f"{dotted}: expected {base.__name__}{' or null' if optional else ''}, got {value!r}")
    meta = f.metadata
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"{dotted}: must be one of {', '.join(map(repr, meta['choices']))}, got {value!r}")
    if meta["min"] is not None and value < meta["min"]:
        raise ConfigError(f"{dotted}: must be >= {meta['min']}, got {value!r}")
    if meta["max"] is not None and value > meta["max"]:
        raise ConfigError(f"{dotted}: must be <= {meta['max']}, got {value!r}")
    if meta["gt"] is not None and not value > meta["gt"]:
        raise ConfigError(f"{dotted}: must be > {meta['gt']}, got {value!r}")
    if meta["check"] is not None:
        try:
            meta["check"](value)
        except ValueError as exc:
            raise ConfigError(f"{dotted}: {exc}") from None


# ----- files ------------------------------------------------------------------------------------


def load_file(path: str | Path) -> dict[str, Any]:
    """A config file's contents: YAML (.yaml/.yml), TOML (.toml) or JSON (.json)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10: the same parser as the tomli package
            import tomli as tomllib  # type: ignore[no-redef]
        doc: Any = tomllib.loads(text)
    elif suffix == ".json":
        doc = json.loads(text)
    elif suffix in (".yaml", ".yml"):
        import yaml

        doc = yaml.safe_load(text)
    else:
        raise ConfigError(f"{path}: unknown config format (use .yaml, .yml, .toml or .json)")
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return doc


# ----- flags ------------------------------------------------------------------------------------

FANOUT_FLAGS = {  # one flag that sets a field of every pool
    "--threads-per-worker": (
        "threads",
        "torch threads of every worker (default: the CPUs split among the workers of its phase)",
    ),
    "--kv-cache-mb": ("kv_cache_mb", "KV cache size of every worker (MB)"),
}


def flag_of(dotted: str) -> str:
    """The `pdserve serve` flag of a setting: its own, else --<section>-<name>."""
    f = _field_of(dotted)
    if f.metadata["flag"]:
        return str(f.metadata["flag"])
    return "--" + dotted.replace(".", "-").replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, grouped by section; every flag's default is "not given", so only the
    flags on the command line override the config file."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="deployment config (YAML or TOML; see examples/); flags override it",
    )
    parser.add_argument("--print-config", action="store_true", help="print the effective config (YAML) and exit")
    parser.add_argument(
        "--ray",
        dest="mode",
        action="store_const",
        const="ray",
        default=argparse.SUPPRESS,
        help="run the router and workers as Ray actors (mode: ray)",
    )
    top = parser.add_argument_group("deployment")
    _add_flag(top, "startup_timeout_s")
    groups = {name: parser.add_argument_group(GROUP_TITLES[name]) for name in SECTIONS}
    every = parser.add_argument_group("every worker pool (the per-pool flags below win)")
    for flag, (name, text) in FANOUT_FLAGS.items():
        every.add_argument(flag, dest=f"*.{name}", type=int, metavar="N", default=argparse.SUPPRESS, help=text)
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            _add_flag(groups[section], f"{section}.{f.name}")


def _add_flag(group: argparse._ArgumentGroup, dotted: str) -> None:
    """The `pdserve serve` flag of a setting: its default is "not given" (SUPPRESS), the real one is
    shown in the help; a setting that only some modes honour says so."""
    section, _, name = dotted.rpartition(".")
    f = _field_of(dotted)
    kwargs = flag_kwargs(SECTIONS[section] if section else DeploymentConfig, name, default=argparse.SUPPRESS)
    if f.metadata["modes"] != MODES:
        kwargs["help"] += f" [{'/'.join(f.metadata['modes'])} only]"
    group.add_argument(flag_of(dotted), dest=dotted, **kwargs)


def overrides_from_args(args: argparse.Namespace, mode: str = "local") -> dict[str, Any]:
    """{"dotted.name": value} of the flags given; the every-pool flags set each pool `mode` has
    (Ray: prefill and decode)."""
    top = {f.name for f in dataclasses.fields(DeploymentConfig) if f.name not in SECTIONS}
    given = {k: v for k, v in vars(args).items() if (k in top or "." in k) and v is not None or k.startswith("*.")}
    return every_pool(given, mode)


def every_pool(overrides: dict[str, Any], mode: str) -> dict[str, Any]:
    """`overrides` with each "*.name" key set on every pool `mode` has (Ray: prefill and decode, as
    it has no colocated pool); a per-pool key ("decode.threads") wins over its "*." key."""
    pools = POOLS if mode == "local" else ("prefill", "decode")
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if key.startswith("*."):
            out.update({f"{pool}.{key[2:]}": value for pool in pools})
    out.update({k: v for k, v in overrides.items() if not k.startswith("*.")})
    return out


def config_from_args(args: argparse.Namespace) -> DeploymentConfig:
    """The effective config of `pdserve serve`: the file of --config (if any), flags on top."""
    doc = load_file(args.config) if getattr(args, "config", None) else {}
    mode = getattr(args, "mode", None) or doc.get("mode") or "local"
    return DeploymentConfig.from_dict(doc, overrides_from_args(args, mode))


# ----- what each process receives -----------------------------------------------------------------


def _pool(config: DeploymentConfig, role: str) -> PoolSection:
    return getattr(config, role)  # type: ignore[no-any-return]


def worker_document(
    config: DeploymentConfig,
    role: str,
    worker_id: str,
    host: str = WORKER_HOST,
    threads: int | None = None,
    metrics_port: int = 0,
) -> dict[str, Any]:
    """The `python -m pdserve.prefill_worker|pdserve.decode_worker --config` document of one worker (role: prefill,
    decode or colocated). `threads`: the launcher's resolved thread count (else the pool's)."""
    pool = _pool(config, role)
    model, obs = config.model, config.observability
    doc: dict[str, Any] = {
        "host": host,
        "port": 0,
        "worker_id": worker_id,
        "model": model.path,
        "device": model.device,
        "dtype": model.dtype,
        "block_size": model.block_size,
        "compile": model.compile,
        "deterministic": model.deterministic,
        "kernel_table": model.kernel_table,
        "threads": threads or pool.threads,
        "kv_cache_mb": pool.kv_cache_mb,
        "max_batched_tokens": pool.max_batched_tokens,
        "prefix_caching": pool.prefix_caching,
        "request_timeout_s": pool.request_timeout_s,
        "kv_timeout_s": pool.kv_timeout_s,
        "drain_timeout_s": pool.drain_timeout_s,
        "internal_token_file": _local_only(config, config.security.internal_token_file),
        "grpc_calls_per_peer": config.security.internal_grpc_calls_per_peer,
        "grpc_calls_total": config.security.internal_grpc_calls_total,
        "log_level": obs.log_level,
        "log_format": obs.log_format,
        "metrics_port": metrics_port,
        "engine": model.engine,
        "profile": _abspath(model.profile),
        "speedup": model.speedup,
    }
    if role == "prefill":
        assert isinstance(pool, PrefillPool)
        doc.update(
            prefill_chunk_tokens=pool.chunk_tokens,
            kv_streaming=config.kv.streaming,
            shared_kv_cache=config.kv.shared_cache,
        )
        return doc
    assert isinstance(pool, ColocatedPool)
    backend = config.kv.backend
    if config.mode == "ray" and backend == "auto":
        backend = "grpc"
    doc.update(
        colocated=role == "colocated",
        max_num_seqs=pool.max_num_seqs,
        prefill_chunk_tokens=pool.chunk_tokens,
        admission_timeout_s=pool.admission_timeout_s,
        kv_backend=backend,
        kv_checksum=config.kv.checksum,
        kv_target=f"ray:{worker_id}" if backend == "ray" else "",
    )
    if isinstance(pool, DecodePool):
        doc["local_prefill_threshold"] = pool.local_prefill_threshold
    return doc


def router_document(config: DeploymentConfig, workers: dict[str, list[str]], metrics_port: int = 0) -> dict[str, Any]:
    """The `python -m pdserve.router --config` document: `workers` maps a role to its worker addresses."""
    router, sec, obs = config.router, config.security, config.observability
    return {
        "host": router.host,
        "port": router.port,
        "prefill": list(workers.get("prefill", [])),
        "decode": list(workers.get("decode", [])),
        "colocated": list(workers.get("colocated", [])),
        "prefill_policy": router.prefill_policy,
        "decode_policy": router.decode_policy,
        "max_stream_timeout": router.max_stream_timeout_s,
        "max_concurrent_streams": router.max_concurrent_streams,
        "max_queued_requests": router.max_queued_requests,
        "max_attempts": router.max_attempts,
        "router_drain_timeout": router.drain_timeout_s,
        "decode_mux": router.decode_mux,
        "kv_aware_request_tokens": router.kv_aware_request_tokens,
        "kv_aware_kv_tokens": router.kv_aware_kv_tokens,
        "conditional_disagg_tokens": router.conditional_disagg_tokens,
        "slo_ttft": router.slo_ttft_s,
        # KV-aware policies hash prompts with the served model's tokenizer
        "tokenizer": (config.model.path or "default")
        if {router.prefill_policy, router.decode_policy} & {"kv_aware", "kv_oracle"}
        else "",
        "grpc_calls_per_peer": router.grpc_calls_per_peer,
        "grpc_calls_total": router.grpc_calls_total,
        "grpc_connection_idle": router.grpc_connection_idle_s,
        "grpc_connection_age": router.grpc_connection_age_s,
        # only Ray restarts a dead worker (actor max_restarts); local workers that die stay dead
        "worker_restart_wait": config.ray.restart_wait_s if config.mode == "ray" and config.ray.max_restarts else 0.0,
        "http_port": router.http_port,
        "model_name": config.model.served_name,
        "metrics_port": metrics_port,
        "metrics_host": obs.metrics_host,
        "auth_token_file": _local_only(config, sec.auth_token_file),
        "auth_tokens_file": _local_only(config, sec.auth_tokens_file),
        "tls_cert": _abspath(sec.tls_cert),
        "tls_key": _abspath(sec.tls_key),
        "internal_token_file": _local_only(config, sec.internal_token_file),
        "log_level": obs.log_level,
        "log_format": obs.log_format,
    }


def _local_only(config: DeploymentConfig, path: str | None) -> str | None:
    """A token file for a local process; with Ray None: the launcher reads the file on the driver and
    hands the actors the token itself (the file need not exist on other nodes)."""
    return _abspath(path) if config.mode == "local" else None


def _abspath(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


REFERENCE_BEGIN = "<!-- reference: generated by `python -m pdserve.cluster.deploy_config`; do not edit by hand -->"
REFERENCE_END = "<!-- end of reference -->"


def reference_markdown() -> str:
    """The settings table of docs/configuration.md: key, flag, default, modes and help of every setting."""
    rows = ["| key | flag | default | modes | what it sets |", "|---|---|---|---|---|"]
    for dotted in field_names():
        f = _field_of(dotted)
        modes = "/".join(f.metadata["modes"]) if f.metadata["modes"] != MODES else "all"
        choices = f" (one of {', '.join(repr(c) for c in f.metadata['choices'])})" if f.metadata["choices"] else ""
        text = (f.metadata["help"] + choices).replace("|", "\\|")
        rows.append(f"| `{dotted}` | `{flag_of(dotted)}` | `{_default_of(f)!r}` | {modes} | {text} |")
    return "\n".join([REFERENCE_BEGIN, *rows, REFERENCE_END])


if __name__ == "__main__":
    print(reference_markdown())
