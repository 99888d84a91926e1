"""The decode worker's calls to its peers over gRPC: `PrefillPeers` and `MigrationSources` of
decode_worker/kv_intake.py. One event-loop channel per address, kept for the worker's life. A failed
call becomes `PeerCallFailed`, its status read as the typed failure it stands for."""

from __future__ import annotations

from typing import Any

import grpc

from pdserve.decode_worker.kv_intake import PeerCallFailed
from pdserve.failures import Failure, Overloaded, RequestFault, RequestInvalid, WorkerUnavailable
from pdserve.transport import open_aio_channel
from pdserve.v1 import worker_pb2, worker_pb2_grpc

#: A peer's status -> the failure it stands for. INTERNAL / UNKNOWN: its step broke on this request
#: (not the worker), which the router retries once elsewhere without suspecting anyone.
KINDS: dict[grpc.StatusCode, type[Failure]] = {
    grpc.StatusCode.INVALID_ARGUMENT: RequestInvalid,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.INTERNAL: RequestFault,
    grpc.StatusCode.UNKNOWN: RequestFault,
}


def call_failed(exc: grpc.aio.AioRpcError) -> PeerCallFailed:
    code = exc.code()
    return PeerCallFailed(KINDS.get(code, WorkerUnavailable), code.name, exc.details() or code.name)


class GrpcPeers:
    """Prefill workers and migration sources, reached over gRPC."""

    def __init__(self) -> None:
        self._prefill: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}
        self._decode: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}

    async def segment_prefix(self, address: str, timeout_s: float) -> str:
        info = await _call(self._prefill_stub(address).GetInfo, worker_pb2.InfoRequest(), timeout_s)
        return info.kv_segment_prefix

    async def prefill(
        self, address: str, request: worker_pb2.PrefillRequest, timeout_s: float
    ) -> worker_pb2.PrefillResponse:
        return await _call(self._prefill_stub(address).Prefill, request, timeout_s)

    async def migrate_out(
        self, address: str, request: worker_pb2.MigrateOutRequest, timeout_s: float
    ) -> worker_pb2.MigrateOutResponse:
        return await _call(self._decode_stub(address).MigrateOut, request, timeout_s)

    def _prefill_stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        if address not in self._prefill:
            self._prefill[address] = worker_pb2_grpc.PrefillWorkerStub(open_aio_channel(address))
        return self._prefill[address]

    def _decode_stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        if address not in self._decode:
            self._decode[address] = worker_pb2_grpc.DecodeWorkerStub(open_aio_channel(address))
        return self._decode[address]


async def _call(method: Any, request: Any, timeout_s: float) -> Any:  # noqa: ANN401 - a stub's unary method
    """One unary call; a failed one raised as the typed `PeerCallFailed` its status stands for."""
    try:
        return await method(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise call_failed(exc) from exc
