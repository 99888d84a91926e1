"""The Responses API and vLLM's tokenizer endpoints, end to end: the official `openai` client against
real processes on loopback (1 prefill + 1 decode worker, the default model, whose chat template
matters here), behind a bearer token. One cluster for the module.

What is compared is exact where it can be: greedy Responses text equals chat completions' for the
same messages; a streamed answer's deltas equal the answer; `usage.input_tokens` equals /tokenize's
count of the conversation the router sent (so instructions, a previous response and tool turns are
shown to be in the prompt, in the right order)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.launch import local_deployment
from pdserve.cluster.local import LocalCluster

from e2e_helpers import wait_idle

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

pytestmark = pytest.mark.slow

TOKEN = "responses-test-token"
MODEL = "SmolLM2-135M-Instruct"  # the model folder's name
SYSTEM = "You answer in one short sentence."
QUESTION = "What colour is the sky on a clear day?"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Madrid"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
    },
    "required": ["city", "population_millions"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[LocalCluster]:
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN)
    config = local_deployment(prefill=1, decode=1, threads_per_worker=1, http_port=0, auth_token_file=str(token_file))
    with LocalCluster(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def post(cluster: LocalCluster, path: str, body: dict[str, Any], token: str | None = TOKEN) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(
        f"http://{cluster.http_address}{path}", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def token_count(cluster: LocalCluster, messages: list[dict[str, Any]]) -> int:
    status, body = post(cluster, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, body
    return body["count"]


def test_text_and_instructions(cluster: LocalCluster, client: openai.OpenAI) -> None:
    plain = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=16, temperature=0)
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.output_text
    assert plain.status in ("completed", "incomplete") and plain.output[0].type == "message"
    usage = plain.usage
    assert usage.input_tokens == token_count(cluster, [{"role": "user", "content": "Say hi"}])
    assert 0 < usage.output_tokens <= 16 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    instructed = client.responses.create(
        model=MODEL, instructions=SYSTEM, input="Say hi", max_output_tokens=16, temperature=0
    )
    assert instructed.instructions == SYSTEM and instructed.output_text
    # the instructions replace the template's default system turn
    assert instructed.usage.input_tokens == token_count(
        cluster, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hi"}]
    )


def test_greedy_text_equals_chat_completions(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    answer = client.responses.create(
        model=MODEL,
        input=[{"role": "developer", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_output_tokens=24,
        temperature=0,
    )
    assert answer.output_text == chat.choices[0].message.content
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert answer.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if answer.status == "incomplete":
        assert answer.incomplete_details.reason == "max_output_tokens"


def test_stream_deltas_equal_the_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "instructions": SYSTEM,
        "input": QUESTION,
        "max_output_tokens": 64,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed", whole  # the answer ends before the limit (get_final_response needs it)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id != whole.id


def test_closing_a_stream_mid_way_frees_the_workers(cluster: LocalCluster, client: openai.OpenAI) -> None:
    stream = client.responses.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    deltas = 0
    for event in stream:
        deltas += event.type == "response.output_text.delta"
        if deltas == 3:
            break
    stream.close()
    assert deltas == 3
    wait_idle([(w.role, w.address) for w in cluster.workers])


def test_json_schema_format_validates(client: openai.OpenAI) -> None:
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    for seed in range(2):
        answer = client.responses.create(
            model=MODEL,
            input="Name a European capital.",
            text=fmt,
            max_output_tokens=64,
            temperature=1.0,
            extra_body={"seed": seed},
        )
        assert answer.status == "completed" and answer.text.format.type == "json_schema"
        jsonschema.validate(json.loads(answer.output_text), CITY)

    class City(pydantic.BaseModel):
        city: str
        population_millions: int

    parsed = client.responses.parse(
        model=MODEL, input="Name a European capital.", text_format=City, max_output_tokens=64, temperature=0
    )
    assert isinstance(parsed.output_parsed, City)


def test_function_tool_round_trip(cluster: LocalCluster, client: openai.OpenAI) -> None:
    """A forced call comes back as a `function_call` item whose arguments validate; its output is
    accepted on the next turn, through previous_response_id and as explicit input items, and both
    ways give the model the same prompt."""
    question = {"role": "user", "content": "What is the weather in Paris?"}
    called = client.responses.create(
        model=MODEL, input=[question], tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=96, temperature=0
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and called.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees and sunny"}
    chained = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[result],
        tools=[WEATHER_TOOL],
        max_output_tokens=24,
        temperature=0,
    )
    explicit_input = [
        question,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result,
    ]
    explicit = client.responses.create(
        model=MODEL, input=explicit_input, tools=[WEATHER_TOOL], max_output_tokens=24, temperature=0
    )
    assert chained.previous_response_id == called.id and chained.status in ("completed", "incomplete")
    assert chained.usage.input_tokens == explicit.usage.input_tokens > called.usage.input_tokens
    assert [(i.type, getattr(i, "arguments", None)) for i in chained.output] == [
        (i.type, getattr(i, "arguments", None)) for i in explicit.output
    ]
    assert chained.output_text == explicit.output_text
    named = client.responses.create(
        model=MODEL,
        input=[question],
        tools=[WEATHER_TOOL],
        max_output_tokens=96,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    )
    assert [i.type for i in named.output] == ["function_call"]
    jsonschema.validate(json.loads(named.output[0].arguments), WEATHER)


def test_streamed_tool_call(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Rome?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=96,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [i.type for i in final.output] == ["function_call"] and final.output[0].arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_previous_response_id_and_store(cluster: LocalCluster, client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, instructions=SYSTEM, input="My name is Ada.", max_output_tokens=12, temperature=0
    )
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="What is my name?", max_output_tokens=12, temperature=0
    )
    # the earlier turns, without the earlier instructions (as OpenAI), then the new input
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == token_count(cluster, conversation)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as missing:
        client.responses.create(model=MODEL, previous_response_id=unstored.id, input="Hi", max_output_tokens=4)
    assert missing.value.response.json()["error"]["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("background", True),
        ("reasoning", {"effort": "high"}),
        ("include", ["message.output_text.logprobs"]),
        ("tools", [{"type": "web_search"}]),
        ("truncation", "auto"),
        ("top_logprobs", 3),
    ],
)
def test_unsupported_fields_are_refused_by_name(client: openai.OpenAI, field: str, value: object) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, **{field: value})
    error = refused.value.response.json()["error"]
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).output_text  # still serving


def test_auth_is_required(cluster: LocalCluster) -> None:
    stranger = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        stranger.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for path, body in (
        ("/tokenize", {"model": MODEL, "prompt": "hi"}),
        ("/detokenize", {"model": MODEL, "tokens": [1]}),
    ):
        assert post(cluster, path, body, token=None)[0] == 401
        assert post(cluster, path, body, token="wrong")[0] == 401
    with urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=10) as answer:
        assert answer.status == 200


def test_tokenize_and_detokenize_round_trip_the_chat_prompt(
    cluster: LocalCluster, client: openai.OpenAI, default_tokenizer: Any
) -> None:  # noqa: ANN401
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    rendered = default_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    status, tokens = post(cluster, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, tokens
    assert tokens["tokens"] == default_tokenizer(rendered, add_special_tokens=False).input_ids
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 8192
    status, text = post(cluster, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert status == 200 and text == {"prompt": rendered}
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == tokens["count"]
    without = post(cluster, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False})[1]
    assert rendered.startswith(post(cluster, "/detokenize", {"model": MODEL, "tokens": without["tokens"]})[1]["prompt"])
    assert without["count"] < tokens["count"]
    status, prompt = post(cluster, "/tokenize", {"model": MODEL, "prompt": "The river ran"})
    assert status == 200 and prompt["tokens"] == default_tokenizer("The river ran").input_ids


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "hi", "return_token_strs": True}, "return_token_strs"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),  # beyond the vocabulary: the worker's refusal
    ],
)
def test_bad_tokenizer_requests_are_400(cluster: LocalCluster, path: str, body: dict[str, Any], param: str) -> None:
    status, answer = post(cluster, path, {"model": MODEL, **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert post(cluster, "/detokenize", {"model": MODEL, "tokens": [1, 2]})[0] == 200  # still serving
