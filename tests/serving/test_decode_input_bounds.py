"""Issue 29 row 6 at a real decode worker: a million token ids (within the router's limit) are
refused for the model's context before they become a Python list, with the engine's message."""

from __future__ import annotations

import grpc
import pytest

from pdserve.limits import receive_options
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def test_a_million_token_ids_are_refused_for_the_context(start_colocated) -> None:  # noqa: ANN001
    worker = start_colocated()
    request = worker_pb2.DecodeRequest(
        request_id="huge",
        token_ids=common_pb2.TokenIds(ids=[7] * 1_000_000),
        params=common_pb2.SamplingParams(max_tokens=2),
    )
    with open_channel(worker.address, options=receive_options()) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt has 1000000 tokens; the model's context is" in err.value.details()
        ok = worker_pb2.DecodeRequest(
            request_id="ok",
            token_ids=common_pb2.TokenIds(ids=[7] * 8),
            params=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        assert sum(len(r.token_ids) for r in stub.Generate(ok, timeout=60)) == 2


def test_a_chat_too_long_for_any_tokenization_is_refused_before_its_template(start_colocated) -> None:  # noqa: ANN001
    """256 messages near the size limit: their characters alone need more tokens than the context
    holds (a token stands for at most `max_chars_per_token` characters), so the decode worker
    refuses them before rendering the template or tokenizing; the worker then serves as before."""
    worker = start_colocated()
    messages = [
        common_pb2.ChatMessage(role="user" if i % 2 == 0 else "assistant", content="word " * 12_000) for i in range(256)
    ]
    request = worker_pb2.DecodeRequest(
        request_id="huge-chat",
        messages=common_pb2.ChatMessages(messages=messages),
        params=common_pb2.SamplingParams(max_tokens=2),
    )
    with open_channel(worker.address, options=receive_options()) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages: 15360000 characters need at least" in err.value.details(), err.value.details()
        assert "the model's context is" in err.value.details()
        ok = worker_pb2.DecodeRequest(
            request_id="ok",
            messages=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="Hi")]),
            params=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        assert sum(len(r.token_ids) for r in stub.Generate(ok, timeout=60)) == 2


def test_the_character_bound_never_refuses_what_fits(tiny_llama_dir) -> None:  # noqa: ANN001
    """The bound is a true lower bound: over texts of every kind (spaces, runs of one character,
    code rulers, emoji, CJK, mixed), the tokens they take are at least their characters over
    `max_chars_per_token`."""
    from transformers import AutoTokenizer

    from pdserve.tokenization import max_chars_per_token

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    per_token = max_chars_per_token(tokenizer)
    texts = [
        " " * 5000,
        "\n" + " " * 4000,
        "#" * 3000,
        "=" * 2000,
        "-" * 2000,
        "😀" * 500,
        "漢字テスト" * 300,
        "the quick brown fox " * 200,
        "".join(chr(32 + (i * 7919) % 95) for i in range(4000)),
    ]
    for text in texts:
        tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
        assert tokens * per_token >= len(text), (text[:20], tokens, per_token)
