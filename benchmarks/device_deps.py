"""What pdserve needs on a bare accelerator machine, and installing only what is missing or too old.

The lent machine has its own Python and torch (and many packages) and no network. This compares
what is installed there with pdserve's floors (`FLOORS`, from pyproject.toml's dependencies, torch
left out: the machine's own build is used) and installs the missing or older ones from wheels carried
in an ignored folder (`.whl/`, made here by `bash benchmarks/device_prepare.sh`), into a target folder
that goes first on PYTHONPATH. Nothing else is touched.

  python benchmarks/device_deps.py --wheels .whl --target /tmp/pdserve-site   # prints the target
  python benchmarks/device_deps.py --check                                    # what would be installed
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

#: distribution -> lowest version pdserve runs with there. grpcio and protobuf: the committed stubs'
#: generator (their imports refuse older runtimes); transformers: the 5.x API pdserve uses (the
#: machine's own is reported in the check's table, pyproject pins the one the tests ran with).
FLOORS: dict[str, str] = {
    "grpcio": "1.85.1",
    "grpcio-health-checking": "1.85.1",
    "grpcio-reflection": "1.85.1",
    "protobuf": "7.35.1",
    "transformers": "5.0.0",
    "safetensors": "0.4",
    "numpy": "1.26",
    "jinja2": "3.1",
    "aiohttp": "3.9",
    "uvloop": "0.19",
    "prometheus-client": "0.20",
    "xxhash": "3.4",
    "pyyaml": "6",
}


def version_tuple(version: str) -> tuple[int, ...]:
    """ "1.85.1" -> (1, 85, 1); pre-release and local tails are ignored ("7.35.1rc1" -> (7, 35, 1))."""
    parts = []
    for piece in version.split("+")[0].split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def installed_versions(names: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def needed(installed: dict[str, str | None], floors: dict[str, str] = FLOORS) -> dict[str, str]:
    """Distribution -> why it must be installed (missing, or older than its floor)."""
    out = {}
    for name, floor in floors.items():
        have = installed.get(name)
        if have is None:
            out[name] = f"missing (need >= {floor})"
        elif version_tuple(have) < version_tuple(floor):
            out[name] = f"{have} < {floor}"
    return out


def wheel_for(name: str, wheels: Path) -> Path | None:
    """The carried wheel of a distribution (wheel names use underscores), newest first."""
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted((w for w in wheels.glob("*.whl") if w.name.lower().split("-")[0] == stem), reverse=True)
    return found[0] if found else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", type=Path, default=Path(".whl"), help="folder of carried wheels")
    ap.add_argument("--target", type=Path, default=Path("/tmp/pdserve-site"), help="where to install them")
    ap.add_argument("--check", action="store_true", help="only say what is missing or too old")
    args = ap.parse_args()
    missing = needed(installed_versions(list(FLOORS)))
    for name, why in missing.items():
        print(f"device_deps: {name}: {why}", file=sys.stderr)
    if args.check or not missing:
        if not missing:
            print("device_deps: every dependency is installed and new enough", file=sys.stderr)
        print(args.target)
        return 0
    wheels = {name: wheel_for(name, args.wheels) for name in missing}
    absent = [name for name, wheel in wheels.items() if wheel is None]
    if absent:
        print(
            f"device_deps: no carried wheel for {', '.join(absent)} in {args.wheels} "
            f"(make them here with `bash benchmarks/device_prepare.sh`)",
            file=sys.stderr,
        )
        return 1
    args.target.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(args.target),
        *map(str, wheels.values()),
    ]
    print(f"device_deps: installing {', '.join(w.name for w in wheels.values() if w)}", file=sys.stderr)
    subprocess.run(command, check=True)
    print(args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
