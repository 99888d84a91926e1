"""Ecosystem acceptance, real processes on loopback (1 prefill + 1 decode worker, the default model):
the official `openai` client against the router's HTTP API, Prometheus metrics of all three processes,
and one request id traced through the JSON logs of router, prefill and decode worker."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.cluster.launch import local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

PROMPT = "The river ran past the old mill, and the children"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[LocalCluster]:
    config = local_deployment(
        prefill=1,
        decode=1,
        threads_per_worker=1,
        http_port=0,
        metrics=True,
        log_format="json",
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )
    with LocalCluster(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def grpc_generate(
    cluster: LocalCluster,
    max_tokens: int,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    **params: object,
) -> tuple[str, common_pb2.Usage]:
    request = router_pb2.GenerateRequest(params=common_pb2.SamplingParams(max_tokens=max_tokens, **params))
    if prompt is not None:
        request.prompt = prompt
    else:
        request.messages.messages.extend(common_pb2.ChatMessage(**m) for m in messages or [])
    with grpc.insecure_channel(cluster.router_address) as channel:
        responses = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))
    return "".join(r.text for r in responses), responses[-1].usage


def _infos(cluster: LocalCluster) -> dict[str, worker_pb2.InfoResponse]:
    """Each worker's GetInfo, by role (one worker per role here)."""
    infos = {}
    for worker in cluster.workers:
        with open_channel(worker.address) as channel:  # workers need the launcher's internal token
            stub_cls = (
                worker_pb2_grpc.PrefillWorkerStub if worker.role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
            )
            infos[worker.role] = stub_cls(channel).GetInfo(worker_pb2.InfoRequest(), timeout=10)
    return infos


def wait_idle(cluster: LocalCluster, timeout: float = 30) -> None:
    """Poll every worker's GetInfo until it holds no KV block and no request."""
    deadline = time.monotonic() + timeout
    while True:
        infos = _infos(cluster).values()
        if all(i.kv_blocks_used == 0 and i.running_requests == 0 and i.queue_depth == 0 for i in infos):
            return
        assert time.monotonic() < deadline, f"workers not idle: {infos}"
        time.sleep(0.2)


def test_models_and_health(cluster: LocalCluster, model: str) -> None:
    assert model == "SmolLM2-135M-Instruct"  # the model folder's name
    with urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=10) as answer:
        assert answer.status == 200 and json.loads(answer.read())["status"] == "ok"


def test_completion_equals_grpc_path(cluster: LocalCluster, client: openai.OpenAI, model: str) -> None:
    want_text, want_usage = grpc_generate(cluster, 12, prompt=PROMPT, temperature=0.0)
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want_text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want_usage.prompt_tokens, 12)
    assert got.usage.total_tokens == want_usage.prompt_tokens + 12
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == want_usage.prompt_tokens


def test_chat_equals_grpc_path(cluster: LocalCluster, client: openai.OpenAI, model: str) -> None:
    want_text, want_usage = grpc_generate(cluster, 16, messages=MESSAGES, temperature=0.0)
    got = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=16, temperature=0, seed=7
    )
    assert got.choices[0].message.content == want_text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == want_usage.prompt_tokens
    assert got.usage.completion_tokens == want_usage.completion_tokens
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_text
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_stop_string_finishes_with_stop(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full.split()[2]
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzzq"])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == full[: full.index(stop)]


def test_closing_stream_mid_way_frees_blocks(cluster: LocalCluster, client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 3:
            break
    stream.close()
    assert received == 3
    wait_idle(cluster)


def test_errors_have_openai_shape(cluster: LocalCluster, client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as n2:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=129)  # OpenAI's bound is 128
    assert n2.value.status_code == 400
    error = n2.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "n"
    assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as hot:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=7.5)
    assert hot.value.response.json()["error"]["param"] == "temperature" and "temperature" in hot.value.message
    for unsupported in ({"best_of": 3}, {"logit_bias": {"1": 500}}, {"logprobs": 21}):  # logprobs 0-20 only
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4, **unsupported)
    # the official client's penalty and bias arguments are served (their semantics: tests/engine/test_penalties.py)
    served = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={"1": 5},
        extra_body={"min_tokens": 4, "repetition_penalty": 1.1},
    )
    assert served.usage is not None and served.usage.completion_tokens == 4 and served.choices[0].text
    with pytest.raises(openai.BadRequestError) as tools:  # a named function that is not among the tools
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tool_choice={"type": "function", "function": {"name": "g"}},
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
        )
    assert tools.value.response.json()["error"]["param"] == "tool_choice"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)


