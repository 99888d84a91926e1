"""Packaging: the optional extras (pdserve[ray], pdserve[capacity]) are imported only where needed and
fail with an error naming the extra; the dependency floors match what the code and the committed stubs
need; constraints.txt pins a version of every dependency that satisfies pyproject.toml."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
STUBS = REPO / "proto" / "pdserve" / "v1"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
OPTIONAL = ("ray", "matplotlib", "rich")

# Run with ray, matplotlib and rich unimportable, as after `pip install pdserve` without extras.
BLOCKED = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # import fails, importlib.util.find_spec says "not installed"
"""


def _run_without_extras(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED + textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=REPO
    )


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = PYPROJECT["project"]
    return [
        Requirement(r) for r in (project["dependencies"] if extra is None else project["optional-dependencies"][extra])
    ]


def _floor(name: str) -> Version:
    req = next(r for r in _requirements() if canonicalize_name(r.name) == name)
    floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert floors, f"{name} has no >= floor"
    return max(floors)


def test_core_imports_need_no_extra() -> None:
    result = _run_without_extras("""
        import importlib, sys
        for name in ("pdserve.capacity.bench", "pdserve.capacity.cli", "pdserve.capacity.plots",
                     "pdserve.capacity.sweep",
                     "pdserve.cluster.cli", "pdserve.cluster.local", "pdserve.cluster.ray_actors",
                     "pdserve.decode_worker.worker", "pdserve.engine.llm_engine", "pdserve.kv_transfer.grpc_backend",
                     "pdserve.prefill_worker.worker", "pdserve.router.http_api", "pdserve.router.server",
                     "pdserve.telemetry.prometheus"):
            importlib.import_module(name)
        optional = ("ray", "matplotlib", "rich")
        loaded = sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in optional)
        assert not loaded, loaded
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_missing_extra_errors_name_the_extra(tmp_path: Path) -> None:
    result = _run_without_extras(f"""
        import contextlib, io, json
        from pdserve.extras import MissingExtra
        for module in ("pdserve.cluster.ray_cluster", "pdserve.kv_transfer.ray_backend",
                       "pdserve.cluster.ray_kv_bench"):
            try:
                __import__(module)
            except MissingExtra as exc:
                assert "pip install 'pdserve[ray]'" in str(exc) and "ray[default]" in str(exc), exc
            else:
                raise AssertionError(module + " imported without ray")
        from pdserve import kv_transfer
        try:
            kv_transfer.get_backend("ray").sender_factory("127.0.0.1:1")
        except MissingExtra as exc:
            assert "pdserve[ray]" in str(exc)
        else:
            raise AssertionError("the ray KV backend started without ray")
        from pdserve.capacity.plots import write_plots
        try:
            write_plots(None, {{"points": []}})
        except MissingExtra as exc:
            assert "matplotlib" in str(exc) and "pip install 'pdserve[capacity]'" in str(exc), exc
        else:
            raise AssertionError("plots without matplotlib")
        from pdserve.cluster.cli import main
        results = {{}}
        for argv in (["scale", "--prefill", "1", "--decode", "1"], ["bench", "--url", "127.0.0.1:1"],
                     ["sweep", "--rates", "1", "--output-dir", {str(tmp_path)!r}],
                     ["status", "--address", "127.0.0.1:1"]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(argv)
            results[argv[0]] = (code, err.getvalue())
        print(json.dumps(results))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    results = json.loads(result.stdout.strip().splitlines()[-1])
    for command, extra in (("scale", "ray"), ("bench", "capacity"), ("sweep", "capacity"), ("status", "ray")):
        code, err = results[command]
        assert code != 0 and f"pip install 'pdserve[{extra}]'" in err, (command, code, err)


def test_optional_packages_are_extras_not_dependencies() -> None:
    core = {canonicalize_name(r.name) for r in _requirements()}
    assert not core & {"ray", "matplotlib", "rich"}
    assert [(r.name, r.extras) for r in _requirements("ray")] == [("ray", {"default"})]
    assert {r.name for r in _requirements("capacity")} == {"matplotlib", "rich"}
    dev = {canonicalize_name(r.name): r for r in _requirements("dev")}
    assert dev["pdserve"].extras == {"ray", "capacity"}  # the test suite needs both


def test_no_module_level_import_of_optional_packages() -> None:
    """Outside the guarded Ray modules, ray/matplotlib/rich are imported inside functions only."""
    guarded = {"cluster/ray_cluster.py", "kv_transfer/ray_backend.py", "cluster/ray_kv_bench.py"}
    pattern = re.compile(r"^(?:import|from)\s+(ray|matplotlib|rich)\b", re.M)
    offenders = []
    links = [link for link in (REPO / "pdserve").iterdir() if link.is_symlink()]  # every first-party folder
    for folder in ["pdserve", *(os.path.relpath(link.resolve(), REPO) for link in links)]:
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if rel not in guarded and pattern.search(path.read_text(encoding="utf-8")):
                offenders.append(rel)
    assert not offenders


def test_torch_floor_has_enable_gqa() -> None:
    assert _floor("torch") >= Version("2.5")  # scaled_dot_product_attention(enable_gqa=...) is new in 2.5
    import inspect

    import torch.nn.functional as F

    assert "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "") or "enable_gqa" in str(
        inspect.signature(F.scaled_dot_product_attention)
    )


def test_grpc_and_protobuf_floors_match_the_committed_stubs() -> None:
    protobuf_versions = {
        re.search(r"^# Protobuf Python Version: (\S+)$", p.read_text(), re.M).group(1)  # type: ignore[union-attr]
        for p in STUBS.glob("*_pb2.py")
    }
    grpc_versions = {
        re.search(r"^GRPC_GENERATED_VERSION = '(\S+)'$", p.read_text(), re.M).group(1)  # type: ignore[union-attr]
        for p in STUBS.glob("*_pb2_grpc.py")
    }
    assert len(protobuf_versions) == 1 and len(grpc_versions) == 1
    gencode, generated = Version(protobuf_versions.pop()), Version(grpc_versions.pop())
    # the stubs refuse an older runtime at import: the floors must be exactly what generated them
    assert _floor("protobuf") == gencode
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert _floor(name) == generated, name
    dev_tools = next(r for r in _requirements("dev") if r.name == "grpcio-tools")
    assert generated in dev_tools.specifier
    import google.protobuf
    import grpc

    assert Version(google.protobuf.__version__) >= gencode and Version(grpc.__version__) >= generated


def test_constraints_pin_every_dependency_within_pyproject() -> None:
    pins: dict[str, Version] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = Version(spec.version)
    assert "torch" not in pins and "pdserve" not in pins  # ./run installs torch's build itself
    project = PYPROJECT["project"]
    for extra in (None, "ray", "capacity", "dev", *project["optional-dependencies"]):
        for req in _requirements(extra):
            name = canonicalize_name(req.name)
            if name in ("torch", "pdserve") or (req.marker and not req.marker.evaluate()):
                continue
            assert name in pins, f"constraints.txt has no pin for {req}"
            assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} violates {req}"
    assert pins[canonicalize_name("grpcio-tools")] == Version(
        re.search(r"^GRPC_GENERATED_VERSION = '(\S+)'$", (STUBS / "router_pb2_grpc.py").read_text(), re.M).group(1)
    )  # type: ignore[union-attr]


def test_run_installs_extras_with_constraints_and_keeps_committed_stubs() -> None:
    run = (REPO / "run").read_text()
    assert '-e ".[dev,ray,capacity]"' in run and "--constraint" in run and "constraints.txt" in run
    ensure_stubs = run[run.index("ensure_stubs() {") :]
    ensure_stubs = ensure_stubs[: ensure_stubs.index("\n}\n")]
    assert "missing" in ensure_stubs  # generates only when a stub is missing, never over committed ones
