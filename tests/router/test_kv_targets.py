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


def test_decode_workers_are_paired_only_with_prefill_workers_that_registered_them(fake_server,  # noqa: ANN001
                                                                                 start_router) -> None:  # noqa: ANN001
    decode = FakeDecode(info=common_pb2.WorkerInfo(healthy=True, kv_address="ray:decode-7"))
    accepting, refusing = RegisteringPrefill(), RegisteringPrefill(refuse=True)
    prefill_addresses = [fake_server(accepting), fake_server(refusing)]
    _, stub = start_router(RouterConfig(prefill=tuple(prefill_addresses), decode=(fake_server(decode),)))
    assert accepting.registered and accepting.registered[-1] == ["ray:decode-7"]
    request = router_pb2.GenerateRequest(prompt="Hello", params=common_pb2.SamplingParams(max_tokens=3))
    for _ in range(4):  # round robin would alternate; the refusing worker never gets the pair
        list(stub.Generate(request, timeout=10))
    assert [r.prefill_address for r in decode.requests] == [prefill_addresses[0]] * 4