def _scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    samples: dict[str, float] = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_move_with_traffic(cluster: LocalCluster, client: openai.OpenAI, model: str) -> None:
    addresses = cluster.metrics_addresses
    assert set(addresses) == {"router", "prefill-0", "decode-0"}
    before = {name: _scrape(address) for name, address in addresses.items()}
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    wait_idle(cluster)
    after = {name: _scrape(address) for name, address in addresses.items()}

    def moved(process: str, key: str) -> float:
        return after[process][key] - before[process].get(key, 0.0)

    assert moved("router", "pdserve_time_to_first_token_seconds_count") == 1
    assert moved("router", "pdserve_e2e_request_latency_seconds_count") == 1
    assert moved("router", "pdserve_inter_token_latency_seconds_count") == 7
    assert moved("router", "pdserve_prompt_tokens_total") == got.usage.prompt_tokens
    assert moved("router", "pdserve_generation_tokens_total") == 8
    assert "pdserve_failovers_total" in after["router"]
    assert moved("prefill-0", "pdserve_prefill_batch_size_count") >= 1
    assert moved("prefill-0", "pdserve_request_queue_time_seconds_count") == 1
    assert moved("prefill-0", "pdserve_prompt_tokens_total") == got.usage.prompt_tokens
    # the workers share this host, so the decode worker asked for the shared-memory backend
    assert moved("prefill-0", "pdserve_kv_transfer_bytes_total{backend=shm,direction=send}") > 0
    assert moved("prefill-0", "pdserve_kv_transfer_seconds_count{backend=shm,direction=send}") == 1
    assert moved("decode-0", "pdserve_kv_transfer_bytes_total{backend=shm,direction=receive}") == moved(
        "prefill-0", "pdserve_kv_transfer_bytes_total{backend=shm,direction=send}"
    )
    assert moved("decode-0", "pdserve_generation_tokens_total") == 8
    assert moved("decode-0", "pdserve_decode_batch_size_count") >= 7
    assert after["decode-0"]["pdserve_kv_blocks_total"] > 0 and after["decode-0"]["pdserve_kv_blocks_used"] == 0
    assert after["decode-0"]["pdserve_num_requests_running"] == 0


def test_request_id_in_every_process_log(cluster: LocalCluster, client: openai.OpenAI, model: str) -> None:
    request_id = f"trace-{uuid.uuid4().hex[:12]}"
    got = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, extra_headers={"X-Request-Id": request_id}
    )
    assert got.id == f"cmpl-{request_id}"
    wait_idle(cluster)
    deadline = time.monotonic() + 10
    internal_id = ""
    for name in ("router", "prefill-0", "decode-0"):  # the router names the internal id the workers key on
        traced = request_id if name == "router" else internal_id
        while True:
            records = _json_records(cluster.log_dir / f"{name}.log")
            mine = [r for r in records if r.get("request_id") == traced]
            events = [r["message"].split()[1] for r in mine]
            if "finish" in events or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "start" in events and "finish" in events, f"{name}: {events}"
        assert all(r["process"] == name for r in records)
        if name == "router":
            internal_id = next(str(r["internal_id"]) for r in mine if "internal_id" in r)
            assert internal_id and internal_id != request_id
        if name == "decode-0":  # the client's id travels to the decode worker as a label
            assert any(r.get("client_request_id") == request_id for r in mine)


def _json_records(path: Path) -> list[dict[str, object]]:
    """Every log line that a logger wrote, parsed (each must be one JSON object)."""
    records = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    assert records, f"no JSON log lines in {path}"
    return records


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Madrid"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "capital"],
    "additionalProperties": False,
}


