"""Security of the public API: bearer token, TLS, no unsafe deserialization anywhere."""

from __future__ import annotations

import datetime
import ipaddress
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.client import PdserveClient, build_request
from router.config import RouterConfig
from router.server import RouterServer, serve

TOKEN = "s3cret-token"
REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["engine", "router", "prefill_worker", "decode_worker", "kv_transfer", "cluster", "telemetry", "proto"]


def _self_signed(tmp: Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture
def secured_router(tmp_path: Path) -> Iterator[tuple[RouterServer, str]]:
    cert, key = _self_signed(tmp_path)
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

    from decode_worker.__main__ import parse_args as decode_args
    from prefill_worker.__main__ import parse_args as prefill_args
    from router.__main__ import build_parser

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
