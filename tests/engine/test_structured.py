"""Structured outputs in the engine (llguidance): JSON Schema, JSON object, regex, choice and Lark
grammars constrain sampling, the request finishes when the output is complete, a bad constraint is a
clear error, and the constraint's state is rebuilt from tokens alone (what failover and migration rely
on: a resumed request continues exactly as an uninterrupted one)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import StructuredOutputError, check
from pdserve.tokenization import encode_text

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "count", "tags", "ok"],
    "additionalProperties": False,
}


def _text(model, ids: list[int]) -> str:  # noqa: ANN001
    return model.tokenizer.decode(ids, skip_special_tokens=True)


def test_json_schema_outputs_validate_at_temperature_one(tiny_model, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_model)
    prompts = [encode_text(tiny_model.tokenizer, f"Request {i}: answer in JSON.") for i in range(20)]
    params = [
        SamplingParams(max_tokens=256, temperature=1.0, seed=i, structured=("json_schema", json.dumps(SCHEMA)))
        for i in range(20)
    ]
    outputs = engine.generate(prompts, params)
    for ids in outputs:
        doc = json.loads(_text(tiny_model, ids))  # complete before max_tokens: the grammar ended it
        jsonschema.validate(doc, SCHEMA)
        assert len(ids) < 256


def test_json_object_regex_choice_and_grammar(tiny_model, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_model)
    prompt = encode_text(tiny_model.tokenizer, "Say something.")
    cases = {
        ("regex", r"[0-9]{3}-[a-z]{2}"): lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t),
        ("choice", json.dumps(["yes", "no", "not sure"])): lambda t: t in ("yes", "no", "not sure"),
        ("grammar", 'start: "red" | "green" " " NUM\nNUM: /[0-9]/'): lambda t: re.fullmatch(r"red|green [0-9]", t),
    }
    for (kind, spec), accepts in cases.items():
        for seed in range(3):
            (ids,) = engine.generate(
                [prompt], SamplingParams(max_tokens=32, temperature=1.0, seed=seed, structured=(kind, spec))
            )
            assert accepts(_text(tiny_model, ids)), (kind, _text(tiny_model, ids))
    (ids,) = engine.generate(
        [prompt], SamplingParams(max_tokens=64, temperature=1.0, seed=5, structured=("json_object", ""))
    )
    text = _text(tiny_model, ids)
    if len(ids) < 64:  # an object that completed must parse (a free-form one may run out of tokens)
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", json.dumps({"type": "bogus"}), "json_schema"),
        ("regex", "([a-z]", "regex"),
        ("choice", "[]", "non-empty list"),
        ("grammar", "start: undefined_rule", "grammar"),
    ],
)
def test_a_bad_constraint_is_a_clear_error(tiny_model, kind: str, spec: str, message: str) -> None:  # noqa: ANN001
    with pytest.raises(StructuredOutputError, match=message):
        check(tiny_model, kind, spec)


def test_the_constraint_is_rebuilt_from_tokens(tiny_model, make_engine) -> None:  # noqa: ANN001
    """A request resumed after 5 delivered tokens (failover) or migrated continues exactly like the
    uninterrupted one: the matcher is advanced by the tokens, nothing else is handed over."""
    engine = make_engine(tiny_model)
    prompt = encode_text(tiny_model.tokenizer, "Give me JSON.")
    params = SamplingParams(max_tokens=200, structured=("json_schema", json.dumps(SCHEMA)))  # greedy
    (whole,) = engine.generate([prompt], params)
    assert len(whole) > 8
    resumed = engine.add_request("resumed", prompt, params, resume_ids=whole[:5])
    rest: list[int] = []
    while engine.has_work:
        rest += [out.token_id for out in engine.step() if out.token_id >= 0]
    assert whole[:5] + rest == whole
    assert resumed.finish_reason == "stop"
    # a prefill worker computing a resumed request sees the outputs at the end of its prompt
    # (output_index says how many): its first token is the one after them
    engine.add_request(
        "prefilled", prompt + whole[:5], SamplingParams(max_tokens=1, structured=params.structured), output_index=5
    )
    first = [out.token_id for out in engine.step() if out.token_id >= 0]
    while engine.has_work:
        engine.step()
    assert first == [whole[5]]
