"""The Responses API, the pure parts: a Responses body into the chat request it becomes, the answer
object, the numbered stream of events (text, tool calls, a cut output, an error), the conversation a
stored response continues, the bounded store, and the tokenizer endpoints' request shapes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.router import tools
from pdserve.router.core import RouterError
from pdserve.router.openai_protocol import OpenAIError
from pdserve.router.response_store import ResponseStore
from pdserve.router.responses_api import (
    ResponsesRequest,
    ResponseStream,
    answer,
    continue_conversation,
    output_turn,
    parse_responses,
)
from pdserve.router.tokenize_api import parse_detokenize, parse_tokenize
from pdserve.v1 import common_pb2, router_pb2

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _parse(**fields: object) -> ResponsesRequest:
    return parse_responses({"model": "m", "input": "hi", **fields}, "m", "rid")


def _turns(parsed: ResponsesRequest) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in parsed.chat.grpc_request.messages.messages]


def test_a_string_input_with_instructions_is_a_system_and_a_user_turn() -> None:
    parsed = _parse(
        instructions="be brief",
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        stop=["x"],
        seed=3,
        metadata={"k": "v"},
        user="u",
    )
    assert _turns(parsed) == [("system", "be brief"), ("user", "hi")]
    params = parsed.chat.grpc_request.params
    assert (params.max_tokens, params.temperature, params.top_p, list(params.stop), params.seed) == (
        7,
        0.5,
        0.9,
        ["x"],
        3,
    )
    assert parsed.options.store and parsed.options.has_instructions and parsed.options.response_id.startswith("resp_")
    assert parsed.options.echo["metadata"] == {"k": "v"} and parsed.options.echo["max_output_tokens"] == 7


def test_items_become_turns_and_calls_join_the_assistant_turn() -> None:
    parsed = _parse(
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"role": "user", "content": "weather?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        ],
        tools=[WEATHER],
    )
    messages = parsed.chat.grpc_request.messages.messages
    assert _turns(parsed) == [
        ("system", "rules"),
        ("user", "weather?"),
        ("assistant", "Let me look."),
        ("tool", "sunny"),
        ("tool", "rain"),
    ]
    calls = json.loads(messages[2].tool_calls_json)
    assert [(c["id"], c["function"]["name"]) for c in calls] == [("call_1", "get_weather"), ("call_2", "get_weather")]
    assert (messages[3].tool_call_id, messages[4].tool_call_id) == ("call_1", "call_2")
    chat_tools = json.loads(parsed.chat.grpc_request.messages.tools_json)
    assert chat_tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}
    ]
    assert parsed.chat.tools == tools.ToolMode(tools.AUTO, ("get_weather",))


def test_text_format_and_tool_choice_map_to_chat_constraints() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    parsed = _parse(text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}})
    assert json.loads(parsed.chat.grpc_request.params.structured.json_schema) == schema
    assert _parse(text={"format": {"type": "json_object"}}).chat.grpc_request.params.structured.json_object
    assert not _parse(text={"format": {"type": "text"}}).chat.grpc_request.params.HasField("structured")
    named = _parse(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert named.chat.tools.kind == tools.NAMED
    assert json.loads(named.chat.grpc_request.params.structured.json_schema) == WEATHER["parameters"]
    assert _parse(tools=[WEATHER], tool_choice="none").chat.tools is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "p"}}, "prompt"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
        ({"n": 2}, "n"),
        ({"not_a_field": 1}, "not_a_field"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools"),
        ({"tools": [{"type": "file_search"}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{**WEATHER, "extra": 1}]}, "tools"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "other"}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"type": "input_image"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # no call_id
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"instructions": ["not", "a", "string"]}, "instructions"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"text": {"verbosity": "high"}}, "text"),
        ({"text": "json"}, "text"),
        ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"store": "yes"}, "store"),
        ({"previous_response_id": 5}, "previous_response_id"),
        ({"metadata": {"k": 5}}, "metadata"),
        ({"safety_identifier": "x" * 300}, "safety_identifier"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_unsupported_and_bad_fields_are_refused_by_name(fields: dict[str, object], param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        _parse(**fields)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
    assert refused.value.message.startswith(param) or param in refused.value.message


def test_off_values_and_labels_are_accepted() -> None:
    _parse(
        background=False,
        include=[],
        truncation="disabled",
        reasoning={"effort": None},
        service_tier="auto",
        top_logprobs=0,
        stream_options={},
        store=False,
        parallel_tool_calls=True,
        safety_identifier="s",
        prompt_cache_key="k",
        user="u",
        stream=True,
        top_k=5,
        ignore_eos=True,
        min_tokens=1,
    )


def test_a_wrong_model_is_404() -> None:
    with pytest.raises(OpenAIError) as wrong:
        parse_responses({"model": "other", "input": "hi"}, "m", "r")
    assert wrong.value.status == 404


def _usage(prompt: int, completion: int) -> dict[str, object]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_the_answer_has_a_message_or_calls_and_the_responses_usage() -> None:
    plain = answer(_parse(), "m", "Hello", "stop", _usage(5, 2))
    assert plain["status"] == "completed" and plain["incomplete_details"] is None
    assert [i["type"] for i in plain["output"]] == ["message"] and plain["output"][0]["content"][0]["text"] == "Hello"
    assert plain["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 1},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 7,
    }
    cut = answer(_parse(), "m", "Hel", "length", _usage(5, 2))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    called = answer(_parse(tools=[WEATHER]), "m", text, "stop", _usage(5, 9))
    assert [i["type"] for i in called["output"]] == ["message", "function_call"]
    call = called["output"][1]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    named = answer(
        _parse(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}),
        "m",
        '{"city": "Rome"}',
        "stop",
        _usage(5, 4),
    )
    assert [i["type"] for i in named["output"]] == ["function_call"]


async def _responses(*items: router_pb2.GenerateResponse) -> AsyncIterator[router_pb2.GenerateResponse]:
    for item in items:
        yield item


def _piece(text: str, reason: int = 0) -> router_pb2.GenerateResponse:
    response = router_pb2.GenerateResponse(text=text)
    if reason:
        response.finish_reason = reason
        response.usage.prompt_tokens, response.usage.completion_tokens = 5, 3
    return response


def _events(parsed: ResponsesRequest, *items: router_pb2.GenerateResponse) -> tuple[list[dict], ResponseStream]:
    stream = ResponseStream(parsed, "m")

    async def run() -> list[dict]:
        return [e async for e in stream.events(items[0], _responses(*items[1:]))]

    return asyncio.run(run()), stream


def test_streamed_text_is_numbered_and_equals_the_final_answer() -> None:
    events, stream = _events(_parse(), _piece("Hel"), _piece("lo"), _piece("", common_pb2.FINISH_REASON_STOP))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[6]["text"] == "Hello" and events[-1]["response"] == stream.answer
    assert stream.answer["output"][0]["content"][0]["text"] == "Hello"
    assert stream.answer["usage"]["output_tokens"] == 3
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {stream.answer["output"][0]["id"]}


def test_a_cut_stream_is_incomplete_and_an_empty_one_still_has_a_message() -> None:
    events, stream = _events(_parse(), _piece("Hel", common_pb2.FINISH_REASON_LENGTH))
    assert events[-1]["type"] == "response.incomplete"
    assert stream.answer["incomplete_details"] == {"reason": "max_output_tokens"}
    events, stream = _events(_parse(), _piece("", common_pb2.FINISH_REASON_STOP))
    assert [i["type"] for i in stream.answer["output"]] == ["message"] and events[-1]["type"] == "response.completed"


def test_streamed_calls_are_items_with_argument_deltas() -> None:
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    events, stream = _events(
        _parse(tools=[WEATHER]), _piece(text[:12]), _piece(text[12:]), _piece("", common_pb2.FINISH_REASON_STOP)
    )
    assert [i["type"] for i in stream.answer["output"]] == ["message", "function_call"]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["message", "function_call"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(deltas) == {"city": "Paris"} and stream.answer["output"][1]["arguments"] == deltas
    named = _parse(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    events, stream = _events(named, _piece('{"city"'), _piece(': "Rome"}'), _piece("", common_pb2.FINISH_REASON_STOP))
    assert [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"] == [
        '{"city"',
        ': "Rome"}',
    ]
    assert stream.answer["output"][0]["arguments"] == '{"city": "Rome"}'


def test_an_error_mid_stream_is_response_failed() -> None:
    async def failing() -> AsyncIterator[router_pb2.GenerateResponse]:
        yield _piece("lo")
        raise RouterError(grpc.StatusCode.UNAVAILABLE, "decode worker gone")

    stream = ResponseStream(_parse(), "m")

    async def run() -> list[dict]:
        return [e async for e in stream.events(_piece("Hel"), failing())]

    events = asyncio.run(run())
    assert events[-1]["type"] == "response.failed" and stream.answer is None
    assert events[-1]["response"]["error"] == {"code": "unavailable", "message": "decode worker gone"}


def test_a_previous_conversation_goes_between_instructions_and_input() -> None:
    first = _parse(instructions="old rules", input="My name is Ada.")
    turn = continue_conversation(first, ())
    assert [(m.role, m.content) for m in turn] == [("user", "My name is Ada.")]
    conversation = (*turn, output_turn(answer(first, "m", "Hi Ada.", "stop", _usage(5, 3))["output"]))
    second = _parse(instructions="new rules", input="What is my name?")
    continue_conversation(second, conversation)
    assert _turns(second) == [
        ("system", "new rules"),
        ("user", "My name is Ada."),
        ("assistant", "Hi Ada."),
        ("user", "What is my name?"),
    ]
    called = answer(
        _parse(tools=[WEATHER]),
        "m",
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
        "stop",
        _usage(5, 3),
    )
    turn = output_turn(called["output"])
    assert turn.role == "assistant" and json.loads(turn.tool_calls_json)[0]["id"] == called["output"][0]["call_id"]


def test_the_store_is_bounded_and_per_tenant() -> None:
    store = ResponseStore(max_responses=2, max_bytes=1000)
    turn = (common_pb2.ChatMessage(role="user", content="x" * 100),)
    assert store.put("a", "t1", {"id": "a"}, 10, turn) and store.put("b", "t1", {"id": "b"}, 10, turn)
    assert store.get("a", "t2") is None and not store.delete("a", "t2")  # another tenant sees nothing
    store.put("c", "t1", {"id": "c"}, 10, turn)
    assert store.get("a", "t1") is None and store.get("b", "t1") is not None and len(store) == 2  # oldest out
    assert not store.put("big", "t1", {"id": "big"}, 2000, turn)  # alone over the byte bound: not kept
    store.put("d", "t1", {"id": "d"}, 800, turn)
    assert store.bytes <= 1000 and store.get("d", "t1") is not None and store.get("b", "t1") is None
    assert store.delete("d", "t1") and store.get("d", "t1") is None


def test_tokenizer_requests_are_checked_as_generations() -> None:
    prompt = parse_tokenize({"model": "m", "prompt": "hi"}, "m")
    assert prompt.prompt == "hi" and prompt.add_special_tokens
    chat = parse_tokenize(
        {
            "model": "m",
            "messages": [{"role": "developer", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "m",
    )
    assert chat.add_generation_prompt and not chat.add_special_tokens
    assert chat.messages.messages[0].role == "system"
    assert json.loads(chat.messages.tools_json)[0]["function"]["name"] == "f"
    assert list(parse_detokenize({"model": "m", "tokens": [1, 2]}, "m").tokens) == [1, 2]
    for body, param in (
        ({"prompt": "   "}, "prompt"),
        ({"prompt": "x" * 1_000_001}, "prompt"),
        ({"messages": []}, "messages"),
        ({"prompt": "hi", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({}, "prompt"),
    ):
        with pytest.raises(OpenAIError) as refused:
            parse_tokenize({"model": "m", **body}, "m")
        assert refused.value.param == param, refused.value.message
    with pytest.raises(OpenAIError):
        parse_detokenize({"model": "m", "tokens": [True]}, "m")
