"""How pdserve processes talk to each other: plaintext on loopback by default, mutual TLS when the
deployment says so.

Internal mTLS is switched on for every process at once through the environment (the launcher
passes it to each child): `PDSERVE_INTERNAL_TLS_CERT` and `PDSERVE_INTERNAL_TLS_KEY` (this
process's PEM certificate chain and key) and `PDSERVE_INTERNAL_TLS_CA` (the PEM of the CA that
signed every pdserve process's certificate). Then every internal server requires a client
certificate signed by that CA, and every internal channel presents its own. The public Router port
has its own settings (`--tls-cert`, `--tls-key`, `--auth-token-file`).

Hand-written (not generated); imports only grpc.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import grpc

ENV_CERT = "PDSERVE_INTERNAL_TLS_CERT"
ENV_KEY = "PDSERVE_INTERNAL_TLS_KEY"
ENV_CA = "PDSERVE_INTERNAL_TLS_CA"


@dataclass(frozen=True)
class TlsMaterial:
    certificate_chain: bytes
    private_key: bytes
    root_certificates: bytes


@lru_cache(maxsize=1)
def internal_tls() -> TlsMaterial | None:
    """The internal mTLS material from the environment; None when plaintext (all three unset)."""
    paths = [os.environ.get(name) for name in (ENV_CERT, ENV_KEY, ENV_CA)]
    if not any(paths):
        return None
    if not all(paths):
        raise ValueError(f"internal TLS needs all of {ENV_CERT}, {ENV_KEY} and {ENV_CA}")
    cert, key, ca = (_read(p) for p in paths)  # type: ignore[arg-type]
    return TlsMaterial(cert, key, ca)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def open_channel(address: str, options: list[tuple[str, int]] | None = None) -> grpc.Channel:
    """A channel to another pdserve process (mTLS when configured)."""
    tls = internal_tls()
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
    return grpc.secure_channel(address, credentials, options=options)


def add_port(server: grpc.Server, address: str) -> int:
    """Bind an internal server port (requiring client certificates when mTLS is configured)."""
    tls = internal_tls()
    if tls is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials(
        [(tls.private_key, tls.certificate_chain)], root_certificates=tls.root_certificates,
        require_client_auth=True,
    )
    return server.add_secure_port(address, credentials)


def open_aio_channel(address: str, options: list[tuple[str, int]] | None = None) -> grpc.aio.Channel:
    """An event-loop channel to another pdserve process (mTLS when configured); create it on the loop
    that will use it."""
    tls = internal_tls()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
    return grpc.aio.secure_channel(address, credentials, options=options)
