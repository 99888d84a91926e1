"""Tool calling, the pure parts: `tools` / `tool_choice` into the request, the model's output into
`tool_calls` (whole and streamed), and the prompt a template without tools support gets."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.router import tools
from pdserve.router.openai_protocol import CHAT, parse_request
from pdserve.tokenization import chat_from_pb, encode_chat

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
}


def _parse(**extra: object):  # noqa: ANN202
    body = {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], **extra}
    return parse_request(CHAT, body, "m", "r")


def test_auto_puts_tools_in_the_prompt_and_leaves_the_output_free() -> None:
    parsed = _parse(tools=[WEATHER, TIME])
    assert parsed.tools == tools.ToolMode(tools.AUTO, ("get_weather", "get_time"))
    assert json.loads(parsed.grpc_request.messages.tools_json) == [WEATHER, TIME]
    assert not parsed.grpc_request.params.HasField("structured")


def test_none_leaves_tools_out() -> None:
    parsed = _parse(tools=[WEATHER], tool_choice="none")
    assert parsed.tools is None and not parsed.grpc_request.messages.tools_json


def test_named_function_is_constrained_to_its_parameters() -> None:
    parsed = _parse(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert parsed.tools.kind == tools.NAMED and parsed.tools.function == "get_time"
    assert json.loads(parsed.grpc_request.params.structured.json_schema) == TIME["function"]["parameters"]
    content, calls = tools.parse_output(parsed.tools, '{"zone": "CET"}')
    assert content is None and [c["function"] for c in calls] == [{"name": "get_time", "arguments": '{"zone": "CET"}'}]
    assert tools.finish_reason(parsed.tools, 1, "stop") == "stop"  # OpenAI's answer for a named function


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_constrained_to_a_list_of_calls(parallel: bool) -> None:
    parsed = _parse(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
    schema = json.loads(parsed.grpc_request.params.structured.json_schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good[:1], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate(good, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(good, schema)
    content, calls = tools.parse_output(parsed.tools, json.dumps(good[:1]))
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert tools.finish_reason(parsed.tools, 1, "stop") == "tool_calls"
    assert tools.finish_reason(parsed.tools, 1, "length") == "length"


def test_hermes_calls_are_parsed_out_of_free_text() -> None:
    mode = tools.ToolMode(tools.AUTO, ("get_weather", "get_time"))
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = tools.parse_output(mode, text)
    assert content == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    # not a call of a known tool, or not JSON: stays text
    for text in (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        "<tool_call>not json</tool_call>",
        "plain answer",
        "a < b",
    ):
        assert tools.parse_output(mode, text) == (text, [])


def test_streamed_hermes_output_holds_back_only_what_may_be_a_tag() -> None:
    mode = tools.ToolMode(tools.AUTO, ("get_weather",))
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> done'
    stream = tools.ToolStream(mode)
    content, calls = "", []
    for i in range(0, len(text), 3):  # 3-character deltas split the tags everywhere
        more, new = stream.feed(text[i : i + 3])
        assert "<" not in more or "<tool_call>" not in text[: i + 3]  # never a piece of a tag
        content, calls = content + more, calls + new
    more, new = stream.finish()
    assert content + more == "Sure  done"
    assert (
        len(calls) == 1 and calls[0]["index"] == 0 and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    )


def test_streamed_named_function_gives_arguments_as_they_come() -> None:
    stream = tools.ToolStream(tools.ToolMode(tools.NAMED, ("get_weather",), "get_weather"))
    first = stream.feed('{"city"')[1]
    second = stream.feed(': "Rome"}')[1]
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"city"'} and first[0]["id"]
    assert second == [{"index": 0, "function": {"arguments": ': "Rome"}'}}]
    assert stream.finish() == ("", [])


def test_tool_turns_reach_the_worker_and_render(default_model) -> None:  # noqa: ANN001
    parsed = _parse(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "weather in Paris?"},
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
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
    )
    messages, tool_list = chat_from_pb(parsed.grpc_request.messages)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object for templates
    assert messages[2]["tool_call_id"] == "call_1" and tool_list == [WEATHER]
    tok = default_model.tokenizer  # SmolLM2's template ignores tools: the Hermes description is written in
    text = tok.decode(encode_chat(tok, messages, tool_list))
    assert "<tools>" in text and '"get_weather"' in text and "<tool_call>" in text
    assert '"city": "Paris"' in text and "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert encode_chat(tok, messages[:1]) != encode_chat(tok, messages[:1], tool_list)


def test_a_template_that_knows_tools_renders_them_itself(default_model) -> None:  # noqa: ANN001
    tok = default_model.tokenizer
    original = tok.chat_template
    try:  # a minimal tools-aware template (as Qwen's): the tools are its to render
        tok.chat_template = (
            "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n"
        )
        for name in ("_pdserve_renders_tools",):
            if hasattr(tok, name):
                delattr(tok, name)
        text = tok.decode(encode_chat(tok, [{"role": "user", "content": "hi"}], [WEATHER]))
        assert text.startswith("TOOLS:get_weather;") and "<tools>" not in text
    finally:
        tok.chat_template = original
        if hasattr(tok, "_pdserve_renders_tools"):
            delattr(tok, "_pdserve_renders_tools")
