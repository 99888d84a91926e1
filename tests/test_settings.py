"""Every deployment setting has exactly one default in the code: its field in `pdserve.settings`.

- The generator (`add_section_flags`) gives each setting's flag the field's default, type and choices.
- A process started by hand (`python -m pdserve.router|prefill_worker|decode_worker` without flags)
  gets the values the launchers would give it for a default deployment (`router_document`,
  `worker_document`), so no parser keeps defaults of its own.
- The parser modules write no literal ``default=`` for a flag a section owns (an ``ast`` scan of the
  source, so a hand-written copy of a default fails here even when its value still agrees).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.deploy_config import SECTIONS, DeploymentConfig, _leaves, router_document, worker_document
from pdserve.decode_worker.process import build_parser as decode_parser
from pdserve.prefill_worker.process import build_parser as prefill_parser
from pdserve.router.process import build_parser as router_parser
from pdserve.settings import (
    DecodePool,
    KvTransferSection,
    ModelSection,
    ObservabilitySection,
    PrefillPool,
    RouterSection,
    SecuritySection,
    add_section_flags,
    field_type,
    process_flag,
    section_default,
)
from pdserve.worker.config import WORKER_FLAGS

REPO = Path(__file__).resolve().parents[1]

#: The sections each process takes settings of, and the flags it spells otherwise.
PROCESSES: dict[str, tuple[tuple[type, ...], dict[str, str]]] = {
    "router": ((RouterSection, ModelSection, ObservabilitySection, SecuritySection), {}),
    "prefill": ((ModelSection, PrefillPool, KvTransferSection, SecuritySection, ObservabilitySection), WORKER_FLAGS),
    "decode": (
        (ModelSection, DecodePool, KvTransferSection, SecuritySection, ObservabilitySection),
        {**WORKER_FLAGS, "chunk_tokens": "--prefill-chunk-tokens"},
    ),
}
PARSERS = {"router": router_parser, "prefill": prefill_parser, "decode": decode_parser}
#: (process, flag) spelled like a setting that is not that setting, and why.
NOT_THE_SETTING = {
    ("router", "--model-name"): "the model id a router started by hand serves ('default'): it has no model "
    "folder to name; launchers pass model.served_name",
}
#: Parser modules and the processes whose parsers they build.
PARSER_MODULES = {
    "router/process.py": ("router",),
    "worker/config.py": ("prefill", "decode"),
    "prefill_worker/config.py": ("prefill",),
    "decode_worker/config.py": ("decode",),
    "elastic_worker/config.py": ("prefill", "decode"),
}
#: Keys of a launcher's document that only a launcher knows (so a hand-started process differs).
LAUNCHER_ONLY = {"router": {"model_name"}, "prefill": set(), "decode": set(), "colocated": {"worker_id", "colocated"}}


def owned_flags(process: str) -> dict[str, tuple[type, str]]:
    """flag -> (section, setting) of every setting `process` could take, as that process spells it."""
    sections, flags = PROCESSES[process]
    owned: dict[str, tuple[type, str]] = {}
    for section in sections:
        for f in dataclasses.fields(section):
            flag = process_flag(section, f.name, flags)
            if (process, flag) in NOT_THE_SETTING:
                continue
            assert flag not in owned, f"{process}: {flag} is both {owned[flag]} and {section.__name__}.{f.name}"
            owned[flag] = (section, f.name)
    return owned


@pytest.mark.parametrize("section", sorted(SECTIONS.values(), key=lambda s: s.__name__), ids=lambda s: s.__name__)
def test_every_generated_flag_defaults_to_its_field(section: type) -> None:
    for f in dataclasses.fields(section):
        parser = argparse.ArgumentParser()
        add_section_flags(parser, section, [f.name])
        (action,) = [a for a in parser._actions if a.option_strings and a.dest != "help"]
        assert action.option_strings[0] == process_flag(section, f.name)
        assert getattr(parser.parse_args([]), action.dest) == f.default, f.name
        assert action.choices == f.metadata["choices"] or (action.choices is None and f.metadata["choices"] is None), (
            f.name
        )
        base, _ = field_type(section, f.name)
        if base is bool:
            assert getattr(parser.parse_args([f"--no-{action.option_strings[0][2:]}"]), action.dest) is False
        elif base in (int, float):
            assert getattr(parser.parse_args([action.option_strings[0], "7"]), action.dest) == base(7)


def test_a_hand_started_process_gets_the_launchers_defaults() -> None:
    config = DeploymentConfig(colocated=dataclasses.replace(DeploymentConfig().colocated, count=1))
    documents = {"router": (router_document(config, {}), "router")}
    documents.update(
        {
            role: (worker_document(config, role, f"{role}-0"), "decode" if role == "colocated" else role)
            for role in ("prefill", "decode", "colocated")
        }
    )
    for role, (document, process) in documents.items():
        defaults = vars(PARSERS[process]().parse_args([]))
        differing = {
            key: (value, defaults.get(key, "<no flag>"))
            for key, value in document.items()
            if key not in LAUNCHER_ONLY[role] and defaults.get(key, "<no flag>") != value
        }
        assert not differing, f"{role}: (document, parser default) differ: {differing}"


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_every_setting_flag_of_a_process_defaults_to_its_field(process: str) -> None:
    owned = owned_flags(process)
    parser = PARSERS[process]()
    seen = 0
    for action in parser._actions:
        for flag in action.option_strings:
            if flag in owned:
                section, name = owned[flag]
                assert action.default == section_default(section, name), f"{process} {flag}"
                seen += 1
    assert seen >= 15, f"{process}: only {seen} setting flags found; the scan lost track of the parser"


def literal_defaults(source: str) -> list[tuple[str, int]]:
    """(flag, line) of every ``add_argument("--flag", ..., default=<literal>)`` call in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            continue
        for keyword in node.keywords:
            if keyword.arg == "default" and _is_literal(keyword.value):
                found.append((str(node.args[0].value), node.lineno))
    return found


