"""Issue 30, typed failures at the workers: what validates client input raises `RequestInvalid`, and
only that becomes INVALID_ARGUMENT. Any other exception on a request's path is our bug: INTERNAL
(typed RequestFault, so the router retries once and suspects nobody), logged with its traceback,
never answered to the client as its own mistake."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import grpc
import pytest

from pdserve import failures
from pdserve.engine.sampling_params import SamplingParams
from pdserve.failures import RequestInvalid
from pdserve.tokenization import chat_from_pb, encode_text
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.runtime import sampling_params_from_pb


def test_request_invalid_is_a_failure_and_a_value_error() -> None:
    """A ValueError on purpose (library callers catching ValueError keep working); the servicers
    tell it apart from a bare ValueError, which is not a client error."""
    exc = RequestInvalid("max_tokens: bad")
    assert isinstance(exc, failures.Failure) and isinstance(exc, ValueError)
    assert exc.code == grpc.StatusCode.INVALID_ARGUMENT and str(exc) == "max_tokens: bad"
    assert not isinstance(ValueError("a bug"), RequestInvalid)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SamplingParams(temperature=-1.0),
        lambda: SamplingParams(max_tokens=0),
        lambda: SamplingParams(stop=("",)),
        lambda: sampling_params_from_pb(common_pb2.SamplingParams(n=2)),
        lambda: encode_text(None, "   "),
        lambda: chat_from_pb(common_pb2.ChatMessages(tools_json="not json")),
    ],
)
def test_input_validation_raises_request_invalid(make) -> None:  # noqa: ANN001
    with pytest.raises(RequestInvalid):
        make()


def _decode_call(address: str, request: worker_pb2.DecodeRequest) -> grpc.RpcError:
    with open_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(worker_pb2_grpc.DecodeWorkerStub(channel).Generate(request, timeout=60))
    return err.value


def _label(error: grpc.RpcError) -> failures.Received | None:
    return failures.received(error.trailing_metadata())


BAD_REQUESTS = [
    worker_pb2.DecodeRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=2, temperature=-1)),
    worker_pb2.DecodeRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=2, n=2)),
    worker_pb2.DecodeRequest(params=common_pb2.SamplingParams(max_tokens=2)),
    worker_pb2.DecodeRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=2), resume_output_ids=[5, 6]),
    # refused by the engine itself, on the engine loop (the local prefill's future)
    worker_pb2.DecodeRequest(
        token_ids=common_pb2.TokenIds(ids=[7, 10**6]), params=common_pb2.SamplingParams(max_tokens=2)
    ),
]


def test_bad_requests_are_invalid_argument_and_a_bug_is_internal(
    start_colocated,
    monkeypatch,  # noqa: ANN001
    caplog,
) -> None:  # noqa: ANN001
    worker = start_colocated()
    for request in BAD_REQUESTS:
        error = _decode_call(worker.address, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, error.details())
        assert _label(error) == failures.Received(RequestInvalid.kind, "")

    import pdserve.decode_worker.codec as codec
    from pdserve.engine.llm_engine import LLMEngine

    def buggy(*_args: object, **_kwargs: object) -> None:
        raise ValueError("an index our own code got wrong")

    good = worker_pb2.DecodeRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=2))
    caplog.set_level(logging.ERROR, logger="pdserve.decode_worker.outcomes")
    for target, name in ((codec, "sampling_params_from_pb"), (LLMEngine, "new_sequence")):
        caplog.clear()
        with monkeypatch.context() as patch:
            patch.setattr(target, name, buggy)
            error = _decode_call(worker.address, good)
        assert error.code() == grpc.StatusCode.INTERNAL, (name, error.code(), error.details())
        assert _label(error) == failures.Received(failures.RequestFault.kind, failures.DECODE)
        assert "an index our own code got wrong" in error.details()
        logged = [r for r in caplog.records if r.exc_info and "an index our own code got wrong" in str(r.exc_info[1])]
        assert logged, f"{name}: the bug was not logged with its traceback"
    with open_channel(worker.address) as channel:  # and the worker keeps serving
        responses = list(worker_pb2_grpc.DecodeWorkerStub(channel).Generate(good, timeout=60))
    assert responses and responses[-1].finish_reason


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    def time_remaining(self) -> float:
        return 30.0

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        self.status = (code, details)
        raise _Aborted


def _prefill_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """Status of a Prefill call whose submit raises `exc`, on the real PrefillServicer."""
    from pdserve.prefill_worker.servicer import PrefillServicer

    def submit(_job: object) -> None:
        raise exc

    fake = SimpleNamespace(loop_alive=lambda: True, submit=submit)
    servicer = PrefillServicer(fake, "p0", "127.0.0.1:1", request_timeout_s=5.0)  # type: ignore[arg-type]
    servicer._kv_targets = frozenset({"decode:1"})
    context = _Context()
    request = worker_pb2.PrefillRequest(
        request_id="r1",
        prompt_token_ids=[1, 2],
        kv_target_address="decode:1",
        params=common_pb2.SamplingParams(max_tokens=2),
    )
    with pytest.raises(_Aborted):
        asyncio.run(servicer.Prefill(request, context))  # type: ignore[arg-type]
    assert context.status is not None
    return context.status


def test_the_prefill_servicer_maps_only_request_invalid_to_invalid_argument(caplog) -> None:  # noqa: ANN001
    assert _prefill_status(RequestInvalid("kv_block_offset: out of range"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    caplog.set_level(logging.ERROR, logger="pdserve.prefill_worker.servicer")
    code, details = _prefill_status(ValueError("a bug of ours"))
    assert code == grpc.StatusCode.INTERNAL and "a bug of ours" in details
    assert any(r.exc_info and "a bug of ours" in str(r.exc_info[1]) for r in caplog.records)
