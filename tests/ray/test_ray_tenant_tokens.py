"""`pdserve serve --ray --auth-tokens-file`: the driver reads the tenant tokens and hands them to the
router actor, which accepts each tenant's token, refuses any other (401 / UNAUTHENTICATED), and keeps
each tenant's prefix cache apart, as the local launcher's router does (tests/serving/test_tenant_tokens.py).
A real local Ray instance (set RAY_TMPDIR to keep it apart from other Ray users of the machine), a
1P1D deployment of the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from security_helpers import TOKENS, assert_unknown_token_refused, cached_grpc, cached_http  # noqa: E402

from pdserve.cluster.cli import build_parser, deployment_config  # noqa: E402
from pdserve.cluster.ray_cluster import RayCluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_serve_ray_keeps_tenants_apart(tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_AUTH_TOKEN", raising=False)
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{tenant} {token}\n" for token, tenant in TOKENS.items()))
    args = build_parser().parse_args(
        [
            "serve",
            "--ray",
            "--port",
            "0",
            "--http-port",
            "0",
            "--threads-per-worker",
            "1",
            "--kv-cache-mb",
            "16",
            "--device",
            "cpu",
            "--model",
            str(tiny_llama_dir),
            "--model-name",
            "default",
            "--auth-tokens-file",
            str(tokens),
        ]
    )
    with RayCluster(deployment_config(args)) as cluster:
        port = int(cluster.http_address.rsplit(":", 1)[1])
        assert cached_http(port, "token-of-alice") == 0
        assert cached_http(port, "token-of-bob") == 0  # the same prompt, another tenant: nothing shared
        assert cached_http(port, "token-of-alice") > 0  # within the tenant it is a hit
        assert cached_grpc(cluster.router_address, "token-of-bob") > 0  # gRPC: the tenant's namespace too
        assert_unknown_token_refused(port, cluster.router_address)
