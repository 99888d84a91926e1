"""Failover follows the typed failure (pdserve/failures.py: FAILURE_KEY in the trailing metadata),
never the message text: the same decision for any wording, and a message that reads like another
side's failure changes nothing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from pdserve import failures
from pdserve.decode_worker.mux import MuxAbort, _MuxContext
from pdserve.router.core import RouterCore, RouterError, _Attempt
from pdserve.router.mux import rpc_error

LEASE = SimpleNamespace(decode_address="decode:1", prefill_address="prefill:1")
WORDINGS = ["prefill failed on prefill:1: boom", "migration failed from decode:9: boom", "entirely new words", ""]


def _decide(code: grpc.StatusCode, details: str, label: str = "", migrating: bool = False) -> _Attempt:
    state = SimpleNamespace(migration=SimpleNamespace(source="decode:9") if migrating else None)
    result = _Attempt()
    RouterCore._on_decode_error(None, state, LEASE, result, rpc_error(code, details, label))  # type: ignore[arg-type]
    return result


@pytest.mark.parametrize("details", WORDINGS)
@pytest.mark.parametrize(
    ("failure", "avoided", "request_fault"),
    [
        (failures.WorkerUnavailable("x", failures.PREFILL), "prefill:1", False),
        (failures.WorkerUnavailable("x", failures.DECODE), "decode:1", False),
        (failures.WorkerUnavailable("x", failures.MIGRATION_SOURCE), "decode:9", False),
        (failures.RequestFault("x", failures.PREFILL), "prefill:1", True),
        (failures.RequestFault("x", failures.DECODE), "decode:1", True),
    ],
)
def test_the_label_decides_whatever_the_words(
    details: str, failure: failures.Failure, avoided: str, request_fault: bool
) -> None:
    result = _decide(failure.code, details, failure.label, migrating=True)
    assert result.failure is not None
    assert (result.failure.address, result.failure.request_fault) == (avoided, request_fault)


@pytest.mark.parametrize("details", WORDINGS)
@pytest.mark.parametrize("failure", [failures.RequestInvalid("x"), failures.Overloaded("x")])
def test_client_side_failures_are_answered_not_retried(details: str, failure: failures.Failure) -> None:
    with pytest.raises(RouterError) as raised:
        _decide(failure.code, details, failure.label)
    assert raised.value.code == failure.code


@pytest.mark.parametrize("details", WORDINGS)
def test_an_untyped_status_is_the_decode_workers_own(details: str) -> None:
    """A worker that died mid-call says nothing typed: its status code alone decides."""
    assert _decide(grpc.StatusCode.UNAVAILABLE, details).failure.address == "decode:1"
    untyped_fault = _decide(grpc.StatusCode.INTERNAL, details).failure
    assert untyped_fault.address == "decode:1" and untyped_fault.request_fault
    with pytest.raises(RouterError):
        _decide(grpc.StatusCode.INVALID_ARGUMENT, details)


def test_labels_round_trip_and_unknown_ones_are_ignored() -> None:
    for failure in (
        failures.WorkerUnavailable("m", failures.PREFILL),
        failures.RequestInvalid("m"),
        failures.RequestFault("m", failures.DECODE),
        failures.Overloaded("m", 2.0),
    ):
        assert failures.received(failure.trailing_metadata()) == failures.Received(failure.kind, failure.side)
    assert failures.received([(failures.FAILURE_KEY, "worker-unavailable:nowhere")]) is None
    assert failures.received([(failures.FAILURE_KEY, "something-else")]) is None
    assert failures.received([("other-key", "request-invalid")]) is None
    with pytest.raises(ValueError):
        failures.WorkerUnavailable("m", "nowhere")


def test_the_mux_carries_the_label() -> None:
    """A request on GenerateMux ends with the same typed failure a Generate call would carry."""
    failure = failures.WorkerUnavailable("prefill worker gone", failures.PREFILL)
    with pytest.raises(MuxAbort) as raised:
        asyncio.run(failures.abort(_MuxContext(5.0), failure))
    assert raised.value.failure == failure.label and raised.value.code == failure.code
    error = rpc_error(raised.value.code, raised.value.details, raised.value.failure)
    assert failures.received(error.trailing_metadata()) == failures.Received(failure.kind, failures.PREFILL)
