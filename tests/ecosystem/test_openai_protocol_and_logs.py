"""Unit checks of the OpenAI request mapping, the gRPC -> HTTP error mapping and the log formats."""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from pdserve.router.openai_protocol import CHAT, COMPLETION, OpenAIError, error_from_grpc, parse_request
from pdserve.telemetry.logs import make_formatter


def test_completion_request_maps_to_grpc() -> None:
    parsed = parse_request(
        COMPLETION,
        {
            "model": "m",
            "prompt": ["hi"],
            "max_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": "x",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "m",
        "rid",
    )
    request = parsed.grpc_request
    assert request.request_id == "rid" and request.prompt == "hi" and parsed.stream and parsed.include_usage
    p = request.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, list(p.stop)) == (5, 0.5, 0.9, 3, ["x"])
    tokens = parse_request(COMPLETION, {"model": "m", "prompt": [[1, 2, 3]]}, "m", "r").grpc_request
    assert list(tokens.token_ids.ids) == [1, 2, 3] and not tokens.params.HasField("max_tokens")


def test_chat_request_maps_to_grpc() -> None:
    body = {
        "model": "m",
        "max_completion_tokens": 7,
        "stop": ["a", "b"],
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "x"}]},
        ],
    }
    request = parse_request(CHAT, body, "m", "r").grpc_request
    assert [(m.role, m.content) for m in request.messages.messages] == [("system", "be brief"), ("user", "hi x")]
    assert request.params.max_tokens == 7 and list(request.params.stop) == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"n": 0}, "n", 400),
        ({"n": 129}, "n", 400),
        ({"temperature": 3}, "temperature", 400),
        ({"temperature": "hot"}, "temperature", 400),
        ({"top_p": 0}, "top_p", 400),
        ({"max_tokens": 0}, "max_tokens", 400),
        ({"seed": -1}, "seed", 400),
        ({"stop": 5}, "stop", 400),
        ({"logprobs": 21}, "logprobs", 400),
        ({"logprobs": True}, "logprobs", 400),
        ({"top_logprobs": 2}, "top_logprobs", 400),
        ({"max_tokens": 0, "echo": False}, "max_tokens", 400),
        ({"echo": True, "stream": True}, "echo", 400),
        ({"best_of": 2}, "best_of", 400),
        ({"frequency_penalty": 2.5}, "frequency_penalty", 400),
        ({"bogus": 1}, "bogus", 400),
        ({"prompt": ["a", "b"]}, "prompt", 400),
        ({"model": "other"}, "model", 404),
    ],
)
def test_invalid_requests_name_the_field(body: dict[str, object], param: str, status: int) -> None:
    with pytest.raises(OpenAIError) as error:
        parse_request(COMPLETION, {"model": "m", "prompt": "hi", **body}, "m", "r")
    assert (error.value.status, error.value.param) == (status, param)
    assert set(error.value.body()["error"]) == {"message", "type", "param", "code"}


def test_logprob_fields_map_to_grpc() -> None:
    parsed = parse_request(
        COMPLETION, {"model": "m", "prompt": "hi", "logprobs": 3, "echo": True, "max_tokens": 0}, "m", "r"
    )
    p = parsed.grpc_request.params
    assert (p.logprobs, p.prompt_logprobs, p.max_tokens) == (3, 3, 1)
    assert parsed.logprobs and parsed.echo and parsed.drop_output
    plain = parse_request(COMPLETION, {"model": "m", "prompt": "hi", "logprobs": 0}, "m", "r")
    assert plain.grpc_request.params.logprobs == 0 and not plain.grpc_request.params.HasField("prompt_logprobs")
    chat = parse_request(
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 5},
        "m",
        "r",
    )
    assert chat.logprobs and chat.grpc_request.params.logprobs == 5
    for body in ({"top_logprobs": 2}, {"echo": True}, {"max_tokens": 0}):
        with pytest.raises(OpenAIError) as error:
            parse_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}, "m", "r")
        assert error.value.param == next(iter(body))


def test_grpc_status_maps_to_http() -> None:
    bad = error_from_grpc(grpc.StatusCode.INVALID_ARGUMENT, "params.top_k: must be >= 0, got -2")
    assert (bad.status, bad.param, bad.type) == (400, "top_k", "invalid_request_error")
    assert error_from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV pool full").status == 429
    assert error_from_grpc(grpc.StatusCode.UNAVAILABLE, "no worker").status == 503
    assert error_from_grpc(grpc.StatusCode.INTERNAL, "boom").status == 500


def _record() -> logging.LogRecord:
    return logging.makeLogRecord(
        {
            "name": "pdserve.trace",
            "levelname": "INFO",
            "levelno": logging.INFO,
            "msg": "Generate start request_id=%s",
            "args": ("abc",),
            "request_id": "abc",
        }
    )


def test_log_formats() -> None:
    doc = json.loads(make_formatter("decode-0", "json").format(_record()))
    assert doc["message"] == "Generate start request_id=abc" and doc["request_id"] == "abc"
    assert doc["process"] == "decode-0" and doc["level"] == "INFO" and "ts" in doc
    text = make_formatter("router", "text").format(_record())
    assert "[router " in text and "request_id=abc" in text
    with pytest.raises(ValueError):
        make_formatter("router", "xml")
