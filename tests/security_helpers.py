"""Test helpers for the security tests: a self-signed certificate (the `cryptography` package when
installed, else the openssl command line), a token file, and the tenant-token probes (`cached_http`,
`cached_grpc`: how many of a secret prompt's tokens a tenant finds cached)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import urllib.request
from pathlib import Path


def self_signed(tmp: Path) -> tuple[str, str]:
    """(cert.pem, key.pem) of a self-signed certificate for localhost and 127.0.0.1."""
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                "-keyout",
                str(key_path),
                "-out",
                str(cert_path),
                "-addext",
                "subjectAltName=DNS:localhost,IP:127.0.0.1",
            ],
            check=True,
            capture_output=True,
        )
        return str(cert_path), str(key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def token_file(tmp: Path, token: str, name: str = "token") -> str:
    path = tmp / name
    path.write_text(token + "\n", encoding="utf-8")
    path.chmod(0o600)
    return str(path)


def register_kv_targets(prefill_address: str, decode_addresses: list[str]) -> None:
    """What the router does on every poll (SetKvTargets): let a prefill worker push KV to these decode
    workers. Tests that call a decode worker directly, without a router, need it."""
    from pdserve.transport import open_channel, router_metadata
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    info = worker_pb2.InfoRequest()
    targets = [
        worker_pb2_grpc.DecodeWorkerStub(open_channel(d)).GetInfo(info, timeout=10).kv_address for d in decode_addresses
    ]
    # in the router's name: a launcher in this process holds the router credential its workers check
    worker_pb2_grpc.PrefillWorkerStub(open_channel(prefill_address)).SetKvTargets(
        worker_pb2.KvTargets(targets=targets), timeout=10, metadata=router_metadata() or None
    )


#: Two tenants' tokens (token -> tenant, as pdserve.transport.load_tenant_tokens gives them) and a
#: prompt of several KV blocks whose prefix a tenant could probe.
TOKENS = {"token-of-alice": "alice", "token-of-bob": "bob"}
SECRET = "The PIN of the vault is 4711. " + " ".join(f"w{i}" for i in range(40))  # several blocks


def _post(port: int, token: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"model": "default", **body}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def cached_http(port: int, token: str, salt: str | None = None) -> int:
    """`cached_tokens` of a completion of SECRET on the HTTP API at 127.0.0.1:`port` with `token`."""
    body = {"prompt": SECRET, "max_tokens": 2, "temperature": 0, **({"cache_salt": salt} if salt else {})}
    return _post(port, token, body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def cached_grpc(address: str, token: str) -> int:
    """`cached_tokens` of a generation of SECRET on the router's gRPC API with `token`."""
    from pdserve.transport import open_channel
    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    request = router_pb2.GenerateRequest(prompt=SECRET, params=common_pb2.SamplingParams(max_tokens=2))
    with open_channel(address) as channel:
        answers = list(
            router_pb2_grpc.RouterStub(channel).Generate(
                request, timeout=120, metadata=(("authorization", f"Bearer {token}"),)
            )
        )
    return answers[-1].usage.cached_tokens


def assert_unknown_token_refused(http_port: int, grpc_address: str, token: str = "token-of-mallory") -> None:
    """A token that is not in the tokens file is refused on both APIs: HTTP 401, gRPC UNAUTHENTICATED."""
    import urllib.error

    import grpc
    import pytest

    with pytest.raises(urllib.error.HTTPError) as err:
        cached_http(http_port, token)
    assert err.value.code == 401
    err.value.close()
    with pytest.raises(grpc.RpcError) as rpc_err:
        cached_grpc(grpc_address, token)
    assert rpc_err.value.code() == grpc.StatusCode.UNAUTHENTICATED
