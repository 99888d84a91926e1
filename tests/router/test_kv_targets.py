"""The router registers every decode worker's kv_address with every prefill worker (SetKvTargets)
and pairs a decode worker only with prefill workers that acknowledged it."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from router_fakes import FakeDecode, FakePrefill

from pdserve.router.config import RouterConfig
from pdserve.v1 import common_pb2, router_pb2, worker_pb2


@dataclass
class RegisteringPrefill(FakePrefill):
    """Answers SetKvTargets (or refuses it, like a worker that cannot take the registration)."""

    refuse: bool = False
    registered: list[list[str]] = field(default_factory=list)

    def SetKvTargets(self, request: worker_pb2.KvTargets, context: grpc.ServicerContext):  # noqa: ANN201, N802
        if self.refuse:
            context.abort(grpc.StatusCode.UNAVAILABLE, "not now")
        self.registered.append(list(request.targets))
        return worker_pb2.KvTargetsAck(num_targets=len(request.targets))


def test_decode_workers_are_paired_only_with_prefill_workers_that_registered_them(
    fake_server,  # noqa: ANN001
    start_router,
) -> None:  # noqa: ANN001
    decode = FakeDecode(info=common_pb2.WorkerInfo(healthy=True, kv_address="ray:decode-7"))
    accepting, refusing = RegisteringPrefill(), RegisteringPrefill(refuse=True)
    prefill_addresses = [fake_server(accepting), fake_server(refusing)]
    _, stub = start_router(RouterConfig(prefill=tuple(prefill_addresses), decode=(fake_server(decode),)))
    assert accepting.registered and accepting.registered[-1] == ["ray:decode-7"]
    request = router_pb2.GenerateRequest(prompt="Hello", params=common_pb2.SamplingParams(max_tokens=3))
    for _ in range(4):  # round robin would alternate; the refusing worker never gets the pair
        list(stub.Generate(request, timeout=10))
    assert [r.prefill_address for r in decode.requests] == [prefill_addresses[0]] * 4


@dataclass
class PickyPrefill(RegisteringPrefill):
    """Refuses any target list that holds `unknown` (a new decode worker it has not heard of yet)."""

    unknown: str = ""

    def SetKvTargets(self, request: worker_pb2.KvTargets, context: grpc.ServicerContext):  # noqa: ANN201, N802
        if self.unknown in request.targets:
            context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        return super().SetKvTargets(request, context)


def test_a_decode_worker_no_prefill_worker_registered_yet_is_not_picked(fake_server, start_router) -> None:  # noqa: ANN001
    """A decode worker that turned healthy (a scale-up) but that no prefill worker has acknowledged
    yet gets no request while a paired one can take it; the requests do not fail."""
    old = FakeDecode(info=common_pb2.WorkerInfo(healthy=True, kv_address="ray:decode-old"))
    new = FakeDecode(info=common_pb2.WorkerInfo(healthy=True, kv_address="ray:decode-new"))
    prefill = PickyPrefill(unknown="ray:decode-new")
    server, stub = start_router(RouterConfig(prefill=(fake_server(prefill),), decode=(fake_server(old),)))
    from pdserve.router.worker_pool import WorkerEndpoint

    server.pool.add(WorkerEndpoint(fake_server(new), "decode"))
    assert server.pool.candidates(("decode",))[1].healthy  # healthy, yet not a KV target of the prefill
    request = router_pb2.GenerateRequest(prompt="Hello", params=common_pb2.SamplingParams(max_tokens=3))
    for _ in range(4):  # round robin would alternate between the two decode workers
        list(stub.Generate(request, timeout=10))
    assert len(old.requests) == 4 and not new.requests
    prefill.unknown = ""  # the prefill worker now takes the new target: the next poll pairs it
    server.pool.poll_once()
    for _ in range(4):
        list(stub.Generate(request, timeout=10))
    assert len(new.requests) == 2
