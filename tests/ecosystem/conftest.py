"""Shared fixtures of the HTTP API tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.server import RouterServer, serve

MODEL = "m"


@pytest.fixture(scope="module")
def router() -> Iterator[RouterServer]:
    """A router with the HTTP API on and no workers (its answers come before any worker is asked)."""
    server, _port = serve(RouterConfig(http_port=0, model_name=MODEL, info_timeout_s=0.5))
    try:
        yield server
    finally:
        server.stop(None)
