"""The OpenAI HTTP front end against careless and hostile clients, with real HTTP on a real router
(no workers: a body that passes validation is answered 503 "no worker", so a 503 here means "got
through to routing"). Rows 3, 6 and 10 of issue 29's table:

- careless input (lone UTF-16 surrogates, token ids >= 2**31, JSON nested 100,000 deep, a bogus
  charset, a non-ASCII X-Request-Id) is a clean 400 (or, for the charset, served as UTF-8), never a 500;
- `metadata` and `user` are bounded; the bearer scheme is case-insensitive;
- idle, half-sent and post-401 connections are closed after the keep-alive time (5 s, uvicorn's);
  a body that does not arrive in time is a 408; connections over the cap get a 503 and are closed,
  and the server takes new ones once the others are gone.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest

from pdserve.router import http_api
from pdserve.router.config import RouterConfig
from pdserve.router.server import RouterServer, serve
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

MODEL = "m"
TOKEN = "s3cret-token"
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture
def start_router() -> Iterator[Callable[..., RouterServer]]:
    started: list[RouterServer] = []

    def start(**kwargs: object) -> RouterServer:
        server, _port = serve(RouterConfig(http_port=0, model_name=MODEL, info_timeout_s=0.5, **kwargs))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(None)


def post_raw(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def post(port: int, path: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    return post_raw(port, path, json.dumps(body).encode(), headers)


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/completions", b'{"model": "m", "prompt": "a \\ud800 b", "max_tokens": 3}'),
        ("/v1/completions", b'{"model": "m", "prompt": "hi", "stop": ["\\udfff"], "max_tokens": 3}'),
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "\\ud800", "content": "hi"}]}'),
    ],
)
def test_lone_surrogates_are_400(router: RouterServer, path: str, raw: bytes) -> None:
    status, body = post_raw(router.http_port, path, raw)
    assert status == 400, body
    assert "surrogate" in body["error"]["message"]


def test_a_valid_surrogate_pair_is_text(router: RouterServer) -> None:
    status, body = post_raw(
        router.http_port, "/v1/completions", b'{"model": "m", "prompt": "smile \\ud83d\\ude00", "max_tokens": 3}'
    )
    assert status == 503, body  # through validation: no worker to serve it


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"prompt": [1, 2**31]}, "prompt"),
        ("/v1/completions", {"prompt": [-1, 5]}, "prompt"),
        ("/v1/completions", {"stop_token_ids": [2**40]}, "stop_token_ids"),
        ("/v1/completions", {"allowed_token_ids": [2**31]}, "allowed_token_ids"),
        ("/v1/completions", {"logit_bias": {str(2**31): 1}}, "logit_bias"),
    ],
)
def test_token_ids_out_of_range_are_400(router: RouterServer, path: str, extra: dict, param: str) -> None:
    status, body = post(router.http_port, path, {**COMPLETION, **extra})
    assert status == 400 and body["error"]["param"] == param, body


def test_deeply_nested_json_is_400(router: RouterServer) -> None:
    deep = b'{"model": "m", "prompt": "hi", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = post_raw(router.http_port, "/v1/completions", deep)
    assert status == 400 and "nested too deeply" in body["error"]["message"], body


def test_a_bogus_charset_is_read_as_utf8(router: RouterServer) -> None:
    status, body = post(
        router.http_port,
        "/v1/completions",
        {**COMPLETION, "prompt": "naïve café"},
        {"Content-Type": "application/json; charset=bogus"},
    )
    assert status == 503, body  # parsed as UTF-8 (RFC 8259) and validated: no worker to serve it


def test_a_non_ascii_request_id_is_400(router: RouterServer) -> None:
    status, body = post(router.http_port, "/v1/completions", COMPLETION, {"X-Request-Id": "abc\xe9"})  # byte 0xE9
    assert status == 400 and "X-Request-Id" in body["error"]["message"], body
    status, _ = post(router.http_port, "/v1/completions", COMPLETION, {"X-Request-Id": "x" * 129})
    assert status == 400
    status, _ = post(router.http_port, "/v1/completions", COMPLETION, {"X-Request-Id": "fine-id-1"})
    assert status == 503


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": {"nested": "object"}}}, "metadata"),
        ({"metadata": ["not", "an", "object"]}, "metadata"),
        ({"user": "u" * 257}, "user"),
        ({"user": 5}, "user"),
        ({"cache_salt": 5}, "cache_salt"),
    ],
)
def test_ignored_labels_are_bounded(router: RouterServer, extra: dict, param: str) -> None:
    status, body = post(router.http_port, "/v1/chat/completions", {**CHAT, **extra})
    assert status == 400 and body["error"]["param"] == param, body


def test_a_cache_salt_is_bounded(router: RouterServer) -> None:
    status, body = post(router.http_port, "/v1/completions", {**COMPLETION, "cache_salt": "s" * 257})
    assert status == 400 and "cache_salt" in body["error"]["message"], body
    assert post(router.http_port, "/v1/completions", {**COMPLETION, "cache_salt": "tenant-7"})[0] == 503


def test_labels_within_bounds_pass(router: RouterServer) -> None:
    body = {**CHAT, "user": "user-42", "metadata": {f"k{i}": "v" * 512 for i in range(16)}}
    assert post(router.http_port, "/v1/chat/completions", body)[0] == 503


def test_bearer_scheme_is_case_insensitive(start_router) -> None:  # noqa: ANN001
    server = start_router(auth_token=TOKEN)
    for scheme in ("Bearer", "bearer", "BEARER"):
        status, body = post(server.http_port, "/v1/completions", COMPLETION, {"Authorization": f"{scheme} {TOKEN}"})
        assert status == 503, (scheme, body)  # authenticated; no worker
    for wrong in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, f"Bearer{TOKEN}"):
        assert post(server.http_port, "/v1/completions", COMPLETION, {"Authorization": wrong})[0] == 401, wrong
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = router_pb2_grpc.RouterStub(channel)
    request = router_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, metadata=(("authorization", f"bearer {TOKEN}"),), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # past authentication: no worker
    channel.close()


def test_grpc_priority_is_bounded(router: RouterServer) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{router.port}")
    stub = router_pb2_grpc.RouterStub(channel)
    for priority, code in (
        (101, grpc.StatusCode.INVALID_ARGUMENT),
        (-(2**31), grpc.StatusCode.INVALID_ARGUMENT),
        (100, grpc.StatusCode.UNAVAILABLE),
    ):
        request = router_pb2.GenerateRequest(
            prompt="hi", priority=priority, params=common_pb2.SamplingParams(max_tokens=2)
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=10))
        assert info.value.code() == code, (priority, info.value.details())
    channel.close()


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Read until the server closes the connection (True) or `seconds` pass (False); and what it sent."""
    sock.settimeout(0.5)
    received = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, received
        if not chunk:
            return True, received
        received += chunk
    return False, received


