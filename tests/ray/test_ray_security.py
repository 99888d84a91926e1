"""`pdserve serve --ray` with --auth-token-file, --tls-cert/--tls-key and --http-port (configured
through the CLI's own parser): the router actor refuses gRPC and HTTP calls without the token, and
the worker actors refuse internal calls without the deployment's generated internal token."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

ray = pytest.importorskip("ray")

from security_helpers import self_signed, token_file  # noqa: E402

from pdserve.cluster.cli import build_parser, deployment_config  # noqa: E402
from pdserve.cluster.client import PdserveClient, build_request, sampling_params  # noqa: E402
from pdserve.cluster.ray_cluster import RayCluster  # noqa: E402
from pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TOKEN = "ray-public-token"


def _get(url: str, cert: str, token: str | None = None, body: bytes | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=body, headers={**headers, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=cert), timeout=120) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_serve_ray_refuses_unauthenticated_grpc_and_http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_AUTH_TOKEN", raising=False)
    cert, key = self_signed(tmp_path)
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
            "64",
            "--device",
            "cpu",
            "--auth-token-file",
            token_file(tmp_path, TOKEN),
            "--tls-cert",
            cert,
            "--tls-key",
            key,
        ]
    )
    with RayCluster(deployment_config(args)) as cluster:
        request = build_request(prompt="The capital of France is", params=sampling_params(max_tokens=3))
        with pytest.raises(grpc.RpcError) as err:
            PdserveClient(cluster.router_address, 60, tls_ca_file=cert).complete(request)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(PdserveClient(cluster.router_address, 120, TOKEN, cert).complete(request).token_ids) == 3
        base = f"https://{cluster.http_address}"
        assert _get(f"{base}/v1/models", cert) == 401
        assert _get(f"{base}/v1/completions", cert, body=json.dumps({"prompt": "hi"}).encode()) == 401
        assert _get(f"{base}/v1/models", cert, TOKEN) == 200
        assert _get(f"{base}/health", cert) == 200
        for worker in cluster.workers():  # the internal plane: the driver-generated token, not known here
            stub_cls = (
                worker_pb2_grpc.PrefillWorkerStub if worker["role"] == "prefill" else worker_pb2_grpc.DecodeWorkerStub
            )
            with pytest.raises(grpc.RpcError) as err:
                stub_cls(grpc.insecure_channel(worker["address"])).GetInfo(worker_pb2.InfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
