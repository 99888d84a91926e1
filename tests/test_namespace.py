"""The `pdserve` import namespace: no first-party module is imported or run under a bare top-level
name (`engine`, `router`, ...), the source checkout resolves `pdserve.*` to the repository's folders,
and every folder is in the package (a pdserve/ symlink) and in pyproject.toml's packages for the
wheel. (Written by the namespace rename script.)"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
#: Package -> its folder, read from the one list of them: pdserve/'s symlinks (pdserve/engine -> ../engine).
PACKAGE_DIR: dict[str, str] = {
    "pdserve": "pdserve",
    **{
        f"pdserve.{link.name}": os.path.relpath(link.resolve(), REPO)
        for link in sorted((REPO / "pdserve").iterdir())
        if link.is_symlink()
    },
}
FIRST_PARTY = {folder for name, folder in PACKAGE_DIR.items() if name.count(".") == 1 and name == f"pdserve.{folder}"}
SKIP = {
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
}
FP = "|".join(sorted(FIRST_PARTY))
DASH_M = re.compile(rf"-m\s+(?:{FP})(?![\w-])|[\"']-m[\"']\s*,\s*[\"'](?:{FP})(?:\.\w+)*[\"']")
# first-party import lines inside strings (code run with python -c)
IMPORT_LINE = re.compile(rf"^\s*(?:from\s+(?:{FP})(?:\.[\w.]+)?\s+import\b|import\s+(?:{FP})\b)", re.M)


def _files(*suffixes: str) -> list[Path]:
    out = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO).parts
        if any(part in SKIP or part.endswith(".egg-info") for part in rel) or not path.is_file():
            continue
        if path.suffix in suffixes or path.name in suffixes:
            out.append(path)
    return out


def test_no_bare_first_party_imports() -> None:
    offenders = []
    for path in _files(".py"):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source, str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FIRST_PARTY
            ]
        for match in IMPORT_LINE.finditer(source):  # also code in strings (python -c)
            line = source.count("\n", 0, match.start()) + 1
            offenders.append(f"{path.relative_to(REPO)}:{line}: {match.group(0).strip()}")
    assert not sorted(set(offenders)), "bare first-party imports (use pdserve.*):\n" + "\n".join(sorted(set(offenders)))


def test_no_bare_module_invocations() -> None:
    offenders = []
    for path in _files(".py", ".md", ".sh", ".yaml", ".yml", ".txt", "run"):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if DASH_M.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "run first-party modules as python -m pdserve.X:\n" + "\n".join(offenders)
    bare = "router"  # built here, so that this file passes its own scan
    assert DASH_M.search(f"python -m {bare} --port 0") and DASH_M.search(f'[sys.executable, "-m", "{bare}.cli"]')
    assert not DASH_M.search("python -m pdserve.router") and not DASH_M.search("python -m pip")


def test_source_checkout_resolves_the_namespace() -> None:
    code = (
        "import pdserve.engine, pdserve.router.server, pdserve.cluster.cli, pdserve.v1, sys\n"
        "from pathlib import Path\n"
        "engine = Path(pdserve.engine.__file__).resolve().parent\n"
        "assert engine == Path(sys.argv[1]) / 'engine', pdserve.engine.__file__\n"
        "bare = sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[2].split(','))\n"
        "assert not bare, bare\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # only the repository root: pdserve/'s symlinks reach the rest
    result = subprocess.run(
        [sys.executable, "-c", code, str(REPO), ",".join(FIRST_PARTY)],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_pyproject_maps_every_folder() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    top_level = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert top_level == FIRST_PARTY | {"pdserve"}, "a top-level package folder has no pdserve/ symlink"
    assert len(FIRST_PARTY) >= 9, FIRST_PARTY
    assert PACKAGE_DIR == {
        "pdserve": "pdserve",
        "pdserve.v1": "proto/pdserve/v1",
        **{f"pdserve.{n}": n for n in FIRST_PARTY},
    }
    links = [link for link in (REPO / "pdserve").iterdir() if link.is_symlink()]
    assert all(not os.path.isabs(os.readlink(link)) for link in links), "a symlink must be relative (clones move)"
    assert "package-dir" not in setuptools  # the symlinks are the map: a second one would be followed by nothing
    packages = set(setuptools["packages"])
    assert {"pdserve", "pdserve.v1", *(f"pdserve.{n}" for n in FIRST_PARTY)} <= packages
    assert all(p == "pdserve" or p.startswith("pdserve.") for p in packages)
    for folder in FIRST_PARTY:  # every subpackage with an __init__.py is listed
        for init in (REPO / folder).rglob("__init__.py"):
            dotted = ".".join(("pdserve", *init.parent.relative_to(REPO).parts))
            assert dotted in packages, dotted
