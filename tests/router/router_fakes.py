"""Test doubles of pdserve workers for router tests: in-process DecodeWorker / PrefillWorker servicers."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

SCRIPT = [
    router_pb2.GenerateResponse(text="Hel", token_ids=[10]),
    router_pb2.GenerateResponse(text="lo", token_ids=[11]),
    router_pb2.GenerateResponse(
        text=" world",
        token_ids=[12],
        finish_reason=common_pb2.FINISH_REASON_STOP,
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=3),
        timings=common_pb2.Timings(prefill_s=0.01, decode_s=0.02),
    ),
]


@dataclass
class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Decode worker double. mode: "ok" streams SCRIPT, "exhausted" fails RESOURCE_EXHAUSTED,
    "hang" sends one message then waits until the call is cancelled, "prefill_internal" fails INTERNAL as
    a decode worker does when the prefill worker's step broke on the request. `first_token_delay_s`
    ("ok"): how long it waits before its first token (a known TTFT, which the router's SLO model learns)."""

    mode: str = "ok"
    role: int = common_pb2.WORKER_ROLE_DECODE
    requests: list[worker_pb2.DecodeRequest] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    info: common_pb2.WorkerInfo = field(default_factory=lambda: common_pb2.WorkerInfo(healthy=True))
    first_token_delay_s: float = 0.0

    def Generate(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext):  # noqa: N802
        self.requests.append(request)
        if self.mode == "exhausted":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "kv cache full: need 9 blocks, 0 free")
        if self.mode == "prefill_internal":  # what a decode worker says when the prefill step broke on the request
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"prefill failed on {request.prefill_address}: prefill failed: poisoned prompt",
            )
        if self.mode == "hang":
            context.add_callback(self.cancelled.set)
            yield router_pb2.GenerateResponse(request_id=request.request_id, text="x", token_ids=[1])
            self.cancelled.wait(10)
            return
        if self.first_token_delay_s:
            time.sleep(self.first_token_delay_s)
        for response in SCRIPT:
            out = router_pb2.GenerateResponse()
            out.CopyFrom(response)
            out.request_id = request.request_id
            yield out

    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.WorkerInfo:  # noqa: N802
        info = common_pb2.WorkerInfo()
        info.CopyFrom(self.info)
        info.role = self.role
        return info


@dataclass
class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Prefill worker double that only answers GetInfo."""

    info: common_pb2.WorkerInfo = field(
        default_factory=lambda: common_pb2.WorkerInfo(healthy=True, role=common_pb2.WORKER_ROLE_PREFILL)
    )

    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.WorkerInfo:  # noqa: N802
        return self.info
