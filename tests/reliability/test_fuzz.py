"""Property-based fuzzing of what arrives from the network: request validation and KV frames."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router.validation import InvalidRequest, validate_generate_request
from pdserve.v1 import common_pb2, router_pb2

texts = st.text(max_size=64)
params = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.integers(-5, 2_000_000),
    temperature=st.floats(allow_nan=True, width=32),
    top_p=st.floats(allow_nan=True, width=32),
    top_k=st.integers(-10, 10**6),
    stop=st.lists(st.text(max_size=300), max_size=20),
    stop_token_ids=st.lists(st.integers(-3, 10**6), max_size=5),
)
messages = st.lists(
    st.builds(common_pb2.ChatMessage, role=st.sampled_from(["user", "system", "robot", ""]), content=texts), max_size=4
)


@st.composite
def requests(draw: st.DrawFn) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(request_id=draw(st.text(max_size=140)))
    kind = draw(st.sampled_from(["prompt", "messages", "token_ids", "none"]))
    if kind == "prompt":
        request.prompt = draw(texts)
    elif kind == "messages":
        request.messages.CopyFrom(common_pb2.ChatMessages(messages=draw(messages)))
    elif kind == "token_ids":
        request.token_ids.CopyFrom(common_pb2.TokenIds(ids=draw(st.lists(st.integers(-5, 50_000), max_size=8))))
    if draw(st.booleans()):
        request.params.CopyFrom(draw(params))
    return request


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_validation_accepts_or_names_a_field_never_crashes(request: router_pb2.GenerateRequest) -> None:
    try:
        validate_generate_request(request)
    except InvalidRequest as exc:
        assert exc.field and str(exc).startswith(exc.field + ": ")
        return
    # accepted: then it really is well formed
    assert request.WhichOneof("input") is not None
    p = request.params
    assert not p.HasField("top_p") or 0 < p.top_p <= 1
    assert not p.HasField("temperature") or 0 <= p.temperature <= 100
    assert p.top_k >= 0 and all(t >= 0 for t in p.stop_token_ids)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_parse_into_a_request_that_passes_unchecked(data: bytes) -> None:
    try:
        request = router_pb2.GenerateRequest.FromString(data)
    except Exception:  # noqa: BLE001 - protobuf rejects it: fine
        return
    try:
        validate_generate_request(request)
    except InvalidRequest:
        pass
