"""Issue 30: failover follows the typed failure, not the message text, through a real router.

A real router (serve()) routes to in-process fake decode workers; the first call fails with a typed
failure (pdserve/failures.py: the status plus FAILURE_KEY in the trailing metadata) whose message is
the one a real worker writes, or random text, or nothing, or the words of another failure. Each
wording must lead to the same decision: which worker the router suspects, whether and where it
retries, and what the client gets. (tests/router/test_typed_failures.py checks the same on the
router's classification alone; this drives the whole failover path.)
"""

from __future__ import annotations

import random
import string
import threading
import zlib
from dataclasses import dataclass, field

import grpc
import pytest
from router_fakes import SCRIPT, FakePrefill

from pdserve import failures
from pdserve.router.config import RouterConfig
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

REQUEST = router_pb2.GenerateRequest(prompt="Hello", params=common_pb2.SamplingParams(max_tokens=3))

#: Each failure, and the words a real worker ends the call with (decode_worker/kv_intake.py, outcomes.py).
CANONICAL = {
    "unavailable-decode": (failures.WorkerUnavailable("", failures.DECODE), "decode worker d0: engine loop died"),
    "unavailable-prefill": (
        failures.WorkerUnavailable("", failures.PREFILL),
        "prefill failed on 127.0.0.1:1: UNAVAILABLE: connection refused",
    ),
    "fault-decode": (failures.RequestFault("", failures.DECODE), "decode worker d0: decode step failed: boom"),
    "fault-prefill": (
        failures.RequestFault("", failures.PREFILL),
        "prefill failed on 127.0.0.1:1: prefill failed: poisoned prompt",
    ),
    "invalid": (failures.RequestInvalid(""), "max_tokens must be in [1, 1000000], got 0"),
    "overloaded": (failures.Overloaded(""), "admission queue full (64)"),
}

#: (client's status, calls the decode workers saw, who was suspected) for each failure, whatever its words.
EXPECTED = {
    "unavailable-decode": ("OK", 2, ("failed decode",)),
    "unavailable-prefill": ("OK", 2, ("its prefill",)),
    "fault-decode": ("OK", 2, ()),
    "fault-prefill": ("OK", 2, ()),
    "invalid": ("INVALID_ARGUMENT", 1, ()),
    "overloaded": ("RESOURCE_EXHAUSTED", 1, ()),
}


def _random_words(seed: int) -> str:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " éß→"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120)))


def _wordings(name: str) -> list[str]:
    """The real words, random ones, none, and every other failure's real words (misleading)."""
    others = [words for other, (_, words) in CANONICAL.items() if other != name]
    return [CANONICAL[name][1], _random_words(zlib.crc32(name.encode())), _random_words(7), "", *others]


@dataclass
class _FailFirst:
    """Shared by the fake decode workers: the first call to any of them fails with `failure`."""

    failure: failures.Failure
    words: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    failed: list[worker_pb2.DecodeRequest] = field(default_factory=list)
    calls: int = 0

    def take(self, request: worker_pb2.DecodeRequest) -> bool:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
            if first:
                self.failed.append(request)
            return first


@dataclass
class _TypedDecode(worker_pb2_grpc.DecodeWorkerServicer):
    shared: _FailFirst
    address: str = ""
    failed_here: bool = False

    def Generate(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext):  # noqa: N802
        if self.shared.take(request):
            self.failed_here = True
            context.set_trailing_metadata(self.shared.failure.trailing_metadata())
            context.abort(self.shared.failure.code, self.shared.words)
        for response in SCRIPT:
            out = router_pb2.GenerateResponse()
            out.CopyFrom(response)
            out.request_id = request.request_id
            yield out

    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.WorkerInfo:  # noqa: N802
        return common_pb2.WorkerInfo(healthy=True, role=common_pb2.WORKER_ROLE_DECODE)


def _decide(fake_server, start_router, monkeypatch, name: str, words: str) -> tuple[str, int, tuple[str, ...]]:  # noqa: ANN001
    failure = CANONICAL[name][0]
    shared = _FailFirst(
        type(failure)(words, failure.side)
        if not isinstance(failure, failures.Overloaded)
        else failures.Overloaded(words),
        words,
    )
    prefills = tuple(fake_server(FakePrefill()) for _ in range(2))
    decodes = [_TypedDecode(shared), _TypedDecode(shared)]
    for decode in decodes:
        decode.address = fake_server(decode)
    server, stub = start_router(
        RouterConfig(prefill=prefills, decode=tuple(d.address for d in decodes), decode_policy="round_robin")
    )
    suspected: list[str] = []
    suspect = server.core.pool.suspect
    monkeypatch.setattr(server.core.pool, "suspect", lambda address: (suspected.append(address), suspect(address)))
    try:
        responses = list(stub.Generate(REQUEST, timeout=30))
        assert "".join(r.text for r in responses) == "".join(r.text for r in SCRIPT)
        status = "OK"
    except grpc.RpcError as error:
        status = error.code().name
    failed_decode = next(d.address for d in decodes if d.failed_here)
    its_prefill = shared.failed[0].prefill_address
    assert its_prefill in prefills
    names = {failed_decode: "failed decode", its_prefill: "its prefill"}
    return status, shared.calls, tuple(names.get(a, a) for a in suspected)


@pytest.mark.parametrize("name", list(CANONICAL))
def test_the_same_failover_whatever_the_words(fake_server, start_router, monkeypatch, name: str) -> None:  # noqa: ANN001
    decisions = {words: _decide(fake_server, start_router, monkeypatch, name, words) for words in _wordings(name)}
    wrong = {words: decision for words, decision in decisions.items() if decision != EXPECTED[name]}
    assert not wrong, f"{name}: expected {EXPECTED[name]} for every wording, got {wrong}"


def test_the_label_not_the_words_picks_the_side(fake_server, start_router, monkeypatch) -> None:  # noqa: ANN001
    """The same words, two labels: the decision follows the label (so the words are not read)."""
    words = CANONICAL["unavailable-prefill"][1]
    shared_decisions = []
    for name in ("unavailable-prefill", "unavailable-decode"):
        shared_decisions.append(_decide(fake_server, start_router, monkeypatch, name, words))
    assert shared_decisions == [EXPECTED["unavailable-prefill"], EXPECTED["unavailable-decode"]]
