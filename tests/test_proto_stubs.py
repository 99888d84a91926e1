"""The committed pdserve.v1 stubs must be exactly what proto/generate.sh produces now.

Fails when a .proto file changed without regenerating (run ``proto/generate.sh``). The fresh stubs are
generated into a temp dir and compared with the committed files (``./run`` generates stubs only when
they are missing, so it never overwrites the committed ones before the tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STUB_DIR = REPO / "proto" / "pdserve" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def _generated(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name.endswith(GENERATED_SUFFIXES)}


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", str(REPO / "proto" / "generate.sh"), str(tmp_path)], check=True, env=env, cwd=tmp_path)
    fresh = _generated(tmp_path / "pdserve" / "v1")
    committed = _generated(STUB_DIR)
    protos = sorted(p.stem for p in STUB_DIR.glob("*.proto"))
    assert len(fresh) == 3 * len(protos), f"generator produced {sorted(fresh)}"
    assert sorted(committed) == sorted(fresh), "stub files missing or extra: run proto/generate.sh"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated stubs {stale}: run proto/generate.sh"


def test_proto_is_not_a_package() -> None:
    """`proto` belongs to proto-plus; our stubs are imported as `pdserve.v1`."""
    assert not (REPO / "proto" / "__init__.py").exists()
    assert not (REPO / "proto" / "pdserve" / "__init__.py").exists()  # the namespace root is pdserve/
    assert (STUB_DIR / "__init__.py").exists()


def test_proto_holds_only_the_contract() -> None:
    """proto/ has the .proto files, the generated stubs and their generator: no hand-written runtime
    module (shared runtime code lives in the root package, pdserve/)."""
    allowed = {"generate.sh", "pdserve/v1/__init__.py"}
    found = sorted(
        str(p.relative_to(REPO / "proto"))
        for p in (REPO / "proto").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    extra = [name for name in found if name not in allowed and not name.endswith((".proto", *GENERATED_SUFFIXES))]
    assert not extra, f"hand-written files in proto/: {extra}"
    init = (STUB_DIR / "__init__.py").read_text(encoding="utf-8")
    assert "import" not in init, "pdserve.v1's __init__ stays a package marker"


def test_stubs_import() -> None:
    from pdserve.v1 import kv_pb2_grpc, router_pb2_grpc, worker_pb2_grpc

    assert hasattr(router_pb2_grpc, "RouterStub")
    assert hasattr(worker_pb2_grpc, "DecodeWorkerStub") and hasattr(worker_pb2_grpc, "PrefillWorkerStub")
    assert hasattr(kv_pb2_grpc, "add_KvTransferServicer_to_server")
