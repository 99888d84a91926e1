"""`ElasticWorkerConfig`, the typed config of an elastic worker process (`python -m
pdserve.elastic_worker`): the role it starts in and each role's config, and its command line
(`parse_args`: both roles' flags, over a {"prefill": ..., "decode": ...} document), turned into the
config by `ElasticWorkerConfig.from_args`.

Pure Python (no torch): a launcher builds this config without loading the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.config import build_parser as decode_parser
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.config import build_parser as prefill_parser
from pdserve.process_config import namespace_from_document

PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"
ROLES = (PREFILL, DECODE, COLOCATED)

DESCRIPTION = """A worker process that can change role at runtime (RoleControl.SetRole; `pdserve role`),
with its model loaded once. Takes the flags of both `python -m pdserve.prefill_worker` and `python -m
pdserve.decode_worker` (each role reads its own; shared ones such as --model, --kv-cache-mb and
--block-size are one value for both), or --config FILE: {"prefill": <prefill document>, "decode":
<decode document>} as `pdserve serve --elastic` writes it (flags given as well override it)."""


@dataclass(frozen=True)
class ElasticWorkerConfig:
    """The role to start in and each role's config. What both roles share (model, address, KV
    memory, engine, credentials, logs) is read from `decode`, whose pool sizes the one KV cache."""

    role: str
    prefill: PrefillWorkerConfig
    decode: DecodeWorkerConfig

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")

    @classmethod
    def from_args(
        cls, role: str, prefill_args: argparse.Namespace, decode_args: argparse.Namespace
    ) -> ElasticWorkerConfig:
        """The config of `parse_args`'s result (role, prefill flags, decode flags)."""
        return cls(role, PrefillWorkerConfig.from_args(prefill_args), DecodeWorkerConfig.from_args(decode_args))


def parse_args(
    argv: list[str] | None = None,
    document: dict[str, Any] | None = None,
) -> tuple[str, argparse.Namespace, argparse.Namespace]:
    """(role, prefill flags, decode flags); exits with status 2 on a flag neither role knows.

    `document` (or the JSON file of ``--config``): {"prefill": {...}, "decode": {...}}, each role's
    process document (`deploy_config.worker_document`), validated by that role's parser; flags on
    the command line override both."""
    argv = list(sys.argv[1:] if argv is None else argv)
    role_parser = argparse.ArgumentParser(
        prog="python -m pdserve.elastic_worker", description=DESCRIPTION, add_help=False
    )
    role_parser.add_argument("--role", choices=ROLES, required=True, help="the role to start in")
    role_parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help='JSON {"prefill": {...}, "decode": {...}}: each role\'s process document',
    )
    role_args, rest = role_parser.parse_known_args(argv)
    if document is None and role_args.config:
        try:
            document = json.loads(Path(role_args.config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            role_parser.error(f"--config {role_args.config}: {exc}")
    parsers = {"prefill": prefill_parser(), "decode": decode_parser()}
    bases: dict[str, argparse.Namespace | None] = {"prefill": None, "decode": None}
    if document is not None:
        if not isinstance(document, dict) or set(document) != set(parsers):
            role_parser.error('--config: expected {"prefill": {...}, "decode": {...}}')
        for kind, parser in parsers.items():
            try:
                bases[kind] = namespace_from_document(parser, document[kind])
            except ValueError as exc:
                role_parser.error(f"--config: {kind}: {exc}")
    for parser in parsers.values():
        parser.allow_abbrev = False
    (prefill_args, prefill_rest), (decode_args, decode_rest) = (
        parser.parse_known_args(rest, namespace=bases[kind]) for kind, parser in parsers.items()
    )
    unknown = [a for a in prefill_rest if a in decode_rest]
    if unknown:
        role_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return role_args.role, prefill_args, decode_args
