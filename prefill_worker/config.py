"""`PrefillWorkerConfig`, the typed config of a prefill worker process, and its command line
(`python -m pdserve.prefill_worker`): `parse_args` reads flags (over a process document), and
`PrefillWorkerConfig.from_args` turns them into the config `process.start_worker` takes.

Pure Python (no torch): a launcher builds this config without loading the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.process_config import add_config_arg, parse_with_document
from pdserve.settings import KvTransferSection, PrefillPool, SectionFlags, opt
from pdserve.worker.config import POOL_SETTINGS, WORKER_ID_HELP, WorkerConfig


@dataclass(frozen=True)
class PrefillWorkerConfig(WorkerConfig):
    """A prefill worker: the common worker part, its pool (with the prompt chunk size) and how its KV
    leaves (`kv.streaming`, `kv.shared_cache`)."""

    worker_id: str = opt("prefill-0", WORKER_ID_HELP)
    pool: PrefillPool = field(default_factory=PrefillPool)
    kv: KvTransferSection = field(default_factory=KvTransferSection)

    SECTION_FLAGS: ClassVar[Mapping[str, SectionFlags]] = {
        **WorkerConfig.SECTION_FLAGS,
        "pool": SectionFlags(PrefillPool, (*POOL_SETTINGS, "chunk_tokens")),
        "kv": SectionFlags(KvTransferSection, ("streaming", "shared_cache")),
    }


def build_parser() -> argparse.ArgumentParser:
    """This worker's command-line flags (also read by `elastic_worker`, which takes both roles' flags)."""
    ap = argparse.ArgumentParser(
        prog="python -m pdserve.prefill_worker",
        description="One prefill worker process serving gRPC on loopback by default.",
    )
    PrefillWorkerConfig.add_flags(ap)
    add_config_arg(ap)
    return ap


def parse_args(argv: list[str] | None = None, document: dict[str, Any] | None = None) -> argparse.Namespace:
    """This worker's options: defaults < `document` (or the JSON file of --config) < flags."""
    return parse_with_document(build_parser(), argv, document)
