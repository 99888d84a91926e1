"""Library launches (tests, benchmarks, the capacity sweep): `local_deployment` and `ray_deployment`
build the one typed `DeploymentConfig` from short keyword names, and `LaunchOptions` holds the little a
library launch adds that is not a deployment setting.

Why short names: a test starts a cluster in one line (``LocalCluster(local_deployment(prefill=1,
decode=2, threads_per_worker=1))``). Each name stands for one dotted setting (`SETTINGS`), so a
setting is still validated in one place (`DeploymentConfig`, a ConfigError naming the dotted key) and
has one default (`pdserve.settings`); the library departs from a default only where
`LIBRARY_CHOICES` says so, and a test checks that it departs nowhere else.

Pure Python (no ray import): `ray_deployment` works where Ray is not installed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.deploy_config import ConfigError, DeploymentConfig, every_pool
from pdserve.settings import RaySection

#: short keyword name -> the dotted setting it stands for ("*.name": that field of every pool of the
#: mode, as `pdserve serve --threads-per-worker` does; None there leaves each pool's own default)
SETTINGS: dict[str, str] = {
    "model": "model.path",
    "model_name": "model.name",
    "device": "model.device",
    "dtype": "model.dtype",
    "deterministic": "model.deterministic",
    "kernel_table": "model.kernel_table",
    "prefill": "prefill.count",
    "decode": "decode.count",
    "colocated": "colocated.count",
    "threads_per_worker": "*.threads",
    "kv_cache_mb": "*.kv_cache_mb",
    "drain_timeout_s": "*.drain_timeout_s",
    "local_prefill_threshold": "decode.local_prefill_threshold",
    "host": "router.host",
    "port": "router.port",
    "http_port": "router.http_port",
    "prefill_policy": "router.prefill_policy",
    "decode_policy": "router.decode_policy",
    "max_queued_requests": "router.max_queued_requests",
    "kv_backend": "kv.backend",
    "auth_token_file": "security.auth_token_file",
    "tls_cert_file": "security.tls_cert",
    "tls_key_file": "security.tls_key",
    "log_dir": "observability.log_dir",
    "log_level": "observability.log_level",
    "log_format": "observability.log_format",
    "metrics": "observability.metrics",
    "metrics_host": "observability.metrics_host",
    "elastic": "elastic.enabled",
    "startup_timeout_s": "startup_timeout_s",
    **{f.name: f"ray.{f.name}" for f in dataclasses.fields(RaySection)},
}

#: where a library launch departs from the settings' defaults (tests/test_settings.py holds the why)
LIBRARY_CHOICES: dict[str, dict[str, Any]] = {
    "local": {"router.port": 0, "model.device": "cpu", "startup_timeout_s": 180.0},
    "ray": {"model.device": "cpu", "kv.backend": "grpc", "*.drain_timeout_s": 60.0, "model.name": "default"},
}


def local_deployment(prefill: int = 1, decode: int = 1, **settings: Any) -> DeploymentConfig:  # noqa: ANN401
    """A mode-local DeploymentConfig: the library's choices, then `settings` by short name (`SETTINGS`).
    ConfigError names the dotted setting of a bad value, or the unknown name."""
    return _deployment("local", {"prefill": prefill, "decode": decode, **settings})


def ray_deployment(prefill: int = 1, decode: int = 1, **settings: Any) -> DeploymentConfig:  # noqa: ANN401
    """`local_deployment` for mode ray (its pools: prefill and decode)."""
    return _deployment("ray", {"prefill": prefill, "decode": decode, **settings})


def _deployment(mode: str, settings: dict[str, Any]) -> DeploymentConfig:
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError(
            f"{unknown[0]}: unknown setting name (known: {', '.join(sorted(SETTINGS))}; "
            "extra process flags go in LaunchOptions)"
        )
    overrides = {
        SETTINGS[name]: value
        for name, value in settings.items()
        if value is not None or not SETTINGS[name].startswith("*.")
    }
    return DeploymentConfig.from_dict({"mode": mode}, every_pool({**LIBRARY_CHOICES[mode], **overrides}, mode))


@dataclass(frozen=True)
class LaunchOptions:
    """Extra command-line flags per process kind, appended after the process's ``--config FILE`` so
    they override its document. Not deployment settings, on purpose: they are raw flags for
    experiments and for tests' fault injection (a flag on one pool only, such as ``--kv-timeout-s``
    on the decode workers, or a flag no setting maps), which a deployment file must not be able to
    smuggle past validation. `decode_args` also go to colocated workers; `router_args` are local only
    (the Ray router actor takes no flags)."""

    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()

    def args_for(self, kind: str) -> tuple[str, ...]:
        """The extra flags of a process kind: prefill, decode, colocated or router."""
        return {
            "prefill": self.prefill_args,
            "decode": self.decode_args,
            "colocated": self.decode_args,
            "router": self.router_args,
        }[kind]
