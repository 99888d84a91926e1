"""Bearer-token authentication of the public Router API.

With a token configured, every call to a `pdserve.v1.Router` method must carry the metadata
`authorization: Bearer <token>`; anything else is refused with UNAUTHENTICATED before the servicer
runs. Health checks and reflection stay open (load balancers and grpcurl need them). Tokens are
compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

PROTECTED_PREFIX = "/pdserve.v1.Router/"


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (metadata 'authorization')")


class BearerTokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def authorized(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value if isinstance(value, bytes) else value.encode()
                return hmac.compare_digest(given, self._expected)
        return False

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _deny, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(_deny, handler.request_deserializer, handler.response_serializer)


def load_token(path: str | None, env_value: str | None) -> str | None:
    """The token from a file (first line, stripped) or the environment; None when neither is set."""
    if path:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
        if not token:
            raise ValueError(f"auth token file {path} is empty")
        return token
    return env_value or None
