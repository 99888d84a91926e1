"""Strict OpenAI request schema, with real HTTP requests against a real router (no workers: a body
that passes validation is answered 503 "no worker", one that does not is answered 400 naming the field)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from pdserve.router.server import RouterServer

MODEL = "m"


def post(router: RouterServer, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{router.http_port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tool_choice", "auto"),
        ("tool_choice", "required"),  # without tools
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("top_logprobs", 2),
        ("store", True),
        ("reasoning_effort", "low"),
        ("service_tier", "flex"),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "x"}),
        ("prediction", {"type": "content"}),
        ("web_search_options", {}),
        ("n", 0),
        ("n", 129),
        ("n", True),
        ("definitely_not_a_field", 1),
        ("guided_decoding_backend", "x"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unimplemented_fields_are_refused_by_name(router: RouterServer, path: str, field: str, value: object) -> None:
    base = CHAT if "chat" in path else COMPLETION
    status, body = post(router, path, {**base, field: value})
    error = body["error"]
    assert status == 400, body
    assert error["param"] == field and field in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0),
        ("repetition_penalty", 3),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 101}),
        ("logit_bias", [5, 1]),
        ("logit_bias", {"5": True}),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", "5"),
        ("bad_words", "cat"),
        ("bad_words", [""]),
        ("skip_special_tokens", "no"),
    ],
)
def test_out_of_range_penalties_are_refused_by_name(router: RouterServer, field: str, value: object) -> None:
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        status, body = post(router, path, {**base, field: value})
        assert status == 400 and body["error"]["param"] == field, (path, body)


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]},
            "messages",
        ),
    ],
)
def test_bad_tool_fields_are_refused_by_name(router: RouterServer, extra: dict[str, object], param: str) -> None:
    status, body = post(router, "/v1/chat/completions", {**CHAT, **extra})
    assert status == 400 and body["error"]["param"] == param, body


def test_tools_are_refused_on_completions(router: RouterServer) -> None:
    status, body = post(router, "/v1/completions", {**COMPLETION, "tools": [TOOL]})
    assert status == 400 and body["error"]["param"] == "tools", body


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [TOOL]},
        {"tools": [TOOL], "tool_choice": "auto"},
        {"tools": [TOOL], "tool_choice": "required"},
        {
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
        },
        {"tools": [TOOL], "tool_choice": "none"},
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [TOOL],
        },
    ],
)
def test_tool_requests_pass_validation(router: RouterServer, extra: dict[str, object]) -> None:
    status, body = post(router, "/v1/chat/completions", {**CHAT, **extra})
    assert status == 503, (extra, body)


def test_unknown_stream_options_key_is_refused(router: RouterServer) -> None:
    status, body = post(
        router, "/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    )
    assert status == 400 and body["error"]["param"] == "stream_options"
    assert "continuous_usage_stats" in body["error"]["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {},  # what the official openai client sends when its caller passes nothing else
        {"stream": True},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"user": "alice", "metadata": {"k": "v"}, "parallel_tool_calls": True, "n": 1},
        {"n": 4, "seed": 3},
        {"include_stop_str_in_output": True, "spaces_between_special_tokens": False},
        {
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "tools": [],
            "logit_bias": {},
            "store": False,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "service_tier": "auto",
            "logprobs": False,
            "echo": False,
        },
        {"repetition_penalty": 1.0},  # vLLM's benchmark client (`vllm bench serve`) sends it on every request
        {
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "min_p": 0.05,
            "min_tokens": 2,
            "logit_bias": {"50": -100, "7": 2.5},
            "allowed_token_ids": [5, 6, 7],
            "bad_words": ["cat", "sat on"],
            "skip_special_tokens": False,
        },
        {
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 1,
            "stop": ["x"],
            "top_k": 5,
            "ignore_eos": True,
            "stop_token_ids": [2],
            "max_completion_tokens": 4,
        },
    ],
)
def test_implemented_and_harmless_fields_pass_validation(router: RouterServer, extra: dict[str, object]) -> None:
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        status, body = post(router, path, {**base, **extra})
        # validation passed; the router has no worker, so the answer is "unavailable"
        assert status == 503, (path, extra, body)
