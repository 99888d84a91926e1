"""How the decode worker's core says a call failed, without gRPC: the typed failures of
pdserve/failures.py, plus the few outcomes that are not a request's failure kind (a deadline, an
unknown or forbidden migration). The servicer maps each to its status in one place; nothing below
the servicer knows a status code.

`await_loop` is the one way the serving side waits for an engine-loop future: within the request's
deadline, with the loop's own errors turned into typed failures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Any

from pdserve.decode_worker.worker import AdmissionError, WorkerDead
from pdserve.failures import DECODE, Overloaded, RequestFault, RequestInvalid, WorkerUnavailable
from pdserve.kv_transfer import KvTransferError

log = logging.getLogger(__name__)


class DeadlinePassed(Exception):
    """The request's deadline passed while it waited (DEADLINE_EXCEEDED)."""


class NotFound(Exception):
    """A migration names a request that is not here, or no longer held (NOT_FOUND)."""


class NotPermitted(Exception):
    """The caller may not do this (PERMISSION_DENIED): e.g. ship K/V to an unregistered worker."""


class WrongState(Exception):
    """The request is here but not in a state that allows this (FAILED_PRECONDITION)."""


def internal_fault(worker_id: str, request_id: str, what: str, exc: BaseException) -> RequestFault:
    """An exception that is not a typed failure: a bug here, logged with its traceback, answered as
    RequestFault (side DECODE) so the router retries once elsewhere without suspecting this worker."""
    log.error("request_id=%s: %s failed: %s: %s", request_id or "-", what, type(exc).__name__, exc, exc_info=exc)
    return RequestFault(f"decode worker {worker_id}: internal error in {what}: {type(exc).__name__}: {exc}", DECODE)


async def await_loop(future: Future, deadline: float, worker_id: str) -> Any:  # noqa: ANN401 - the future's result
    """The result of an engine-loop future, awaited (no thread) until `deadline` (perf_counter).

    Overloaded when admission failed, WorkerUnavailable(DECODE) when the loop died, DeadlinePassed
    (the future cancelled) after the deadline; RequestInvalid and KvTransferError (the K/V hand-off's
    own failure, which the caller attributes) pass through; anything else is `internal_fault`."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout=max(0.0, deadline - time.perf_counter()))
    except AdmissionError as exc:
        raise Overloaded(str(exc)) from exc
    except WorkerDead as exc:
        raise WorkerUnavailable(f"decode worker {worker_id}: {exc}", DECODE) from exc
    except asyncio.TimeoutError:
        future.cancel()
        raise DeadlinePassed("request deadline passed while waiting") from None
    except (RequestInvalid, KvTransferError):
        raise
    except Exception as exc:  # noqa: BLE001 - not the request's fault: our bug, said as such
        raise internal_fault(worker_id, "", "the engine loop", exc) from exc
