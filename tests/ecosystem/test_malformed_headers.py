"""What aiohttp's HTTP parser refuses gets the same JSON 400 as every other bad request, and one log
line without a traceback (issue 55, part 4), with real HTTP bytes on a socket to a real router (no
workers). Every control byte and DEL in a header value, bytes that are no ASCII, a bad request line,
a bad version and a header line over aiohttp's 8 KiB limit; the router keeps serving afterwards."""

from __future__ import annotations

import json
import logging
import socket

import pytest

from pdserve.router.server import RouterServer

# HTAB is legal in a header value (RFC 9110), so only X-Request-Id's own check refuses it: a case below;
# CR: its own case below
CONTROL_BYTES = [bytes([b]) for b in (*range(0x20), 0x7F) if b not in (0x09, 0x0D)]


def exchange(port: int, request: bytes, timeout_s: float = 10.0) -> bytes:
    """Send `request` raw, read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def json_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    assert headers.get("content-type", "").startswith("application/json"), answer[:400]
    return int(status_line.split()[1]), json.loads(body)


def post_with_header(name: bytes, value: bytes) -> bytes:
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 3}'
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + name
        + b": "
        + value
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def assert_quiet(caplog: pytest.LogCaptureFixture) -> None:
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [(r.name, r.levelname, r.getMessage()) for r in loud]


def assert_still_serving(port: int) -> None:
    answer = exchange(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    assert int(answer.split()[1]) in (200, 503), answer[:200]  # 503: no worker yet, but it answers


@pytest.mark.parametrize("byte", CONTROL_BYTES, ids=[f"0x{b[0]:02x}" for b in CONTROL_BYTES])
@pytest.mark.parametrize("header", [b"X-Request-Id", b"Authorization", b"X-Anything"])
def test_a_control_byte_in_a_header_is_a_json_400_and_one_quiet_line(
    router: RouterServer, caplog: pytest.LogCaptureFixture, header: bytes, byte: bytes
) -> None:
    caplog.set_level(logging.DEBUG)
    status, body = json_error(exchange(router.http_port, post_with_header(header, b"id" + byte + b"x")))
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    assert_quiet(caplog)
    assert_still_serving(router.http_port)


@pytest.mark.parametrize(
    "request_bytes",
    [
        post_with_header(b"X-Request-Id", b"a\rb"),  # CR without LF
        post_with_header(b"X-Request-Id", b"a\tb"),  # HTAB: legal HTTP, not a printable request id
        post_with_header(b"X-Request-Id", b"\xff\xfe\x80"),  # no UTF-8, no ASCII
        post_with_header(b"X-Request-Id", "caf\u00e9".encode()),  # UTF-8, not ASCII
        post_with_header(b"X-Request-Id", "caf\u00e9".encode("latin-1")),
        post_with_header(b"X-A\x7fB", b"v"),  # DEL in a header name
        post_with_header(b"X A", b"v"),  # a space in a header name
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/9.9\r\n\r\n",
        b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n",
    ],
    ids=[
        "cr",
        "tab-in-id",
        "bad-utf8",
        "utf8",
        "latin1",
        "del-in-name",
        "space-in-name",
        "no-method",
        "version",
        "nul-in-path",
        "long",
    ],  # fmt: skip
)
def test_every_malformed_request_is_a_json_400_and_one_quiet_line(
    router: RouterServer, caplog: pytest.LogCaptureFixture, request_bytes: bytes
) -> None:
    caplog.set_level(logging.DEBUG)
    status, body = json_error(exchange(router.http_port, request_bytes))
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert_quiet(caplog)
    assert_still_serving(router.http_port)
