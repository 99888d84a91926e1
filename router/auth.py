"""Bearer-token authentication of the public Router API (gRPC and HTTP alike).

With a token configured, every call to a `pdserve.v1.Router` method must carry the metadata
`authorization: Bearer <token>` (HTTP: the `Authorization` header); anything else is refused with
UNAUTHENTICATED (HTTP 401) before any routing code runs. Health checks and reflection stay open
(load balancers and grpcurl need them). Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
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
    """One configured token and the constant-time check of a presented header value."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = token.encode()

    def accepts(self, header_value: str | bytes | None) -> bool:
        """`Bearer <token>`; the scheme is case-insensitive (RFC 7235), the token compared in constant time."""
        if header_value is None:
            return False
        given = header_value if isinstance(header_value, bytes) else header_value.encode("utf-8", "surrogateescape")
        scheme, _, credentials = given.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(credentials.strip(b" "), self._expected)

    def authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return self.accepts(value)
        return False


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self.token = BearerToken(token)

    def authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        return self.token.authorized(metadata)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        return refusal(handler, _deny, _deny_stream)


def load_token(path: str | None, env_value: str | None) -> str | None:
    """The token from a file (first line, stripped) or the environment; None when neither is set."""
    if path:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
        if not token:
            raise ValueError(f"auth token file {path} is empty")
        return token
    return env_value or None
