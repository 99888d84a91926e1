"""How pdserve processes talk to each other: plaintext on loopback by default, mutual TLS when the
deployment says so.

Internal mTLS is switched on for every process at once through the environment (the launcher
passes it to each child): `PDSERVE_INTERNAL_TLS_CERT` and `PDSERVE_INTERNAL_TLS_KEY` (this
process's PEM certificate chain and key) and `PDSERVE_INTERNAL_TLS_CA` (the PEM of the CA that
signed every pdserve process's certificate). Then every internal server requires a client
certificate signed by that CA, and every internal channel presents its own. The public Router port
has its own settings (`--tls-cert`, `--tls-key`, `--auth-token-file`).

Internal token: `PDSERVE_INTERNAL_TOKEN` (the token itself) or `PDSERVE_INTERNAL_TOKEN_FILE` (a
file whose first line is the token; the processes' `--internal-token-file` sets it). With a token,
every internal server refuses calls without the metadata ``x-pdserve-internal-token: <token>``
(UNAUTHENTICATED; health checks stay open), and every internal channel sends it. It can be combined
with mTLS. The launchers (`pdserve serve`, local or `--ray`) generate a random token when none is
configured and pass it to their children.

Invariant: an internal server that binds a non-loopback address refuses to start unless mTLS or
a token is configured (`check_bind_allowed`); on loopback both stay optional (zero-config).

Hand-written (not generated); imports only grpc and the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import grpc

ENV_CERT = "PDSERVE_INTERNAL_TLS_CERT"
ENV_KEY = "PDSERVE_INTERNAL_TLS_KEY"
ENV_CA = "PDSERVE_INTERNAL_TLS_CA"
ENV_TOKEN = "PDSERVE_INTERNAL_TOKEN"
ENV_TOKEN_FILE = "PDSERVE_INTERNAL_TOKEN_FILE"
#: Metadata key carrying the internal token on every internal call.
TOKEN_METADATA = "x-pdserve-internal-token"
UNAUTHENTICATED_MESSAGE = f"internal call without the cluster's internal token (metadata {TOKEN_METADATA!r})"
#: Methods that stay open without the token (load balancers and launchers probe them).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
LOOPBACK_NAMES = ("localhost",)

_launcher_token: str | None = None  # a token this process generated for the children it launches


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
        channel = grpc.insecure_channel(address, options=options)
    else:
        credentials = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
        channel = grpc.secure_channel(address, credentials, options=options)
    token = _client_token()
    return channel if token is None else grpc.intercept_channel(channel, _SyncTokenInterceptor(token))


def add_port(server: grpc.Server, address: str) -> int:
    """Bind an internal server port (requiring client certificates when mTLS is configured).
    ValueError when the host is not loopback and neither mTLS nor a token is configured."""
    check_bind_allowed(address.rsplit(":", 1)[0])
    tls = internal_tls()
    if tls is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials(
        [(tls.private_key, tls.certificate_chain)],
        root_certificates=tls.root_certificates,
        require_client_auth=True,
    )
    return server.add_secure_port(address, credentials)


def open_aio_channel(
    address: str, options: list[tuple[str, int]] | None = None, add_token: bool = True
) -> grpc.aio.Channel:
    """An event-loop channel to another pdserve process (mTLS when configured); create it on the loop
    that will use it. `add_token=False`: no token interceptor; the caller passes `internal_metadata()`
    on each call itself (grpc.aio's interceptors wrap every message of a stream in Python: on the
    router's per-token relay they cost about 50 us per token)."""
    tls = internal_tls()
    interceptors = _aio_interceptors(_client_token()) if add_token else None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


# ----- internal token -------------------------------------------------------------------------------
def internal_metadata() -> tuple[tuple[str, str], ...]:
    """Call metadata carrying this process's internal token (empty when it has none), for calls on a
    channel opened with ``add_token=False``."""
    token = _client_token()
    return () if token is None else ((TOKEN_METADATA, token),)


def internal_token() -> str | None:
    """The internal token this process is configured with (environment or token file); None when none."""
    if os.environ.get(ENV_TOKEN):
        return os.environ[ENV_TOKEN]
    path = os.environ.get(ENV_TOKEN_FILE)
    return _read_token_file(path) if path else None


@lru_cache(maxsize=8)
def _read_token_file(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        token = f.readline().strip()
    if not token:
        raise ValueError(f"internal token file {path} is empty")
    return token


def load_token(path: str | None, env_value: str | None) -> str | None:
    """The API token (router --auth-token-file, the Ray launcher) from a file (first line,
    stripped) or the environment; None when neither is set."""
    if path:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
        if not token:
            raise ValueError(f"auth token file {path} is empty")
        return token
    return env_value or None


#: A tenant's name: the tenant part of its requests' cache salt, so it never holds "/".
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def load_tenant_tokens(path: str) -> dict[str, str]:
    """The tokens of a tokens file, each with its tenant: one ``TENANT TOKEN`` pair per line (blank
    lines and lines starting with ``#`` are skipped). ValueError naming the line for a bad tenant
    name (letters, digits, ``._-``, at most 64), a missing token, or a tenant or token given twice."""
    tokens: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            tenant, _, token = line.partition(" ")
            token = token.strip()
            where = f"{path}:{number}"
            if not TENANT_NAME.fullmatch(tenant):
                raise ValueError(f"{where}: tenant names are 1-64 letters, digits, '.', '_' or '-'")
            if not token or " " in token:
                raise ValueError(f"{where}: expected 'TENANT TOKEN'")
            if token in tokens or tenant in tokens.values():
                raise ValueError(f"{where}: tenant or token given twice")
            tokens[token] = tenant
    if not tokens:
        raise ValueError(f"auth tokens file {path} names no token")
    return tokens


def use_internal_token_file(path: str | None) -> None:
    """``--internal-token-file``: make this process (server and clients) use the token in ``path``."""
    if path:
        _read_token_file(path)  # fail early on a missing or empty file
        os.environ[ENV_TOKEN_FILE] = path
        os.environ.pop(ENV_TOKEN, None)  # the flag wins over an inherited token


def launcher_token() -> str:
    """The internal token a launcher hands to its children: the configured one, else one generated once
    per process. This process's own channels then send it too (so the operator's CLI and tests can talk
    to the workers they launched), but servers in this process require only a configured token."""
    global _launcher_token
    configured = internal_token()
    if configured:
        return configured
    if _launcher_token is None:
        _launcher_token = secrets.token_urlsafe(32)
    return _launcher_token


# ----- the router's own credential --------------------------------------------------------------
#: The router process's credential for the calls only a router makes (SetKvTargets): the token itself,
#: in the router's environment only. Workers get its sha256 (ENV_ROUTER_DIGEST), so neither another
#: internal-token holder nor a worker can register KV targets in the router's name.
ENV_ROUTER_TOKEN = "PDSERVE_ROUTER_TOKEN"
ENV_ROUTER_DIGEST = "PDSERVE_ROUTER_TOKEN_SHA256"
ROUTER_TOKEN_KEY = "x-pdserve-router-token"
_launcher_router_token: str | None = None


def launcher_router_token() -> str:
    """The router credential a launcher hands its router: the configured one, else one generated once
    per process (this process's own `router_metadata()` then carries it too)."""
    global _launcher_router_token
    if os.environ.get(ENV_ROUTER_TOKEN):
        return os.environ[ENV_ROUTER_TOKEN]
    if _launcher_router_token is None:
        _launcher_router_token = secrets.token_urlsafe(32)
    return _launcher_router_token


def router_token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def router_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata naming this process as the router (empty when it holds no router credential)."""
    token = os.environ.get(ENV_ROUTER_TOKEN) or _launcher_router_token
    return ((ROUTER_TOKEN_KEY, token),) if token else ()


def is_router_call(metadata: Any) -> bool:  # noqa: ANN401 - grpc metadata
    """True when the call carries the router credential this worker was given (ENV_ROUTER_DIGEST), or
    when it was given none (a worker started on its own: any internal-token holder may act as router)."""
    digest = os.environ.get(ENV_ROUTER_DIGEST)
    if not digest:
        return True
    for key, value in metadata or ():
        if key == ROUTER_TOKEN_KEY:
            presented = value if isinstance(value, str) else value.decode("utf-8", "replace")
            return hmac.compare_digest(router_token_digest(presented), digest)
    return False


def _client_token() -> str | None:
    return internal_token() or _launcher_token


def _with_token(metadata: Any, token: str) -> list[tuple[str, Any]]:
    return [*(metadata or ()), (TOKEN_METADATA, token)]


class _TokenDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, token: str) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = _with_token(details.metadata, token)
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = getattr(details, "compression", None)


class _SyncTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(_TokenDetails(details, self._token), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(_TokenDetails(details, self._token), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001, ANN201
        return continuation(_TokenDetails(details, self._token), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # noqa: ANN001, ANN201
        return continuation(_TokenDetails(details, self._token), request_iterator)


def _aio_details(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), (TOKEN_METADATA, token))
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return await continuation(_aio_details(details, self._token), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return await continuation(_aio_details(details, self._token), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001, ANN201
        return await continuation(_aio_details(details, self._token), request_iterator)


def _aio_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor] | None:
    if token is None:
        return None
    return [_AioUnaryUnary(token), _AioUnaryStream(token), _AioStreamUnary(token)]


def _never(_data: bytes) -> None:  # a refused call's request is never deserialized
    return None


def refusal(handler: grpc.RpcMethodHandler, unary: Any, streaming: Any) -> grpc.RpcMethodHandler:  # noqa: ANN401
    """A handler that refuses a call without reading its request (`unary` / `streaming`: the aborting
    behaviours, for unary and streaming responses): declared request-streaming whatever the method,
    so gRPC does not take in (and buffer) the request message before the refusal; the call ends at
    once and its stream is reset. Reading first let unauthenticated 15 MiB messages hold ~19 MiB
    each (40 of them: +750 MiB) until the whole message had arrived. Both token checks use it."""
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, _never, handler.response_serializer)
    return grpc.stream_unary_rpc_method_handler(unary, _never, handler.response_serializer)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    yield  # pragma: no cover - makes this an async generator


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every internal call (health excepted) whose metadata lacks the token; constant-time."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("internal token must not be empty")
        self._expected = token.encode()

    def authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == TOKEN_METADATA:
                given = value if isinstance(value, bytes) else value.encode()
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        return refusal(handler, _deny, _deny_stream)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """The interceptors an internal server needs: the token check when a token is configured."""
    token = internal_token()
    return [InternalTokenInterceptor(token)] if token else []


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; False for everything else (0.0.0.0 and names included)."""
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind_allowed(host: str) -> None:
    """Refuse (ValueError) an internal bind beyond loopback without mTLS or an internal token."""
    if is_loopback(host) or internal_tls() is not None or internal_token():
        return
    raise ValueError(
        f"refusing to serve the internal plane on {host}, beyond loopback, without credentials: configure "
        f"an internal token ({ENV_TOKEN}, {ENV_TOKEN_FILE} or --internal-token-file) or internal mTLS "
        f"({ENV_CERT}, {ENV_KEY}, {ENV_CA}); see docs/security.md"
    )
