"""Security of the public API: bearer token, TLS, no unsafe deserialization anywhere."""

from __future__ import annotations

import datetime
import ipaddress
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from security_helpers import self_signed  # noqa: E402

from pdserve.cluster.client import PdserveClient, build_request
from pdserve.router.config import RouterConfig
from pdserve.router.server import RouterServer, serve

TOKEN = "s3cret-token"
REPO = Path(__file__).resolve().parents[2]
PACKAGES = [
    "engine",
    "router",
    "prefill_worker",
    "decode_worker",
    "elastic_worker",
    "kv_transfer",
    "cluster",
    "capacity",
    "telemetry",
    "proto",
]


@pytest.fixture
def secured_router(tmp_path: Path) -> Iterator[tuple[RouterServer, str]]:
    cert, key = self_signed(tmp_path)
    router, _ = serve(RouterConfig(auth_token=TOKEN, tls_cert_file=cert, tls_key_file=key))
    try:
        yield router, cert
    finally:
        router.stop(0)


def _code(client: PdserveClient) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        client.complete(build_request(prompt="hello"))
    return err.value.code()


def test_token_and_tls_are_enforced(secured_router) -> None:  # noqa: ANN001
    router, cert = secured_router
    assert _code(PdserveClient(router.address, 5, tls_ca_file=cert)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(PdserveClient(router.address, 5, "wrong", cert)) == grpc.StatusCode.UNAUTHENTICATED
    # the right token passes authentication; with no worker configured the router then says so
    assert _code(PdserveClient(router.address, 5, TOKEN, cert)) == grpc.StatusCode.UNAVAILABLE
    # a plaintext client cannot talk to the TLS port at all
    assert _code(PdserveClient(router.address, 5, TOKEN)) == grpc.StatusCode.UNAVAILABLE
    # health checks stay open for load balancers
    channel = grpc.secure_channel(router.address, grpc.ssl_channel_credentials(Path(cert).read_bytes()))
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_autoscaler_reaches_a_router_that_serves_tls_and_a_token(secured_router) -> None:  # noqa: ANN001
    """`serve --autoscale` with --tls-cert: the loop trusts the serving certificate and sends the token
    (it used to open a plaintext channel, so every tick failed)."""
    from pdserve.cluster.autoscaler import Autoscaler, AutoscalerConfig, AutoscalerLoop

    router, cert = secured_router
    core = Autoscaler(AutoscalerConfig(ttft_s=0.5, tpot_s=0.05))
    loop = AutoscalerLoop(router.address, core, token=TOKEN, tls_ca_file=cert)
    try:
        assert loop.tick() == []  # GetStatus answered over TLS (no workers: nothing to decide)
        assert core.last["samples"] == 0 and core.last["decode"] == 0
    finally:
        loop.stop()
    for kwargs, code in (
        ({"token": TOKEN}, grpc.StatusCode.UNAVAILABLE),  # plaintext to a TLS port
        ({"tls_ca_file": cert}, grpc.StatusCode.UNAUTHENTICATED),
    ):
        plain = AutoscalerLoop(router.address, Autoscaler(AutoscalerConfig(ttft_s=0.5, tpot_s=0.05)), **kwargs)
        try:
            with pytest.raises(grpc.RpcError) as err:
                plain.tick()
            assert err.value.code() == code
        finally:
            plain.stop()


def test_token_without_tls() -> None:
    router, _ = serve(RouterConfig(auth_token=TOKEN))
    try:
        assert _code(PdserveClient(router.address, 5)) == grpc.StatusCode.UNAUTHENTICATED
        status = PdserveClient(router.address, 5, TOKEN).status()
        assert status.in_flight_requests == 0
    finally:
        router.stop(0)


def test_internal_services_bind_to_loopback_by_default() -> None:
    import argparse

    from pdserve.decode_worker.process import parse_args as decode_args
    from pdserve.prefill_worker.process import parse_args as prefill_args
    from pdserve.router.process import build_parser

    assert decode_args([]).host == prefill_args([]).host == "127.0.0.1"
    router_args = build_parser().parse_args([])
    assert isinstance(router_args, argparse.Namespace) and router_args.host == "127.0.0.1"


UNSAFE = re.compile(r"\b(pickle|cloudpickle|dill|marshal)\.loads?\(|torch\.load\(|recv_pyobj\(|yaml\.load\(")


def test_no_unsafe_deserialization_in_the_code() -> None:
    offenders = []
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if UNSAFE.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "unsafe deserialization:\n" + "\n".join(offenders)
    assert UNSAFE.search("x = pickle.loads(data)") and UNSAFE.search("torch.load(f)")  # the scan can fail


def _ca_and_leaf(tmp: Path) -> dict[str, str]:
    """A CA and one certificate it signed, valid for 127.0.0.1 (used by every process)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject: str, issuer: x509.Name, public_key, signer, ca: bool) -> x509.Certificate:  # noqa: ANN001
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                False,
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-test-ca")])
    ca_cert = build("pdserve-test-ca", ca_name, ca_key.public_key(), ca_key, ca=True)
    leaf = build("pdserve-process", ca_name, leaf_key.public_key(), ca_key, ca=False)
    files = {"ca": tmp / "ca.pem", "cert": tmp / "leaf.pem", "key": tmp / "leaf.key"}
    files["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return {k: str(v) for k, v in files.items()}


def test_internal_mtls_between_router_and_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    """Workers serve the tiny random Llama: the point is the internal plane's TLS, not the model."""
    from pdserve import transport
    from pdserve.cluster.launch import local_deployment
    from pdserve.cluster.local import LocalCluster
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    from e2e_helpers import generate, wait_idle, worker_info

    files = _ca_and_leaf(tmp_path)
    monkeypatch.setenv(transport.ENV_CERT, files["cert"])
    monkeypatch.setenv(transport.ENV_KEY, files["key"])
    monkeypatch.setenv(transport.ENV_CA, files["ca"])
    transport.internal_tls.cache_clear()
    try:
        config = local_deployment(model=str(tiny_llama_dir), prefill=1, decode=1, threads_per_worker=1)
        with LocalCluster(config) as cluster:
            assert len(generate(cluster.router_address, "The capital of France is", 5).token_ids) == 5
            roles = [(w.role, w.address) for w in cluster.workers]
            assert worker_info(roles[0][1], roles[0][0]).requests_finished == 1  # mTLS client works
            for address in (a for _, a in roles):  # plaintext, and TLS without a client certificate, fail
                for channel in (
                    grpc.insecure_channel(address),
                    grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(files["ca"]).read_bytes())),
                ):
                    with pytest.raises(grpc.RpcError):
                        worker_pb2_grpc.DecodeWorkerStub(channel).GetInfo(worker_pb2.InfoRequest(), timeout=3)
            wait_idle(roles)
    finally:
        transport.internal_tls.cache_clear()


