"""Typed failures: how a request failed, said once, carried as a gRPC status plus one trailing
metadata entry, and read back by whoever decides what to do next (the router's failover).

Every edge that ends a call with an error raises (or aborts with) one of these; the router reads
`FAILURE_KEY` from the trailing metadata instead of parsing the message, so rewording a message
never changes failover:

- `RequestInvalid`: the request is wrong (INVALID_ARGUMENT): answered to the client, never retried.
- `Overloaded(retry_after_s)`: no room now (RESOURCE_EXHAUSTED): answered, with a retry-after hint.
- `WorkerUnavailable(side)`: a worker cannot serve (UNAVAILABLE): the router suspects the worker on
  `side` (the prefill worker, the decode worker, or the source of a migration) and fails over.
- `RequestFault(side)`: the request broke a worker's step (INTERNAL): retried once elsewhere without
  suspecting anyone; failing the same way twice, it is a poison request.

A status without the entry (a worker that died mid-call, a deadline) is classified by its code
alone, as the decode worker's own failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

#: The trailing-metadata key whose value names the failure: ``<kind>`` or ``<kind>:<side>``.
FAILURE_KEY = "x-pdserve-failure"

PREFILL, DECODE, MIGRATION_SOURCE = "prefill", "decode", "migration-source"
SIDES = (PREFILL, DECODE, MIGRATION_SOURCE)


class Failure(Exception):
    """Base of the typed failures: a status code, a kind and (for worker-side ones) a side."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    kind: str = "failure"

    def __init__(self, message: str, side: str = "") -> None:
        super().__init__(message)
        if side and side not in SIDES:
            raise ValueError(f"unknown failure side {side!r}")
        self.message = message
        self.side = side

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.side}" if self.side else self.kind

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((FAILURE_KEY, self.label),)


class RequestInvalid(Failure, ValueError):
    """The request is wrong. Raised by whatever validates client input (the engine, the tokenizer
    helpers, the servicers); the servicers map this, and only this, to INVALID_ARGUMENT: any other
    exception there is our bug, answered INTERNAL and logged with its traceback.

    Also a ValueError, deliberately: it is one (a bad value from the caller), so library callers and
    unit tests that catch ValueError around `SamplingParams(...)` or `engine.add_request` keep
    working. The servicers no longer treat a bare ValueError as a client error."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    kind = "request-invalid"


class Overloaded(Failure):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    kind = "overloaded"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerUnavailable(Failure):
    code = grpc.StatusCode.UNAVAILABLE
    kind = "worker-unavailable"


class RequestFault(Failure):
    code = grpc.StatusCode.INTERNAL
    kind = "request-fault"


_KINDS = {cls.kind: cls for cls in (RequestInvalid, Overloaded, WorkerUnavailable, RequestFault)}


@dataclass(frozen=True)
class Received:
    """A failure as read from a finished call: its kind and side ("" when the call said none)."""

    kind: str
    side: str


def parse_label(label: str) -> Received | None:
    """`Received` of a FAILURE_KEY value; None for a value no version of pdserve writes."""
    kind, _, side = label.partition(":")
    if kind not in _KINDS or (side and side not in SIDES):
        return None
    return Received(kind, side)


def received(metadata: Any) -> Received | None:  # noqa: ANN401 - grpc.aio.Metadata or a sequence of pairs
    """The typed failure in a call's trailing metadata, if any."""
    for key, value in metadata or ():
        if key == FAILURE_KEY:
            return parse_label(value.decode() if isinstance(value, bytes) else str(value))
    return None


async def abort(context: Any, failure: Failure) -> None:  # noqa: ANN401 - a grpc.aio.ServicerContext (or the mux's)
    """End the call with the failure's status, its message, and its label in the trailing metadata."""
    await context.abort(failure.code, failure.message, trailing_metadata=failure.trailing_metadata())
