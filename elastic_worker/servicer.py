"""The gRPC faces of an `ElasticWorker`: DecodeWorker, PrefillWorker and RoleControl on one port.

Each call goes to the core of the worker's current role; work of the other role is refused with
UNAVAILABLE (the router retries it elsewhere). GetInfo answers on both services with the current
role's snapshot, so the router's poll sees a switch whichever stub it polls with.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from pdserve.decode_worker.mux import serve_mux
from pdserve.elastic_worker.config import COLOCATED, DECODE, PREFILL
from pdserve.elastic_worker.worker import ElasticWorker, SwitchTimeout
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

ROLE_OF_PB = {
    common_pb2.WORKER_ROLE_PREFILL: PREFILL,
    common_pb2.WORKER_ROLE_DECODE: DECODE,
    common_pb2.WORKER_ROLE_COLOCATED: COLOCATED,
}
DEFAULT_DRAIN_TIMEOUT_S = 120.0


def worker_info(worker: ElasticWorker) -> common_pb2.WorkerInfo:
    """The current core's GetInfo, with the switch shown as the reason it takes no new work."""
    core = worker.core
    info = core.servicer.GetInfo(worker_pb2.InfoRequest(), None)  # type: ignore[arg-type]
    if core.drain.leaving_for and not worker.process_drain.draining:
        info.healthy = False
        info.unhealthy_reason = f"switching to {core.drain.leaving_for}"
    return info


class ElasticDecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: ElasticWorker) -> None:
        self._worker = worker

    async def Generate(  # noqa: N802
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
        core = self._worker.core
        if core.role == PREFILL:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"worker {self._worker.settings.worker_id} is a prefill worker now"
            )
        async for response in core.servicer.Generate(request, context):  # type: ignore[union-attr]
            yield response

    async def GenerateMux(
        self,
        request_iterator: AsyncIterator[worker_pb2.MuxRequest],  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> None:
        # each request goes through Generate above, so a request opened after a switch to prefill
        # ends UNAVAILABLE as a Generate call would
        await serve_mux(self.Generate, request_iterator, context)

    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.WorkerInfo:  # noqa: N802
        return worker_info(self._worker)

    def Abort(self, request: worker_pb2.AbortRequest, context: grpc.ServicerContext) -> worker_pb2.AbortResponse:  # noqa: N802
        core = self._worker.core
        if core.role == PREFILL:
            return worker_pb2.AbortResponse(found=False)
        return core.servicer.Abort(request, context)  # type: ignore[union-attr]

    # live migration's source side: a draining or switching decode core hands its running requests over
    def SetKvTargets(
        self,
        request: worker_pb2.KvTargets,  # noqa: N802
        context: grpc.ServicerContext,
    ) -> worker_pb2.KvTargetsAck:
        core = self._worker.core
        if core.role == PREFILL:  # no sequence to migrate from here; the router registers again on a switch
            return worker_pb2.KvTargetsAck(num_targets=0)
        return core.servicer.SetKvTargets(request, context)  # type: ignore[union-attr]

    async def _decode_servicer(self, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
        """The decode core's servicer; NOT_FOUND while this worker is a prefill worker (it holds no
        sequence to suspend or migrate)."""
        core = self._worker.core
        if core.role == PREFILL:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"worker {self._worker.settings.worker_id} is a prefill worker now"
            )
        return core.servicer

    async def Suspend(
        self,
        request: worker_pb2.SuspendRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.SuspendResponse:
        return await (await self._decode_servicer(context)).Suspend(request, context)

    async def MigrateOut(
        self,
        request: worker_pb2.MigrateOutRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.MigrateOutResponse:
        return await (await self._decode_servicer(context)).MigrateOut(request, context)

    # the tokenizer: the router asks serving (decode, colocated) workers only
    async def Tokenize(
        self,
        request: worker_pb2.TokenizeRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.TokenizeResponse:
        return await (await self._serving_servicer(context)).Tokenize(request, context)

    async def Detokenize(
        self,
        request: worker_pb2.DetokenizeRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.DetokenizeResponse:
        return await (await self._serving_servicer(context)).Detokenize(request, context)

    async def _serving_servicer(self, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
        """The decode core's servicer; UNAVAILABLE while this worker is a prefill worker."""
        core = self._worker.core
        if core.role == PREFILL:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"worker {self._worker.settings.worker_id} is a prefill worker now"
            )
        return core.servicer


class ElasticPrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: ElasticWorker) -> None:
        self._worker = worker

    async def Prefill(
        self,
        request: worker_pb2.PrefillRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PrefillResponse:
        core = self._worker.core
        if core.role != PREFILL:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"worker {self._worker.settings.worker_id} is a {core.role} worker now"
            )
        return await core.servicer.Prefill(request, context)  # type: ignore[union-attr]

    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.WorkerInfo:  # noqa: N802
        return worker_info(self._worker)

    def SetKvTargets(
        self,
        request: worker_pb2.KvTargets,  # noqa: N802
        context: grpc.ServicerContext,
    ) -> worker_pb2.KvTargetsAck:
        core = self._worker.core
        if core.role != PREFILL:  # nothing is pushed from here in another role; the router re-registers
            return worker_pb2.KvTargetsAck(num_targets=0)
        return core.servicer.SetKvTargets(request, context)  # type: ignore[union-attr]


class RoleControlServicer(worker_pb2_grpc.RoleControlServicer):
    def __init__(self, worker: ElasticWorker) -> None:
        self._worker = worker

    async def SetRole(
        self,
        request: worker_pb2.SetRoleRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> common_pb2.WorkerInfo:
        role = ROLE_OF_PB.get(request.role)
        if role is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role: must be prefill, decode or colocated")
            raise AssertionError("unreachable")  # context.abort raises
        if self._worker.process_drain.draining:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the worker is shutting down")
        timeout_s = request.drain_timeout_s if request.drain_timeout_s > 0 else DEFAULT_DRAIN_TIMEOUT_S
        try:  # the wait for the old role's work holds a thread, not the event loop; a thread of its
            # own that ends with the switch: building the new engine there computes in parallel,
            # and its OpenMP pool must not outlive it beside the engine thread's (pdserve/omp_pool.py)
            with ThreadPoolExecutor(1, thread_name_prefix="role-switch") as switcher:
                await asyncio.get_running_loop().run_in_executor(switcher, self._worker.switch, role, timeout_s)
        except SwitchTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        return worker_info(self._worker)