def _is_literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except ValueError:
        return False
    return True


def test_the_scan_finds_a_literal_default() -> None:
    source = (
        'ap.add_argument("--kv-cache-mb", type=int, default=512)\n'
        'ap.add_argument("--kv-checksum", default=section_default(KvTransferSection, "checksum"))\n'
        'ap.add_argument("--prefill", action="append", default=[])\n'
    )
    assert literal_defaults(source) == [("--kv-cache-mb", 1), ("--prefill", 3)]


@pytest.mark.parametrize("module", sorted(PARSER_MODULES))
def test_no_parser_writes_a_default_a_section_owns(module: str) -> None:
    owned: dict[str, Any] = {}
    for process in PARSER_MODULES[module]:
        owned.update(owned_flags(process))
    copies = [
        f"{module}:{line} {flag}"
        for flag, line in literal_defaults((REPO / module).read_text(encoding="utf-8"))
        if flag in owned
    ]
    assert not copies, f"defaults written again beside their setting (use add_section_flags): {copies}"


#: Settings where the library launches (`cluster.launch`: tests, benchmarks) make a choice of their
#: own, and why.
LIBRARY_CHOICES = {
    "local": {
        "router.port": "0: a free port, so tests run side by side",
        "model.device": "cpu: tests and benchmarks run on the CPU",
        "startup_timeout_s": "180 s: a test fails sooner",
    },
    "ray": {
        "model.device": "cpu: Ray picks a GPU only when gpus_per_worker asks",
        "kv.backend": "grpc: the Ray tests' default transport",
        "prefill.drain_timeout_s": "60 s: actors restart slower than processes",
        "decode.drain_timeout_s": "60 s: actors restart slower than processes",
        "model.name": "'default': the Ray tests' model id",
    },
}


@pytest.mark.parametrize("mode", sorted(LIBRARY_CHOICES))
def test_the_library_deployments_default_to_the_settings(mode: str) -> None:
    from pdserve.cluster.launch import local_deployment, ray_deployment

    library = dict(_leaves((local_deployment if mode == "local" else ray_deployment)()))
    spec = dict(_leaves(DeploymentConfig(mode=mode)))
    differing = {key: (library[key], spec[key]) for key in spec if library[key] != spec[key]}
    assert set(differing) == set(LIBRARY_CHOICES[mode]), differing


def test_every_short_name_names_a_setting() -> None:
    """Each short name of `cluster.launch.SETTINGS` names a setting (a mistyped target fails here, not
    only in the test that happens to pass that name)."""
    from pdserve.cluster.launch import SETTINGS

    known = set(dict(_leaves(DeploymentConfig())))
    for name, dotted in SETTINGS.items():
        targets = (
            [f"{pool}.{dotted[2:]}" for pool in ("prefill", "decode", "colocated")] if dotted[:2] == "*." else [dotted]
        )
        assert set(targets) <= known, (name, targets)
