"""Live migration, source side: suspend a decoding request, then push its K/V to the decode worker
that takes it over (the target's `KvIntake.migrate_in` expects them) and free them here.

K/V go only to decode workers the router registered (`set_targets`): a MigrateOut naming any other
address is NotPermitted. The blocks stay held while suspended (no step writes them while they are
read) and are freed when the push ended, or when the hold expires.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.decode_worker.outcomes import NotFound, NotPermitted, WrongState, internal_fault
from pdserve.decode_worker.worker import DecodeWorker, WorkerDead
from pdserve.engine.block_pool import blocks_for_tokens
from pdserve.engine.sequence import Sequence
from pdserve.failures import DECODE, RequestInvalid, WorkerUnavailable
from pdserve.kv_transfer import KvSender, KvSpec, KvTransferError, get_backend
from pdserve.v1 import worker_pb2

log = logging.getLogger(__name__)


class MigrationSource:
    def __init__(self, worker: DecodeWorker, worker_id: str, kv_timeout_s: float) -> None:
        self.worker = worker
        self.worker_id = worker_id
        self.kv_timeout_s = kv_timeout_s  # how long a suspended request is held, and a push may take
        self.kv_targets: frozenset[str] = frozenset()  # decode workers migrated K/V may go to

    def set_targets(self, targets: frozenset[str]) -> None:
        if targets != self.kv_targets:
            log.info("migration KV targets: %s", ", ".join(sorted(targets)) or "none")
        self.kv_targets = targets

    async def suspend(self, request_id: str) -> Sequence:
        """Stop decoding `request_id` and hold its blocks; NotFound / WrongState otherwise."""
        try:
            seq = await asyncio.wrap_future(self.worker.suspend(request_id, hold_s=self.kv_timeout_s))
        except KeyError as exc:
            raise NotFound(str(exc.args[0])) from exc
        except ValueError as exc:
            raise WrongState(str(exc)) from exc
        except WorkerDead as exc:
            raise WorkerUnavailable(f"decode worker {self.worker_id}: {exc}", DECODE) from exc
        log.info("request_id=%s suspended for migration after %d output tokens", request_id, len(seq.output_ids))
        return seq

    async def migrate_out(self, request: worker_pb2.MigrateOutRequest) -> worker_pb2.MigrateOutResponse:
        """Push a suspended request's K/V to a registered decode worker, then free them here."""
        target = request.kv_target_address
        if target not in self.kv_targets:
            raise NotPermitted(
                f"kv_target_address {target!r} is not a decode worker registered with decode worker {self.worker_id}"
            )
        try:
            seq = await asyncio.wrap_future(self.worker.suspended(request.request_id))
        except KeyError:
            raise NotFound(f"request {request.request_id} is not suspended here") from None
        backend = request.kv_backend or "grpc"
        spec, sender = self._plan(request, seq, backend)
        blocks = seq.block_table[
            spec.block_offset : blocks_for_tokens(spec.num_tokens, self.worker.engine.pool.block_size)
        ]
        started = time.perf_counter()
        try:  # the blocks are held (suspended): no step writes them while they are read here
            await asyncio.to_thread(
                sender.send_blocks,
                spec,
                self.worker.engine.kv_cache,
                blocks,
                seq.output_ids[-1],
                timeout_s=self.kv_timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 - reported to the target, which fails over
            self.worker.release_suspended(request.request_id)
            self.worker.metrics.kv_failed(backend, "send")
            raise WorkerUnavailable(f"migrating KV to {target}: {exc}", DECODE) from exc
        transfer_s = time.perf_counter() - started
        self.worker.release_suspended(request.request_id, migrated=True)
        self.worker.metrics.kv_transferred(backend, "send", spec.nbytes, transfer_s)
        log.info(
            "request_id=%s migrated out to %s (%s): %d tokens, %d bytes in %.3fs",
            request.request_id,
            request.target_worker_id,
            target,
            spec.num_tokens,
            spec.nbytes,
            transfer_s,
        )
        return worker_pb2.MigrateOutResponse(
            kv_bytes=spec.nbytes, kv_transfer_s=transfer_s, last_token_id=seq.output_ids[-1]
        )

    def _plan(self, request: worker_pb2.MigrateOutRequest, seq: Sequence, backend: str) -> tuple[KvSpec, KvSender]:
        """What to push and the sender: RequestInvalid for what the target asked wrongly."""
        num_tokens = seq.num_tokens - 1
        try:
            if backend not in ("grpc", "ray"):
                raise RequestInvalid(f"kv_backend: migration ships over grpc or ray, not {backend!r}")
            if request.num_tokens != num_tokens:
                raise RequestInvalid(
                    f"num_tokens: this worker holds {num_tokens} tokens of K/V, not {request.num_tokens}"
                )
            try:  # what it refuses here is the request's: the target's id and block offset
                spec = KvSpec.for_cache(
                    request.target_request_id,
                    self.worker.loaded.fingerprint,
                    self.worker.engine.kv_cache.shape,
                    num_tokens,
                    request.kv_block_offset,
                )
            except ValueError as exc:
                raise RequestInvalid(str(exc)) from exc
            return spec, get_backend(backend).sender_factory(request.kv_target_address)
        except (RequestInvalid, KvTransferError):
            raise
        except Exception as exc:  # noqa: BLE001 - not the request's fault: our bug, said as such
            raise internal_fault(
                self.worker_id, request.request_id, f"MigrateOut to {request.kv_target_address}", exc
            ) from exc
