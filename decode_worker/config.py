"""`DecodeWorkerConfig`, the typed config of a decode (or colocated) worker process, and its command
line (`python -m pdserve.decode_worker`): `parse_args` reads flags (over a process document), and
`DecodeWorkerConfig.from_args` turns them into the config `process.start_worker` takes.

Pure Python (no torch): a launcher builds this config without loading the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.constants import KV_CHECKSUMS
from pdserve.process_config import add_config_arg, parse_with_document
from pdserve.settings import DecodePool, KvTransferSection, SectionFlags, opt, section_default
from pdserve.worker.config import POOL_SETTINGS, WORKER_ID_HELP, WorkerConfig

#: The decode (and colocated) pool's own settings, beyond those every worker has.
DECODE_SETTINGS = ("local_prefill_threshold", "max_num_seqs", "chunk_tokens", "admission_timeout_s")


@dataclass(frozen=True)
class DecodeWorkerConfig(WorkerConfig):
    """A decode worker (`colocated`: it prefills every request itself): the common worker part, its
    pool and how KV arrives (`kv.backend`, `kv.checksum`, `kv_target`)."""

    worker_id: str = opt("decode-0", WORKER_ID_HELP)
    colocated: bool = opt(False, "prefill every request here (classic server)")
    kv_target: str = opt(
        "", "where prefill workers send KV (default: this worker's gRPC address; ray:<actor name> for the ray backend)"
    )
    pool: DecodePool = field(default_factory=DecodePool)
    kv: KvTransferSection = field(default_factory=KvTransferSection)

    OWN_FLAGS: ClassVar[tuple[str, ...]] = (*WorkerConfig.OWN_FLAGS, "colocated", "kv_target")
    SECTION_FLAGS: ClassVar[Mapping[str, SectionFlags]] = {
        **WorkerConfig.SECTION_FLAGS,
        "pool": SectionFlags(
            DecodePool, (*POOL_SETTINGS, *DECODE_SETTINGS), {"chunk_tokens": "--prefill-chunk-tokens"}
        ),
        "kv": SectionFlags(KvTransferSection, ("backend", "checksum"), by_hand=("checksum",)),
    }

    @property
    def role(self) -> str:
        return "colocated" if self.colocated else "decode"


def build_parser() -> argparse.ArgumentParser:
    """This worker's command-line flags (also read by `elastic_worker`, which takes both roles' flags)."""
    ap = argparse.ArgumentParser(
        prog="python -m pdserve.decode_worker",
        description="One decode (or colocated) worker process; gRPC on loopback by "
        "default. Serves DecodeWorker, KvTransfer (the gRPC KV backend's "
        "receiver) and health on one port.",
    )
    DecodeWorkerConfig.add_flags(ap)
    ap.add_argument(
        "--kv-checksum",
        nargs="?",
        const="xxh3",
        default=section_default(KvTransferSection, "checksum"),
        choices=tuple(name for name in KV_CHECKSUMS if name),
        help="shm backend: prefill workers send a checksum of the blocks (xxh3 when no algorithm is "
        "named), checked here over the copied bytes; the gRPC stream always checksums every "
        "frame (see docs/security.md for the cost)",
    )
    add_config_arg(ap)
    return ap


def parse_args(argv: list[str] | None = None, document: dict[str, Any] | None = None) -> argparse.Namespace:
    """This worker's options: defaults < `document` (or the JSON file of --config) < flags."""
    return parse_with_document(build_parser(), argv, document)
