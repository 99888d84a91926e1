"""`pdserve serve` with its security flags, as a user runs it (the CLI in a subprocess, real worker
processes): the public API over TLS with a bearer token (gRPC, the OpenAI HTTP API through the official
`openai` client, /metrics beyond loopback), the internal plane behind its token, a forged KV target,
and the one request-size limit. See docs/security.md for the table these tests fill."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from security_helpers import self_signed, token_file

from pdserve.cluster.client import PdserveClient, build_request, sampling_params
from pdserve.cluster.local import child_env
from pdserve.limits import MAX_REQUEST_BYTES
from pdserve.transport import TOKEN_METADATA
from pdserve.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow

TOKEN = "public-token-for-tests"
INTERNAL = "internal-token-for-tests"
ADDRESS = re.compile(r"(\d+\.\d+\.\d+\.\d+:\d+)")


@dataclass
class Served:
    router: str
    http: str
    metrics: str
    workers: dict[str, str]  # role -> address
    cert: str
    process: subprocess.Popen


def _read_banner(process: subprocess.Popen, timeout_s: float) -> list[str]:
    """stdout lines of `pdserve serve` up to its last one (the router's /metrics address)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"pdserve serve exited early ({process.wait()}): {lines}")
        lines.append(line.rstrip())
        if line.startswith("metrics router:"):
            return lines
    raise AssertionError(f"pdserve serve not up after {timeout_s} s: {lines}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("serve-security")
    cert, key = self_signed(tmp)
    env = {**child_env(), "PDSERVE_INTERNAL_TOKEN": INTERNAL}  # configured (not generated): the test knows it
    env.pop("PDSERVE_AUTH_TOKEN", None)
    argv = [
        sys.executable,
        "-m",
        "pdserve.cluster.cli",
        "serve",
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
        "--log-dir",
        str(tmp / "logs"),
        "--auth-token-file",
        token_file(tmp, TOKEN),
        "--tls-cert",
        cert,
        "--tls-key",
        key,
        "--metrics",
        "--metrics-host",
        "0.0.0.0",
    ]
    # its own process group: if serve does not stop in time, its router and workers go with it
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True
    )
    try:
        lines = _read_banner(process, 300)
        text = "\n".join(lines)
        router = ADDRESS.search(next(line for line in lines if line.startswith("router:"))).group(1)
        http = re.search(r"https://(\S+)/v1", text).group(1)
        metrics = re.search(r"metrics router: https://(\S+)/metrics", text).group(1)
        workers = {
            line.split()[0]: ADDRESS.search(line).group(1)
            for line in lines
            if line.split() and line.split()[0] in ("prefill", "decode")
        }
        yield Served(router, http, metrics, workers, cert, process)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # a leaked router would keep /metrics on 0.0.0.0
            process.wait()


def _code(call) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in child_env().items() if k != "PDSERVE_AUTH_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def _https(url: str, cert: str, token: str | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=cert), timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_grpc_needs_the_token_over_tls(served: Served) -> None:
    prompt = build_request(prompt="The capital of France is", params=sampling_params(max_tokens=3))
    assert (
        _code(lambda: PdserveClient(served.router, 30, tls_ca_file=served.cert).complete(prompt))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    assert (
        _code(lambda: PdserveClient(served.router, 30, "wrong", served.cert).complete(prompt))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    assert _code(lambda: PdserveClient(served.router, 30, TOKEN).complete(prompt)) == grpc.StatusCode.UNAVAILABLE
    assert len(PdserveClient(served.router, 60, TOKEN, served.cert).complete(prompt).token_ids) == 3
    # the user's commands: generate/status with --token and --tls-ca; without the token they fail
    ok = _cli(
        "generate", "--url", served.router, "--token", TOKEN, "--tls-ca", served.cert, "--max-tokens", "3", "Hello"
    )
    assert ok.returncode == 0, ok.stderr
    refused = _cli("status", "--url", served.router, "--tls-ca", served.cert)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    status = _cli("status", "--url", served.router, "--token", TOKEN, "--tls-ca", served.cert, "--json")
    assert status.returncode == 0 and len(json.loads(status.stdout)["workers"]) == 2


def test_http_api_needs_the_token_and_the_openai_client_works_over_https(served: Served) -> None:
    openai = pytest.importorskip("openai")

    base = f"https://{served.http}"
    assert _https(f"{base}/v1/models", served.cert)[0] == 401
    assert _https(f"{base}/v1/completions", served.cert, body=b'{"prompt": "hi"}')[0] == 401
    assert _https(f"{base}/v1/models", served.cert, token="wrong")[0] == 401
    assert _https(f"{base}/health", served.cert)[0] == 200  # load balancers probe it without a token
    with pytest.raises(OSError):  # plaintext HTTP to the TLS port gets no answer
        urllib.request.urlopen(f"http://{served.http}/health", timeout=10)
    trust = ssl.create_default_context(cafile=served.cert)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, http_client=openai.DefaultHttpxClient(verify=trust))
    model = client.models.list().data[0].id
    answer = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4)
    assert answer.usage.completion_tokens == 4 and answer.choices[0].text
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3, stream=True
    )
    assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream)
    anonymous = openai.OpenAI(
        base_url=f"{base}/v1",
        api_key="not-the-token",
        http_client=openai.DefaultHttpxClient(verify=trust),
        max_retries=0,
    )
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()


def test_metrics_beyond_loopback_need_the_token(served: Served) -> None:
    url = f"https://127.0.0.1:{served.metrics.rsplit(':', 1)[1]}/metrics"
    assert _https(url, served.cert)[0] == 401
    status, body = _https(url, served.cert, token=TOKEN)
    assert status == 200 and b"pdserve_" in body


