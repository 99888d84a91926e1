"""The `pdserve` command line (placeholder: `pdserve model fetch`; more subcommands follow)."""

from __future__ import annotations

import argparse
import sys


def _cmd_model_fetch(args: argparse.Namespace) -> int:
    from engine.model_fetch import fetch_default_model

    path = fetch_default_model(force=args.force, progress=lambda s: print(s, file=sys.stderr))
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("model", help="manage the default model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    fetch = model_commands.add_parser("fetch", help="fetch and convert SmolLM2-135M-Instruct (cached)")
    fetch.add_argument("--force", action="store_true", help="re-download and re-convert")
    fetch.set_defaults(func=_cmd_model_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
