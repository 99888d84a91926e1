"""The import rules of shared/GUIDE.md section 2 (and issue 30's new one), checked on the source.

Every first-party module (each folder a pdserve/ symlink puts into the ``pdserve`` package) is
parsed with ``ast``; every import in it counts, at module level or inside a function (a lazy import
is still an arrow), relative ones resolved. The rules:

1. ``prefill_worker`` and ``decode_worker`` never import each other.
2. Nothing imports ``router`` (outside the router itself).
3. Only ``cluster/`` and the Ray KV backend import ``ray``.
4. The router imports neither torch nor the engine (it stays torch-free; also checked by importing
   it in a fresh interpreter), and the engine imports none of the packages that use it.
5. The root package's shared runtime modules (``pdserve/*.py``) import no subpackage but the wire
   contract ``pdserve.v1``.
6. Nothing under ``proto/`` (the generated stubs) imports a module outside ``proto/``.
7. ``capacity`` sits above ``cluster`` (it starts clusters): ``cluster`` never imports ``capacity``,
   but for the CLI, where the two meet (the autoscaler gets its planner handed in).

Exceptions are listed in ALLOWED with the reason; an exception no longer needed fails the test, so
the list only shrinks.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: package -> its folder: pdserve/'s symlinks (pdserve/engine -> ../engine), the one list of them
PACKAGE_DIR: dict[str, str] = {
    "pdserve": "pdserve",
    **{
        f"pdserve.{link.name}": os.path.relpath(link.resolve(), REPO)
        for link in sorted((REPO / "pdserve").iterdir())
        if link.is_symlink()
    },
}
SUBPACKAGES = tuple(name for name in PACKAGE_DIR if name != "pdserve")  # pdserve.engine, pdserve.router, ...

#: (rule, importing module, imported module prefix) -> why it is allowed.
ALLOWED: dict[tuple[str, str, str], str] = {
    (
        "router-imported",
        "pdserve.cluster.ray_actors",
        "pdserve.router",
    ): "RouterActor is the router process under Ray: a launcher has to start the router it launches "
    "(the local launcher runs `python -m pdserve.router` instead, without importing it)",
    (
        "capacity-above-cluster",
        "pdserve.cluster.cli",
        "pdserve.capacity",
    ): "the `pdserve` CLI is the composition root: it registers the capacity subcommands (bench, sweep, "
    "plan) and hands the autoscaler its planner (capacity.splits). Nothing else in cluster imports capacity",
    (
        "router-torch-free",
        "pdserve.router.kv_index",
        "transformers",
    ): "opt-in only: with --tokenizer (KV-aware routing) the router loads the model's tokenizer through "
    "transformers, which imports torch into that router process. A router without --tokenizer never "
    "does (test_importing_the_router_loads_neither_torch_nor_the_engine). To remove: hash prompts "
    "with the `tokenizers` package alone (chat templates need a torch-free renderer too)",
}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _modules() -> dict[str, Path]:
    """Every first-party module's dotted name -> its file."""
    out: dict[str, Path] = {}
    for package, folder in PACKAGE_DIR.items():
        base = REPO / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if package == "pdserve" and parts and f"pdserve.{parts[0]}" in PACKAGE_DIR:
                continue  # a folder of its own elsewhere wins (none today)
            out[name] = path
    return out


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module or module.attribute, line) of every import statement in the file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            found += [(f"{module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _broken(importer: str, path: Path, module: str) -> list[str]:
    """The rules that `importer` importing `module` breaks."""
    rules = []
    top = module.split(".")[0]
    for side, other in (
        ("pdserve.prefill_worker", "pdserve.decode_worker"),
        ("pdserve.decode_worker", "pdserve.prefill_worker"),
    ):
        if _under(importer, side) and _under(module, other):
            rules.append("workers-apart")
    if _under(module, "pdserve.router") and not _under(importer, "pdserve.router"):
        rules.append("router-imported")
    if top == "ray" and not (_under(importer, "pdserve.cluster") or importer == "pdserve.kv_transfer.ray_backend"):
        rules.append("ray-outside-cluster")
    if _under(importer, "pdserve.router") and (top in ("torch", "transformers") or _under(module, "pdserve.engine")):
        rules.append("router-torch-free")
    if _under(importer, "pdserve.engine") and any(
        _under(module, f"pdserve.{user}")
        for user in ("prefill_worker", "decode_worker", "elastic_worker", "router", "cluster")
    ):
        rules.append("engine-below-workers")
    if _under(importer, "pdserve.cluster") and _under(module, "pdserve.capacity"):
        rules.append("capacity-above-cluster")
    if (
        path.is_relative_to(REPO / "pdserve")
        and module.startswith("pdserve.")
        and any(_under(module, sub) for sub in SUBPACKAGES if sub != "pdserve.v1")
    ):
        rules.append("shared-below-subpackages")
    if path.is_relative_to(REPO / "proto") and (top == "pdserve" and not _under(module, "pdserve.v1")):
        rules.append("proto-imports-only-proto")
    return rules


def _violations() -> dict[tuple[str, str, str], list[str]]:
    """(rule, importer, imported top-level package) -> where."""
    found: dict[tuple[str, str, str], list[str]] = {}
    for name, path in sorted(_modules().items()):
        for module, line in _imports(name, path):
            for rule in _broken(name, path, module):
                imported = next((sub for sub in SUBPACKAGES if _under(module, sub)), module.split(".")[0])
                where = f"{path.relative_to(REPO)}:{line} imports {module}"
                found.setdefault((rule, name, imported), []).append(where)
    return found


def test_the_scan_sees_the_packages() -> None:
    modules = _modules()
    for expected in (
        "pdserve.failures",
        "pdserve.router.core",
        "pdserve.decode_worker.servicer",
        "pdserve.prefill_worker.worker",
        "pdserve.engine.llm_engine",
        "pdserve.cluster.ray_actors",
        "pdserve.kv_transfer.ray_backend",
        "pdserve.v1.worker_pb2",
    ):
        assert expected in modules, expected
    # the scanner resolves relative imports and sees lazy ones
    tree_imports = {m for m, _ in _imports("pdserve.cluster.ray_actors", modules["pdserve.cluster.ray_actors"])}
    assert "pdserve.router.server" in tree_imports


def test_broken_rules_are_detected() -> None:
    """The checks themselves, on imports that would break each rule."""
    shared = REPO / "pdserve" / "x.py"
    stub = REPO / "proto" / "pdserve" / "v1" / "x_pb2.py"
    other = REPO / "engine" / "x.py"
    assert _broken("pdserve.prefill_worker.servicer", other, "pdserve.decode_worker.worker") == ["workers-apart"]
    assert _broken("pdserve.decode_worker.x", other, "pdserve.prefill_worker") == ["workers-apart"]
    assert _broken("pdserve.capacity.x", other, "pdserve.router.policies") == ["router-imported"]
    assert _broken("pdserve.engine.x", other, "ray.util") == ["ray-outside-cluster"]
    assert _broken("pdserve.cluster.x", other, "ray") == []
    assert _broken("pdserve.router.core", other, "torch") == ["router-torch-free"]
    assert _broken("pdserve.router.core", other, "pdserve.engine.sampling_params") == ["router-torch-free"]
    assert _broken("pdserve.engine.x", other, "pdserve.decode_worker") == ["engine-below-workers"]
    assert _broken("pdserve.cluster.autoscaler", other, "pdserve.capacity.planner") == ["capacity-above-cluster"]
    assert _broken("pdserve.capacity.splits", other, "pdserve.cluster.autoscaler") == []
    assert _broken("pdserve.transport", shared, "pdserve.telemetry.logs") == ["shared-below-subpackages"]
    assert _broken("pdserve.transport", shared, "pdserve.limits") == []
    assert _broken("pdserve.transport", shared, "pdserve.v1.worker_pb2") == []
    assert _broken("pdserve.v1.x_pb2", stub, "pdserve.v1.common_pb2") == []
    assert _broken("pdserve.v1.x_pb2", stub, "pdserve.transport") == ["proto-imports-only-proto"]


def test_import_rules_hold() -> None:
    found = _violations()
    unexpected = {key: where for key, where in found.items() if key not in ALLOWED}
    assert not unexpected, "import rules broken (shared/GUIDE.md section 2):\n" + "\n".join(
        f"  {rule}: {line}" for (rule, _, _), where in sorted(unexpected.items()) for line in where
    )
    stale = [key for key in ALLOWED if key not in found]
    assert not stale, f"allowed exceptions no longer needed (remove them): {stale}"


def test_importing_the_router_loads_neither_torch_nor_the_engine() -> None:
    code = (
        "import sys, pdserve.router.server, pdserve.router.__main__, pdserve.router.http_api\n"
        "bad = [m for m in ('torch', 'transformers', 'ray', 'pdserve.engine') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)


def test_a_worker_process_imports_transformers_modeling_only_to_load_a_model() -> None:
    """The worker process modules import neither transformers' modeling code nor the fast forward
    (which imports it): a sim-engine worker has no weights and never needs them, and they are about
    2 s of every worker's start-up. A real worker imports them when it loads its model."""
    code = (
        "import sys, pdserve.decode_worker.process, pdserve.prefill_worker.process, "
        "pdserve.elastic_worker.process\n"
        "bad = [m for m in ('transformers.modeling_utils', 'transformers.masking_utils', "
        "'pdserve.engine.fast_forward') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=120)