def test_request_size_limit_is_one_400_naming_it(served: Served) -> None:
    model = json.loads(_https(f"https://{served.http}/v1/models", served.cert, TOKEN)[1])["data"][0]["id"]
    base = f"https://{served.http}/v1/chat/completions"
    too_big = {
        "model": model,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "a " * 300_000} for _ in range(15)],
    }  # ~9 MB
    status, body = _https(base, served.cert, TOKEN, json.dumps(too_big).encode())
    assert status == 400, body[:300]
    assert "request-size limit" in json.loads(body)["error"]["message"]
    # over gRPC the same limit, the same words
    client = PdserveClient(served.router, 120, TOKEN, served.cert)
    with pytest.raises(grpc.RpcError) as err:
        client.complete(build_request(messages=[("user", "a " * 300_000)] * 15))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(MAX_REQUEST_BYTES) in err.value.details()
    # 4.8 MB: above what decode workers used to take (4 MiB, answered 429), below the limit: it reaches
    # the decode worker, which answers for its content (longer than the model's context), not its size
    allowed = {
        "model": model,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "a " * 300_000} for _ in range(8)],
    }
    status, body = _https(base, served.cert, TOKEN, json.dumps(allowed).encode())
    assert status == 400, body[:300]
    assert "context" in json.loads(body)["error"]["message"]


def _internal(address: str, token: str | None) -> tuple[worker_pb2_grpc.PrefillWorkerStub, tuple]:
    metadata = ((TOKEN_METADATA, token),) if token else ()
    return worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(address)), metadata


def test_internal_plane_needs_its_token_and_kv_goes_only_to_registered_decode_workers(served: Served) -> None:
    prefill, decode = served.workers["prefill"], served.workers["decode"]
    # health stays open; everything else needs the internal token
    reply = health_pb2_grpc.HealthStub(grpc.insecure_channel(prefill)).Check(
        health_pb2.HealthCheckRequest(), timeout=10
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub, _ = _internal(prefill, None)
    assert _code(lambda: stub.GetInfo(worker_pb2.InfoRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    assert (
        _code(lambda: stub.SetKvTargets(worker_pb2.KvTargets(targets=["127.0.0.1:9"]), timeout=10))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    decode_stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(decode))
    assert _code(lambda: decode_stub.GetInfo(worker_pb2.InfoRequest(), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    assert (
        _code(lambda: decode_stub.GetInfo(worker_pb2.InfoRequest(), timeout=10, metadata=((TOKEN_METADATA, "wrong"),)))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    # a forged KV target, even with the token: refused before any compute; nothing connects to it
    stub, token = _internal(prefill, INTERNAL)
    before = stub.GetInfo(worker_pb2.InfoRequest(), timeout=10, metadata=token)
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(1)
        trap.settimeout(1.0)
        forged = worker_pb2.PrefillRequest(
            request_id="forged", prompt_token_ids=[1, 2, 3], kv_target_address=f"127.0.0.1:{trap.getsockname()[1]}"
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(forged, timeout=30, metadata=token)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "not a decode worker registered" in err.value.details()
        with pytest.raises(socket.timeout):
            trap.accept()
    after = stub.GetInfo(worker_pb2.InfoRequest(), timeout=10, metadata=token)
    assert after.prefill_tokens_computed == before.prefill_tokens_computed
    assert after.kv_bytes_sent == before.kv_bytes_sent


def test_a_token_holder_cannot_redirect_kv_nor_starve_the_registry(served: Served) -> None:
    """Issue 29 row 7: a peer holding the internal token calls SetKvTargets([its own socket]) (then a
    Prefill aimed at it), or SetKvTargets([]) over and over. Only the router's own credential may set
    KV targets: every such call is PERMISSION_DENIED, the prefill worker computes nothing and connects
    nowhere, and honest requests keep being served meanwhile."""
    prefill, decode = served.workers["prefill"], served.workers["decode"]
    stub, token = _internal(prefill, INTERNAL)
    decode_stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(decode))
    before = stub.GetInfo(worker_pb2.InfoRequest(), timeout=10, metadata=token)
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(1)
        trap.settimeout(1.0)
        target = f"127.0.0.1:{trap.getsockname()[1]}"
        for call in (
            lambda: stub.SetKvTargets(worker_pb2.KvTargets(targets=[target]), timeout=10, metadata=token),
            lambda: decode_stub.SetKvTargets(worker_pb2.KvTargets(targets=[target]), timeout=10, metadata=token),
            lambda: stub.SetKvTargets(
                worker_pb2.KvTargets(targets=[target]),
                timeout=10,
                metadata=(*token, ("x-pdserve-router-token", "guessed")),
            ),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
            assert "only the router may set KV targets" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="redirected", prompt_token_ids=[1, 2, 3], kv_target_address=target
                ),
                timeout=30,
                metadata=token,
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(socket.timeout):
            trap.accept()
    # the empty registry, sent as fast as it goes while an honest client works: refused, nothing lost
    prompt = build_request(prompt="The capital of France is", params=sampling_params(max_tokens=3))
    client = PdserveClient(served.router, 60, TOKEN, served.cert)
    refused = 0
    for _ in range(5):
        for _ in range(20):
            try:
                stub.SetKvTargets(worker_pb2.KvTargets(targets=[]), timeout=10, metadata=token)
            except grpc.RpcError as exc:
                refused += exc.code() == grpc.StatusCode.PERMISSION_DENIED
        assert len(client.complete(prompt).token_ids) == 3
    assert refused == 100
    after = stub.GetInfo(worker_pb2.InfoRequest(), timeout=10, metadata=token)
    assert after.kv_bytes_sent > before.kv_bytes_sent  # the honest requests' KV went to the registered worker
