"""Every row of docs/validation.md, sent through a real router server (no workers needed: validation
runs first), must fail with INVALID_ARGUMENT and a message naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.server import serve
from pdserve.router.validation import InvalidRequest, validate_generate_request
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

P = common_pb2.SamplingParams
M = common_pb2.ChatMessage


def _chat(*messages: common_pb2.ChatMessage) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(messages=common_pb2.ChatMessages(messages=messages))


def _params(params: common_pb2.SamplingParams) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(prompt="hi", params=params)


INVALID = [
    ("request_id", router_pb2.GenerateRequest(request_id="x" * 129, prompt="hi")),
    ("request_id", router_pb2.GenerateRequest(request_id="tab\there", prompt="hi")),
    ("input", router_pb2.GenerateRequest()),
    ("prompt", router_pb2.GenerateRequest(prompt="")),
    ("prompt", router_pb2.GenerateRequest(prompt=" \n\t ")),
    ("prompt", router_pb2.GenerateRequest(prompt="a" * 1_000_001)),
    ("messages", _chat()),
    ("messages", _chat(*[M(role="user", content="hi")] * 257)),
    ("messages[1].role", _chat(M(role="user", content="hi"), M(role="robot", content="hi"))),
    ("messages[0].content", _chat(M(role="user", content="a" * 1_000_001))),
    ("token_ids", router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[]))),
    ("token_ids[2]", router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1, 2, -3]))),
    ("params.max_tokens", _params(P(max_tokens=0))),
    ("params.max_tokens", _params(P(max_tokens=1_000_001))),
    ("params.temperature", _params(P(temperature=-0.1))),
    ("params.temperature", _params(P(temperature=100.5))),
    ("params.temperature", _params(P(temperature=float("nan")))),
    ("params.top_p", _params(P(top_p=0.0))),
    ("params.top_p", _params(P(top_p=1.5))),
    ("params.top_k", _params(P(top_k=-1))),
    ("params.seed", _params(P(seed=2**63))),
    ("params.stop", _params(P(stop=["s"] * 17))),
    ("params.stop[1]", _params(P(stop=["ok", ""]))),
    ("params.stop[0]", _params(P(stop=["a" * 257]))),
    ("params.stop_token_ids[1]", _params(P(stop_token_ids=[5, -1]))),
]

VALID = [
    router_pb2.GenerateRequest(prompt="a" * 1_000_000),
    router_pb2.GenerateRequest(request_id="my-id_1", token_ids=common_pb2.TokenIds(ids=[0, 5])),
    _chat(*[M(role=r, content="") for r in ("system", "user", "assistant", "tool")]),
    _params(P(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=2**63 - 1, stop=["a" * 256] * 16)),
    _params(P(max_tokens=1_000_000, temperature=100.0, top_p=1e-9, stop_token_ids=[0])),
]


@pytest.fixture(scope="module")
def router_address() -> Iterator[str]:
    server, port = serve(RouterConfig())
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def router_stub(router_address: str) -> Iterator[router_pb2_grpc.RouterStub]:
    with grpc.insecure_channel(router_address) as channel:
        yield router_pb2_grpc.RouterStub(channel)


def _call(stub: router_pb2_grpc.RouterStub, request: router_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, timeout=10))
    return caught.value


@pytest.mark.parametrize(("field", "request_pb"), INVALID, ids=[f"{i}-{f}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_request_is_rejected_naming_the_field(
    router_stub: router_pb2_grpc.RouterStub, field: str, request_pb: router_pb2.GenerateRequest
) -> None:
    error = _call(router_stub, request_pb)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}: "), error.details()


def test_top_p_message_is_explicit() -> None:
    with pytest.raises(InvalidRequest, match=r"^params\.top_p: must be in \(0, 1\], got 1\.5$"):
        validate_generate_request(_params(P(top_p=1.5)))


@pytest.mark.parametrize("request_pb", VALID)
def test_valid_request_passes_validation_and_reaches_worker_selection(
    router_stub: router_pb2_grpc.RouterStub, request_pb: router_pb2.GenerateRequest
) -> None:
    validate_generate_request(request_pb)
    error = _call(router_stub, request_pb)  # valid, but this router has no workers
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker configured" in error.details()


def test_invalid_utf8_is_refused_by_protobuf_before_the_servicer(router_address: str) -> None:
    raw = b"\x12\x02\xff\xfe"  # field 2 (prompt), length 2, invalid UTF-8
    with grpc.insecure_channel(router_address) as ch:
        call = ch.unary_stream("/pdserve.v1.Router/Generate", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as caught:
            list(call(raw, timeout=10))
    assert caught.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
