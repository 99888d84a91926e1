"""Bearer-token authentication of the public Router API (gRPC and HTTP alike).

With a token configured, every call to a `pdserve.v1.Router` method must carry the metadata
`authorization: Bearer <token>` (HTTP: the `Authorization` header); anything else is refused with
UNAUTHENTICATED (HTTP 401) before any routing code runs. Health checks and reflection stay open
(load balancers and grpcurl need them). Tokens are compared in constant time.

Several tokens, each naming a tenant (``--auth-tokens-file``, read by `pdserve.transport.load_tenant_tokens`),
put every request in its tenant's prefix-cache namespace: `RouterCore.generate` folds the tenant into the
request's `cache_salt` (`tenant_salt`), so tenants never share K/V blocks nor see each other's
`cached_tokens`. One token (``--auth-token-file``) names no tenant: its clients share one namespace.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from pdserve.transport import refusal

PROTECTED_PREFIX = "/pdserve.v1.Router/"
UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token (metadata 'authorization')"


async def _deny(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


async def _deny_stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    yield  # pragma: no cover - makes this an async generator, as streaming handlers are


class BearerToken:
    """The configured tokens (each with its tenant, or None for the single-token form) and the
    constant-time check of a presented header value."""

    def __init__(self, tokens: str | Mapping[str, str | None]) -> None:
        tokens = {tokens: None} if isinstance(tokens, str) else dict(tokens)
        if not tokens or not all(tokens):
            raise ValueError("auth token must not be empty")
        self._expected = [(token.encode(), tenant) for token, tenant in tokens.items()]

    def tenant_of(self, header_value: str | bytes | None) -> str | None:
        """The tenant of `Bearer <token>` ("" for a token naming none); None when it is refused. The
        scheme is case-insensitive (RFC 7235); every token is compared, in constant time."""
        if header_value is None:
            return None
        given = header_value if isinstance(header_value, bytes) else header_value.encode("utf-8", "surrogateescape")
        scheme, _, credentials = given.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        credentials = credentials.strip(b" ")
        found: str | None = None
        for expected, tenant in self._expected:
            if hmac.compare_digest(credentials, expected):
                found = tenant or ""
        return found

    def accepts(self, header_value: str | bytes | None) -> bool:
        return self.tenant_of(header_value) is not None

    def tenant_in(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
        """`tenant_of` the call's `authorization` metadata (None: refused)."""
        for key, value in metadata or ():
            if key == "authorization":
                return self.tenant_of(value)
        return None

    def authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        return self.tenant_in(metadata) is not None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str | Mapping[str, str | None]) -> None:
        self.token = BearerToken(token)

    def authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        return self.token.authorized(metadata)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        return refusal(handler, _deny, _deny_stream)


def tenant_salt(tenant: str, cache_salt: str) -> str:
    """The cache salt of a tenant's request: the tenant, then the request's own salt. Tenant names
    hold no "/", so two tenants' salts never coincide, whatever salts their requests carry."""
    return f"{tenant}/{cache_salt}"
