"""/v1/responses, /tokenize and /detokenize over real HTTP against a real router with no workers: a
body that passes validation is answered 503 ("no worker"), one that does not 400 naming the field,
small bodies parsed in the router and large ones in its parser process alike."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from pdserve.router.server import RouterServer

MODEL = "m"
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 3}
LARGE = "word " * 20_000  # > http_api.INLINE_PARSE_BYTES: parsed in the parser process


def request(
    router: RouterServer, method: str, path: str, body: dict[str, object] | None = None
) -> tuple[int, dict[str, object]]:
    data = json.dumps(body).encode() if body is not None else None
    call = urllib.request.Request(
        f"http://127.0.0.1:{router.http_port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(call, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"stream": True},
        {"input": LARGE},
        {"instructions": "be brief", "temperature": 0, "top_p": 0.5, "seed": 1},
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}}},
        {
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
            ]
        },
        {"background": False, "store": False, "truncation": "disabled", "metadata": {"k": "v"}, "user": "u"},
    ],
)
def test_valid_bodies_reach_the_workers(router: RouterServer, extra: dict[str, object]) -> None:
    status, body = request(router, "POST", "/v1/responses", {**RESPONSE, **extra})
    assert status == 503, body  # validation passed; the router has no worker


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image"}]}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"bogus": 1}, "bogus"),
        ({"input": LARGE, "background": True}, "background"),  # refused by the parser process the same way
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(router: RouterServer, extra: dict[str, object], param: str) -> None:
    status, body = request(router, "POST", "/v1/responses", {**RESPONSE, **extra})
    error = body["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", body


def test_unknown_stored_responses_are_404(router: RouterServer) -> None:
    for method in ("GET", "DELETE"):
        status, body = request(router, method, "/v1/responses/resp_nothing")
        assert status == 404 and body["error"]["code"] == "response_not_found", body


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "hi"}),
        ("/tokenize", {"prompt": LARGE}),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}),
        ("/detokenize", {"tokens": [1, 2, 3]}),
    ],
)
def test_tokenizer_calls_need_a_serving_worker(router: RouterServer, path: str, body: dict[str, object]) -> None:
    status, answer = request(router, "POST", path, {"model": MODEL, **body})
    assert status == 503 and "tokenize" in answer["error"]["message"], answer


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "model"),
        ("/tokenize", {"model": MODEL, "prompt": LARGE, "bogus": 1}, 400, "bogus"),
        ("/detokenize", {"model": MODEL, "tokens": [2**31]}, 400, "tokens"),
    ],
)
def test_bad_tokenizer_calls_are_refused(
    router: RouterServer, path: str, body: dict[str, object], status: int, param: str
) -> None:
    got, answer = request(router, "POST", path, body)
    assert got == status and answer["error"]["param"] == param, answer
