"""One process's configuration as a JSON document: how the launchers hand settings to a router or
worker process (`python -m pdserve.router|pdserve.prefill_worker|pdserve.decode_worker --config FILE`,
or the Ray actors, which pass the document itself).

The document's keys are the process's own option names (argparse ``dest``: ``kv_cache_mb``,
``prefill_policy``, ...), so the standalone command lines and the launched processes share one
parser. A document is validated on arrival against that parser: an unknown key, a value of the
wrong type, or one outside the option's choices fails naming the key, before anything starts.
Flags given on the command line as well override the document.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_HELP = (
    "JSON document of this process's options (keys: the option names with underscores, e.g. "
    "kv_cache_mb); flags given as well override it. The launchers (`pdserve serve`) use this"
)


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "config") and a.option_strings}


def _check_value(action: argparse.Action, key: str, value: Any) -> Any:  # noqa: ANN401 - any JSON value
    """`value` for option `action` (ValueError naming `key` when it cannot be)."""
    if value is None and action.default is None:
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{key}: expected a list of strings, got {value!r}")
        return list(value)
    kind = action.type
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        value = float(value)
    else:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        if callable(kind):
            value = kind(value)
    if action.choices is not None and value not in action.choices and not (value == "" and action.default == ""):
        raise ValueError(f"{key}: must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def namespace_from_document(parser: argparse.ArgumentParser, document: dict[str, Any]) -> argparse.Namespace:
    """The options in `document`, validated against `parser` (ValueError naming the key)."""
    if not isinstance(document, dict):
        raise ValueError(f"a process config must be a JSON object, got {type(document).__name__}")
    actions = _actions(parser)
    values: dict[str, Any] = {}
    for key, value in document.items():
        if key not in actions:
            raise ValueError(f"unknown key {key!r} (known: {', '.join(sorted(actions))})")
        try:
            values[key] = _check_value(actions[key], key, value)
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc) if str(exc).startswith(key) else f"{key}: {exc}") from None
    return argparse.Namespace(**values)


def parse_with_document(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, document: dict[str, Any] | None = None
) -> argparse.Namespace:
    """Parse `argv` on top of a process document: `document` when given (the Ray actors), else the
    JSON file of ``--config``; defaults < document < command-line flags. Exits with status 2 and the
    key named on a bad document, as argparse does for a bad flag."""
    args = parser.parse_args(argv)
    if document is None and getattr(args, "config", None):
        try:
            document = json.loads(Path(args.config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            parser.error(f"--config {args.config}: {exc}")
    if document is None:
        return args
    try:
        base = namespace_from_document(parser, document)
    except ValueError as exc:
        parser.error(f"--config: {exc}")
    return parser.parse_args(argv, namespace=base)


def write_document(path: Path, document: dict[str, Any]) -> Path:
    """Write `document` as the JSON file a process takes with ``--config`` (owner-readable only)."""
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    path.chmod(0o600)
    return path
