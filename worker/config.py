"""The typed config of a worker process: what `start_worker` of every role takes, frozen.

`WorkerConfig` is the part every role shares: the launcher's address and identity (host, port,
worker id, metrics port) and the deployment's setting sections as they are (`ModelSection`, the
role's pool, `SecuritySection`, `ObservabilitySection`), so each field's type and default live once,
in `pdserve.settings`. A role's config (`PrefillWorkerConfig`, `DecodeWorkerConfig`, the elastic
worker's pair of them) adds its own sections and fields.

The command line comes from the same declaration: `add_flags` generates the flags of `OWN_FLAGS`
and of each `SECTION_FLAGS` entry, and `from_args` is the one way back from parsed flags to the
config. Settings of a section a role has no flag for keep their defaults and are not read.

Pure Python (no torch, no grpc): a launcher (the Ray controller) builds configs without loading
the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pdserve.constants import LOOPBACK
from pdserve.settings import (
    ENGINE_SETTINGS,
    ModelSection,
    ObservabilitySection,
    PoolSection,
    SectionFlags,
    SecuritySection,
    add_section_flags,
    opt,
)

#: The settings of a worker's own pool that every role takes (every PoolSection field but the pool size).
POOL_SETTINGS = tuple(f.name for f in dataclasses.fields(PoolSection) if f.name != "count")
#: Settings a worker's command line spells otherwise than `pdserve serve` (security.internal_grpc_calls_*
#: are the limits of the worker's own, internal, port).
WORKER_FLAGS = {
    "internal_grpc_calls_per_peer": "--grpc-calls-per-peer",
    "internal_grpc_calls_total": "--grpc-calls-total",
}
#: The model settings a worker takes (every ModelSection field but the HTTP API's model id).
MODEL_SETTINGS = ("path", "block_size", "device", "dtype", "compile", "deterministic", "kernel_table", *ENGINE_SETTINGS)
WORKER_ID_HELP = "this worker's name (logs, WorkerInfo, the READY line)"

C = TypeVar("C", bound="WorkerConfig")


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker role takes. `pool` is the role's pool section (PrefillPool or DecodePool:
    their defaults differ)."""

    host: str = opt(LOOPBACK, "bind address (loopback unless told otherwise)")
    port: int = opt(0, "0 picks a free port", min=0, max=65535)
    worker_id: str = opt("worker-0", WORKER_ID_HELP)
    metrics_port: int = opt(
        0,
        "serve Prometheus /metrics on this loopback port (0: off; -1: any free port, announced in the ready line)",
        min=-1,
        max=65535,
    )
    model: ModelSection = field(default_factory=ModelSection)
    pool: PoolSection = field(default_factory=PoolSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    observability: ObservabilitySection = field(default_factory=ObservabilitySection)

    #: This config's own fields that are flags (the launcher's address and identity).
    OWN_FLAGS: ClassVar[tuple[str, ...]] = ("host", "port", "worker_id", "metrics_port")
    #: Section field -> the settings of that section this role takes as flags.
    SECTION_FLAGS: ClassVar[Mapping[str, SectionFlags]] = {
        "model": SectionFlags(ModelSection, MODEL_SETTINGS),
        "pool": SectionFlags(PoolSection, POOL_SETTINGS),
        "security": SectionFlags(SecuritySection, ("internal_token_file", *WORKER_FLAGS), WORKER_FLAGS),
        "observability": SectionFlags(ObservabilitySection, ("log_level", "log_format")),
    }

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """This role's flags, generated from its fields and sections (defaults: theirs)."""
        add_section_flags(parser, cls, cls.OWN_FLAGS)
        for flags in cls.SECTION_FLAGS.values():
            flags.add_to(parser)

    @classmethod
    def from_args(cls: type[C], args: argparse.Namespace) -> C:
        """The config of parsed flags (the role's `parse_args`): the one way from a command line or a
        process document to the typed config."""
        values: dict[str, Any] = {name: getattr(args, name) for name in cls.OWN_FLAGS}
        values.update({name: flags.section_of(args) for name, flags in cls.SECTION_FLAGS.items()})
        return cls(**values)