def test_idle_half_sent_and_refused_connections_are_closed(start_router) -> None:  # noqa: ANN001
    server = start_router(auth_token=TOKEN)
    port = server.http_port
    idle = socket.create_connection(("127.0.0.1", port))
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    refused = socket.create_connection(("127.0.0.1", port))
    body = json.dumps(COMPLETION).encode()
    refused.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    started = time.monotonic()
    results = {
        name: _closed_within(s, http_api.KEEPALIVE_S + 5)
        for name, s in (("idle", idle), ("half", half), ("401", refused))
    }
    assert all(closed for closed, _ in results.values()), results
    assert b" 401 " in results["401"][1].split(b"\r\n", 1)[0]  # answered first, then closed when idle
    assert time.monotonic() - started < http_api.KEEPALIVE_S + 5
    for s in (idle, half, refused):
        s.close()


def test_a_body_that_does_not_arrive_is_408(start_router, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(http_api, "BODY_TIMEOUT_S", 1.0)
    server = start_router()
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model": '
    )
    _closed, answer = _closed_within(sock, 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_connections_over_the_cap_get_503_and_the_server_recovers(
    start_router,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_api, "default_max_connections", lambda: 8)
    server = start_router()
    held = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(8)]
    time.sleep(0.3)
    extra = socket.create_connection(("127.0.0.1", server.http_port))
    closed, answer = _closed_within(extra, 5)
    extra.close()
    assert closed and answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    assert b"too many open connections" in answer
    for s in held:
        s.close()
    time.sleep(0.3)
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}/v1/completions",
        data=json.dumps(COMPLETION).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as info:  # served again: 503 "no worker", a JSON error object
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 503 and "worker" in json.loads(info.value.read())["error"]["message"]