def _run_module(module: str, *args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    from pdserve.cluster.local import child_env

    env = {k: v for k, v in child_env().items() if not k.startswith(("PDSERVE_INTERNAL", "PDSERVE_AUTH"))}
    return subprocess.run(
        [sys.executable, "-m", f"pdserve.{module}", *args],
        capture_output=True,
        text=True,
        env={**env, **(env_extra or {})},
        timeout=120,
    )


@pytest.mark.parametrize("module", ["prefill_worker", "decode_worker"])
def test_internal_bind_beyond_loopback_without_credentials_is_refused(module: str) -> None:
    """A worker told to bind 0.0.0.0 with neither an internal token nor mTLS exits (code 2) before it
    loads a model or opens a port."""
    result = _run_module(module, "--host", "0.0.0.0", "--port", "0", "--model", "/nonexistent")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "refusing to serve the internal plane on 0.0.0.0" in result.stderr
    assert "PDSERVE_READY" not in result.stdout


def test_internal_token_file_lets_a_worker_bind_beyond_loopback(tmp_path: Path) -> None:
    """With --internal-token-file the bind check passes: the worker goes on to load its model (here a
    missing folder, so it then fails for that reason, not for the bind)."""
    token = tmp_path / "internal"
    token.write_text("t0ken\n")
    result = _run_module(
        "prefill_worker",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--model",
        str(tmp_path / "none"),
        "--internal-token-file",
        str(token),
    )
    assert result.returncode != 0 and "refusing" not in result.stderr
    assert str(tmp_path / "none") in result.stderr


def test_bind_rule() -> None:
    from pdserve import transport

    assert transport.is_loopback("127.0.0.1") and transport.is_loopback("::1") and transport.is_loopback("localhost")
    assert not transport.is_loopback("0.0.0.0") and not transport.is_loopback("10.1.2.3")
    assert not transport.is_loopback("example.internal")


def test_bind_rule_with_a_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pdserve import transport

    monkeypatch.delenv(transport.ENV_TOKEN, raising=False)
    monkeypatch.delenv(transport.ENV_TOKEN_FILE, raising=False)
    with pytest.raises(ValueError, match="beyond loopback"):
        transport.check_bind_allowed("0.0.0.0")
    transport.check_bind_allowed("127.0.0.1")  # zero-config on loopback
    token = tmp_path / "internal"
    token.write_text("t0ken\n")
    transport.use_internal_token_file(str(token))
    assert transport.internal_token() == "t0ken"
    transport.check_bind_allowed("0.0.0.0")
    monkeypatch.delenv(transport.ENV_TOKEN_FILE)
    monkeypatch.setenv(transport.ENV_TOKEN, "other")
    transport.check_bind_allowed("0.0.0.0")


def test_router_metrics_beyond_loopback_need_a_token() -> None:
    result = _run_module("router", "--port", "0", "--metrics-port", "1", "--metrics-host", "0.0.0.0")
    assert result.returncode == 2 and "without an auth token" in result.stderr
    with pytest.raises(ValueError, match="beyond loopback"):
        RouterConfig(metrics_host="0.0.0.0", metrics_port=9100)
    RouterConfig(metrics_host="0.0.0.0", metrics_port=9100, auth_token=TOKEN)


def test_internal_token_is_required_and_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real internal server (the workers' make_server) with a token refuses calls without it and
    takes those from `open_channel`, which sends it; health stays open."""
    from pdserve import transport
    from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from pdserve.worker.runtime import add_health, bind, make_server

    monkeypatch.setenv(transport.ENV_TOKEN, "internal-secret")

    class Info(worker_pb2_grpc.PrefillWorkerServicer):
        def GetInfo(self, request, context):  # noqa: ANN001, ANN201, N802
            return common_pb2.WorkerInfo(worker_id="w")

    server = make_server(control_threads=2, name="t")
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(Info(), server)
    health = add_health(server)
    address = bind(server, "127.0.0.1", 0)
    server.start()
    try:
        health.set("", health_pb2.HealthCheckResponse.SERVING)
        plain = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(address))
        with pytest.raises(grpc.RpcError) as err:
            plain.GetInfo(worker_pb2.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            plain.GetInfo(worker_pb2.InfoRequest(), timeout=5, metadata=((transport.TOKEN_METADATA, "nope"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (
            worker_pb2_grpc.PrefillWorkerStub(transport.open_channel(address))
            .GetInfo(worker_pb2.InfoRequest(), timeout=5)
            .worker_id
            == "w"
        )
        reply = health_pb2_grpc.HealthStub(grpc.insecure_channel(address)).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the router's memory from /proc")
def test_unauthenticated_calls_are_refused_before_their_message_is_read(tmp_path: Path) -> None:
    """Issue 29 row 2: 40 calls without the token, each carrying a 15 MiB message, against a router
    process. The token is checked before the message is taken in, so the router's memory barely
    moves (it grew by ~750 MiB, and kept it, when the whole message was read first)."""
    import json
    import threading
    import time

    from pdserve.cluster.local import child_env
    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    token = tmp_path / "token"
    token.write_text("the-token\n")
    env = {k: v for k, v in child_env().items() if k != "PDSERVE_AUTH_TOKEN"}
    router = subprocess.Popen(
        [sys.executable, "-m", "pdserve.router", "--port", "0", "--auth-token-file", str(token)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        address = json.loads(router.stdout.readline().split(" ", 1)[1])["address"]  # type: ignore[union-attr]
        time.sleep(0.5)
        before = _rss_mib(router.pid)
        big = router_pb2.GenerateRequest(
            prompt="x" * (15 * 2**20 - 100), params=common_pb2.SamplingParams(max_tokens=1)
        )
        codes: list[grpc.StatusCode] = []

        def call() -> None:
            with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 32 * 2**20)]) as channel:
                try:
                    list(router_pb2_grpc.RouterStub(channel).Generate(big, timeout=60))
                except grpc.RpcError as exc:
                    codes.append(exc.code())

        threads = [threading.Thread(target=call) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        time.sleep(1.0)
        grown = _rss_mib(router.pid) - before
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 40
        assert grown < 150, f"the router took {grown:.0f} MiB for refused calls"
        # and an authenticated client is served as before (no worker: UNAVAILABLE, past authentication)
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                small = router_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=1))
                list(
                    router_pb2_grpc.RouterStub(channel).Generate(
                        small, metadata=(("authorization", "Bearer the-token"),), timeout=30
                    )
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.terminate()
        router.wait(30)
