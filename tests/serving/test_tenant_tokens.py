"""Issue 29 row 8, per API token: with several tokens (``--auth-tokens-file``), each naming a tenant,
a tenant's requests live in their own prefix-cache namespace. A real router (HTTP and gRPC) in front
of a real colocated worker on loopback: the same prompt is a cache hit within a tenant and none
across tenants, whatever `cache_salt` the requests carry."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve.router.auth import load_tenant_tokens
from pdserve.router.config import RouterConfig
from pdserve.router.process import config_from_args, parse_args
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

TOKENS = {"token-of-alice": "alice", "token-of-bob": "bob"}
SECRET = "The PIN of the vault is 4711. " + " ".join(f"w{i}" for i in range(40))  # several blocks


def _post(port: int, token: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps({"model": "default", **body}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def _cached_http(port: int, token: str, salt: str | None = None) -> int:
    body = {"prompt": SECRET, "max_tokens": 2, "temperature": 0, **({"cache_salt": salt} if salt else {})}
    return _post(port, token, body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def _cached_grpc(address: str, token: str) -> int:
    request = router_pb2.GenerateRequest(prompt=SECRET, params=common_pb2.SamplingParams(max_tokens=2))
    with open_channel(address) as channel:
        answers = list(router_pb2_grpc.RouterStub(channel).Generate(
            request, timeout=120, metadata=(("authorization", f"Bearer {token}"),)))
    return answers[-1].usage.cached_tokens


def test_tenants_share_the_prefix_cache_only_among_themselves(start_colocated, start_router) -> None:  # noqa: ANN001
    worker = start_colocated("--block-size", "4")
    server, _stub = start_router(RouterConfig(colocated=(worker.address,), http_port=0,
                                              auth_tokens=tuple(TOKENS.items())))
    port = server.http_port
    assert _cached_http(port, "token-of-alice") == 0
    assert _cached_http(port, "token-of-bob") == 0  # the same prompt, another tenant: nothing shared
    assert _cached_http(port, "token-of-bob", salt="alice") == 0  # nor by naming the other tenant as a salt
    assert _cached_http(port, "token-of-alice") > 0  # within the tenant it is a hit
    assert _cached_grpc(server.address, "token-of-bob") > 0  # gRPC: the tenant's namespace too
    # a request's own salt splits a tenant further
    assert _cached_http(port, "token-of-alice", salt="team-1") == 0
    assert _cached_http(port, "token-of-alice", salt="team-1") > 0
    # a token that is not in the file is refused on both APIs
    with pytest.raises(urllib.error.HTTPError) as err:
        _cached_http(port, "token-of-mallory")
    assert err.value.code == 401
    err.value.close()
    with pytest.raises(grpc.RpcError) as rpc_err:
        _cached_grpc(server.address, "token-of-mallory")
    assert rpc_err.value.code() == grpc.StatusCode.UNAUTHENTICATED


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
