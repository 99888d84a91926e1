"""Thin gRPC face of the prefill worker: protobuf -> PrefillJob -> core -> protobuf.

Prefill is a coroutine on the server's event loop: a queued prompt holds no thread. When the caller
goes away, the job is cancelled (dropped if still queued).

KV goes only to registered decode workers: the router registers the kv_address of every decode worker
it routes to (`SetKvTargets`, over the authenticated internal plane); a Prefill naming any other
kv_target_address is refused with PERMISSION_DENIED before it is queued, so a caller cannot make this
worker compute for, connect to or push KV into an address of its choosing."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import grpc

from pdserve.engine.kv_cache import segment_prefix
from pdserve.failures import RequestInvalid
from pdserve.kv_transfer import KvTransferError
from pdserve.kv_transfer.shm_backend import CHECKSUM_ALGORITHMS
from pdserve.prefill_worker.job import PrefillResult
from pdserve.prefill_worker.worker import PrefillJob, PrefillWorker
from pdserve.transport import is_router_call
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.runtime import Drain, logprobs_to_pb, node_identity, sampling_params_from_pb, trace_events_to_pb

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self, worker: PrefillWorker, worker_id: str, address: str, request_timeout_s: float, drain: Drain | None = None
    ) -> None:
        self.worker = worker
        self.worker_id = worker_id
        self.node_id, self.node_host = node_identity()
        self.address = address
        self.request_timeout_s = request_timeout_s
        self.drain = drain or Drain()
        self._kv_targets: frozenset[str] = frozenset()  # replaced whole by SetKvTargets

    @property
    def kv_targets(self) -> frozenset[str]:
        return self._kv_targets

    def SetKvTargets(
        self,
        request: worker_pb2.KvTargets,  # noqa: N802
        context: grpc.ServicerContext,
    ) -> worker_pb2.KvTargetsAck:
        if not is_router_call(context.invocation_metadata()):
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "only the router may set KV targets (router credential missing or wrong)",
            )
        targets = frozenset(t for t in request.targets if t)
        if targets != self._kv_targets:
            log.info("KV targets: %s", ", ".join(sorted(targets)) or "none")
        self._kv_targets = targets
        return worker_pb2.KvTargetsAck(num_targets=len(targets))

    def unhealthy_reason(self) -> str:
        """Why this worker takes no new requests ("" when it does)."""
        if not self.worker.loop_alive():
            return "engine loop died"
        return "draining" if self.drain.draining else ""

    async def Prefill(
        self,
        request: worker_pb2.PrefillRequest,  # noqa: N802
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PrefillResponse:
        if reason := self.unhealthy_reason():
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.worker_id}: {reason}")
        try:
            job = PrefillJob(
                request_id=request.request_id,
                prompt_ids=list(request.prompt_token_ids),
                params=sampling_params_from_pb(request.params),
                kv_target=request.kv_target_address,
                kv_backend=request.kv_backend or "grpc",
                output_index=request.output_index,
                kv_block_offset=request.kv_block_offset,
                trace=request.trace,
                kv_checksum=request.kv_checksum,
            )
            if not job.request_id or not job.prompt_ids or not job.kv_target:
                raise RequestInvalid("request_id, prompt_token_ids and kv_target_address are required")
            if job.kv_checksum and job.kv_checksum not in CHECKSUM_ALGORITHMS:
                raise RequestInvalid(f"kv_checksum: {job.kv_checksum!r} is not one of {', '.join(CHECKSUM_ALGORITHMS)}")
            if job.kv_target not in self._kv_targets:
                raise PermissionError(
                    f"kv_target_address {job.kv_target!r} is not a decode worker registered "
                    f"with prefill worker {self.worker_id}"
                )
            future = self.worker.submit(job)
        except OverflowError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except PermissionError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except RequestInvalid as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 - not the request's fault: our bug, said as such
            log.error("request_id=%s: reading the request failed: %s", request.request_id, exc, exc_info=exc)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"prefill failed: internal error: {type(exc).__name__}: {exc}"
            )
        remaining = context.time_remaining()
        timeout = min(self.request_timeout_s, remaining) if remaining is not None else self.request_timeout_s
        try:  # a cancelled call cancels the wrapped future, which drops the job if still queued
            result = await asyncio.wait_for(asyncio.wrap_future(future), timeout=timeout)
        except asyncio.TimeoutError:
            future.cancel()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill did not finish in {timeout:.1f}s")
        except KvTransferError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {exc}")
        except RequestInvalid as exc:  # the engine refused the request itself
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            log.error("request_id=%s: prefill failed: %s", job.request_id, exc, exc_info=exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {exc}")
        response = worker_pb2.PrefillResponse(
            request_id=job.request_id,
            first_token_id=result.first_token_id,
            kv_bytes=result.kv_bytes,
            timings=common_pb2.Timings(
                queue_s=result.queue_s, prefill_s=result.prefill_s, kv_transfer_s=result.kv_transfer_s
            ),
            trace=trace_events_to_pb(result.trace, self.worker_id, self.worker.loaded.tokenizer),
            cached_tokens=result.cached_tokens,
        )
        if result.first_logprob is not None or result.prompt_logprobs is not None:
            add_prefill_logprobs(response, result, self.worker.loaded.tokenizer)
        return response

    def GetInfo(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.WorkerInfo:  # noqa: N802
        w = self.worker
        return common_pb2.WorkerInfo(
            worker_id=self.worker_id,
            role=common_pb2.WORKER_ROLE_PREFILL,
            address=self.address,
            pid=os.getpid(),
            queue_depth=w.queue_depth,
            queued_prompt_tokens=w.queued_tokens,
            kv_blocks_used=w.pool.num_used,
            kv_blocks_total=w.pool.num_blocks,
            healthy=not self.unhealthy_reason(),
            unhealthy_reason=self.unhealthy_reason(),
            prefill_tokens_computed=w.runner.num_prefill_tokens,
            kv_bytes_sent=w.kv_bytes_sent,
            requests_finished=w.requests_finished,
            prefix_cache_hit_blocks=w.pool.cache_hits,
            prefix_cache_blocks=w.pool.num_cached,
            kv_segment_prefix=segment_prefix(),
            node_id=self.node_id,
            host=self.node_host,
            kv_block_size=w.pool.block_size,
            kernels=getattr(w.runner, "kernels", ""),
        )


def add_prefill_logprobs(response: worker_pb2.PrefillResponse, result: PrefillResult, tokenizer: Any) -> None:  # noqa: ANN401
    """The first token's and the prompt's log-probabilities, computed here, onto the answer."""
    first = [result.first_logprob] if result.first_logprob is not None else []
    converted = logprobs_to_pb(first + list(result.prompt_logprobs or ()), tokenizer)
    if first:
        response.first_logprob.CopyFrom(converted.pop(0))
    response.prompt_logprobs.extend(converted)
