"""Issue 29 row 8, per API token: with several tokens (``--auth-tokens-file``), each naming a tenant,
a tenant's requests live in their own prefix-cache namespace. A real router (HTTP and gRPC) in front
of a real colocated worker on loopback: the same prompt is a cache hit within a tenant and none
across tenants, whatever `cache_salt` the requests carry."""

from __future__ import annotations

from pathlib import Path

import pytest
from security_helpers import TOKENS, assert_unknown_token_refused, cached_grpc, cached_http

from pdserve.router.config import RouterConfig
from pdserve.router.process import config_from_args, parse_args
from pdserve.transport import load_tenant_tokens


def test_tenants_share_the_prefix_cache_only_among_themselves(start_colocated, start_router) -> None:  # noqa: ANN001
    worker = start_colocated("--block-size", "4")
    server, _stub = start_router(
        RouterConfig(colocated=(worker.address,), http_port=0, auth_tokens=tuple(TOKENS.items()))
    )
    port = server.http_port
    assert cached_http(port, "token-of-alice") == 0
    assert cached_http(port, "token-of-bob") == 0  # the same prompt, another tenant: nothing shared
    assert cached_http(port, "token-of-bob", salt="alice") == 0  # nor by naming the other tenant as a salt
    assert cached_http(port, "token-of-alice") > 0  # within the tenant it is a hit
    assert cached_grpc(server.address, "token-of-bob") > 0  # gRPC: the tenant's namespace too
    # a request's own salt splits a tenant further
    assert cached_http(port, "token-of-alice", salt="team-1") == 0
    assert cached_http(port, "token-of-alice", salt="team-1") > 0
    # a token that is not in the file is refused on both APIs
    assert_unknown_token_refused(port, server.address)


def test_the_tokens_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# tenant token\nalice token-of-alice\n\nbob   token-of-bob\n")
    config = config_from_args(parse_args(["--auth-tokens-file", str(path)]))
    assert dict(config.auth_tokens) == TOKENS and config.api_tokens == TOKENS
    for bad in ("al/ice token\n", "alice\n", "alice t1\nbob t1\n", "alice t1\nalice t2\n", "# nothing\n"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            load_tenant_tokens(str(path))
    with pytest.raises(ValueError, match="exclude each other"):
        RouterConfig(auth_token="one", auth_tokens=(("t", "alice"),))
