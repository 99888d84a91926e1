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