def test_json_schema_outputs_through_both_phases(client: openai.OpenAI, model: str) -> None:
    """50 `response_format: json_schema` chats at temperature 1.0 on the default model, 1P1D (the first
    token is constrained on the prefill worker, the rest on the decode worker): every answer parses
    and validates against the schema."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": STRUCTURED_SCHEMA, "strict": True}}

    def ask(i: int) -> str:
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Name a European capital ({i})."}],
            max_tokens=64,
            temperature=1.0,
            seed=i,
            response_format=fmt,
        )  # type: ignore[arg-type]
        assert answer.choices[0].finish_reason == "stop"
        return answer.choices[0].message.content or ""

    with ThreadPoolExecutor(16) as pool:
        contents = list(pool.map(ask, range(50)))
    for content in contents:
        jsonschema.validate(json.loads(content), STRUCTURED_SCHEMA)


def test_choice_regex_and_bad_schema(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is the sea blue?"}],
        max_tokens=8,
        stream=True,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "sometimes"]}},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("yes", "no", "sometimes")
    completion = client.completions.create(
        model=model, prompt="A code:", max_tokens=12, temperature=1.0, extra_body={"guided_regex": "[A-Z]{2}-[0-9]{4}"}
    )
    import re

    assert re.fullmatch("[A-Z]{2}-[0-9]{4}", completion.choices[0].text)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            response_format={
                "type": "json_schema",  # type: ignore[arg-type]
                "json_schema": {"name": "x", "schema": {"type": "bogus"}},
            },
        )
    assert "json_schema" in str(info.value) and "bogus" in str(info.value)


def test_n_choices_prefill_the_prompt_once(cluster: LocalCluster, client: openai.OpenAI, model: str) -> None:
    """n=4: four choices, the prompt computed once on the prefill worker; the decode worker computes
    only the last partial block of each other choice (the rest comes from its prefix cache). With a
    seed the four are reproducible."""
    wait_idle(cluster)
    before = _infos(cluster)
    messages = [{"role": "user", "content": f"Tell me a short story about a fox. {uuid.uuid4().hex}"}]
    # ignore_eos: a sampled EOS would end a choice early (the prompt is new each run)
    answer = client.chat.completions.create(
        model=model, messages=messages, n=4, max_tokens=12, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )  # type: ignore[arg-type]
    after = _infos(cluster)
    assert sorted(c.index for c in answer.choices) == [0, 1, 2, 3]
    prompt_tokens = answer.usage.prompt_tokens
    assert answer.usage.completion_tokens == 4 * 12 and answer.usage.total_tokens == prompt_tokens + 48
    prefilled = after["prefill"].prefill_tokens_computed - before["prefill"].prefill_tokens_computed
    on_decode = after["decode"].prefill_tokens_computed - before["decode"].prefill_tokens_computed
    # once: the prompt less what the prefill worker had cached (the chat template's system turn, which
    # earlier requests share); twice would be more than the whole prompt
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached < prompt_tokens / 2 and prompt_tokens - cached <= prefilled <= prompt_tokens, (prefilled, cached)
    assert 3 <= on_decode <= 3 * 16, on_decode  # < one block (16 tokens) per choice after the first
    texts = [c.message.content for c in sorted(answer.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # seeds seed + i: different draws
    again = client.chat.completions.create(
        model=model, messages=messages, n=4, max_tokens=12, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )  # type: ignore[arg-type]
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts
    # streamed: every chunk names its choice, each choice finishes once, usage counts all of them
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, n=3, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1, 2] and chunks[-1].usage.completion_tokens == 18
    streamed = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    }
    greedy = grpc_generate(cluster, 6, messages=messages)[0]
    assert streamed == {0: greedy, 1: greedy, 2: greedy}  # greedy: three times the one answer
    wait_idle(cluster)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_against_the_schema(
    client: openai.OpenAI, model: str, stream: bool, choice: object
) -> None:
    """`tool_choice` required or named on the default model (its template knows no tools): the
    official client gets `tool_calls` whose arguments validate against the function's schema."""
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = {
        "model": model,
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "tool_choice": choice,
        "max_tokens": 96,
        "temperature": 0.7,
        "seed": 5,
    }
    if stream:
        calls: dict[int, dict[str, str]] = {}
        reason = None
        for part in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
            for delta in part.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            reason = part.choices[0].finish_reason or reason
        found = [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        answer = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        reason = answer.choices[0].finish_reason
        found = [(c.id, c.function.name, c.function.arguments) for c in answer.choices[0].message.tool_calls or []]
    assert found and reason == ("tool_calls" if choice == "required" else "stop")
    for call_id, name, arguments in found:
        assert call_id.startswith("call_") and name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])


def test_tool_conversation_round_trip(client: openai.OpenAI, model: str) -> None:
    """A tool result fed back: the conversation with an assistant tool call and a tool turn renders and
    is answered (auto: text or a call, never an error)."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    answer = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],  # type: ignore[arg-type]
        max_tokens=24,
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
