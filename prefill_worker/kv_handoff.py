"""The prefill side of the KV contract: the prefill worker's `KvConnector`, which ships every
finished prefill's blocks to the decode worker that asked (decode_worker/kv_intake.py takes them in).

The engine calls it on its loop thread, inside `step` (it must not block there): `layer_hook` before
a pass that completes prompts (`--kv-streaming layer`: frames leave while the pass still runs),
`pass_failed` when that pass raised, `prefill_done` once a prompt's K/V are complete and its first
token sampled. Transfers run on their own threads. The connector frees nothing: when a transfer
ended (acknowledged or failed) it tells its owner (`HandoffOwner`), whose loop thread releases the
blocks (`LLMEngine.release_handoff`), a no-op if a failed pass already ended the sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Protocol

import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_connector import KvConnector
from pdserve.engine.model_runner import LayerCallback
from pdserve.engine.sequence import Sequence
from pdserve.kv_transfer import KvSpec, get_backend
from pdserve.kv_transfer.base import KvSender
from pdserve.omp_pool import release_thread_pool
from pdserve.prefill_worker.faults import FaultInjector
from pdserve.prefill_worker.job import PrefillJob
from pdserve.prefill_worker.layer_stream import LayerStream

log = logging.getLogger(__name__)

KV_STREAMING_MODES = ("request", "layer")


class HandoffOwner(Protocol):
    """What the connector needs of the worker that owns the engine."""

    @property
    def kv_cache(self) -> KVCache: ...

    def job(self, key: str) -> PrefillJob:
        """The job whose sequence the engine keys `key` (loop thread)."""

    def prefilled(self, seq: Sequence) -> PrefillJob:
        """`seq`'s K/V are complete and its first token sampled: account it; its job (loop thread)."""

    def shipped(self, job: PrefillJob, spec: KvSpec, first_token: int, transfer_s: float) -> None:
        """The decode side acknowledged `job`'s K/V (a transfer thread)."""

    def not_shipped(self, job: PrefillJob, error: Exception) -> None:
        """`job`'s K/V did not reach the decode side (a transfer thread)."""

    def transfer_ended(self, job: PrefillJob, seq: Sequence) -> None:
        """Either way: release `seq`'s blocks (posts to the loop thread; any thread)."""


class KvHandoff(KvConnector):
    def __init__(
        self,
        owner: HandoffOwner,
        fingerprint: str,
        transfer_timeout_s: float,
        kv_streaming: str = "request",
        faults: FaultInjector | None = None,
    ) -> None:
        if kv_streaming not in KV_STREAMING_MODES:
            raise ValueError(f"kv_streaming must be one of {KV_STREAMING_MODES}, got {kv_streaming!r}")
        self.owner = owner
        self.fingerprint = fingerprint
        self.transfer_timeout_s = transfer_timeout_s
        self.kv_streaming = kv_streaming
        self.faults = faults or FaultInjector(None, 0)
        self._streams: dict[str, LayerStream] = {}  # engine key -> layer stream of the pass running (loop thread)
        # serial threads: a KV copy here must not start a second OpenMP pool (pdserve/omp_pool.py)
        self._transfers = ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="kv-send", initializer=release_thread_pool
        )

    def stop(self) -> None:
        """Wait for the transfers under way; drop those not started."""
        self._transfers.shutdown(wait=True, cancel_futures=True)

    def spec_for(self, job: PrefillJob) -> KvSpec:
        """What `job` ships: its prompt's blocks from `kv_block_offset` on."""
        return KvSpec.for_cache(
            job.request_id, self.fingerprint, self.owner.kv_cache.shape, len(job.prompt_ids), job.kv_block_offset
        )

    def fail_streams(self, error: Exception) -> None:
        """A step raised outside the engine's isolation: every layer stream under way fails."""
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()

    # ----- KvConnector (loop thread, inside engine.step) ----------------------------------------
    def layer_hook(self, completing: list[Sequence]) -> LayerCallback | None:
        """Start a layer-wise transfer for each prompt this pass completes whose backend can stream
        layers (`--kv-streaming layer`); the others ship after the pass, as with `request`."""
        if self.kv_streaming != "layer":
            return None
        streaming = []
        for seq in completing:
            job = self.owner.job(seq.request_id)
            if self._can_stream_layers(job):
                spec = self.spec_for(job)
                stream = LayerStream(torch.empty(spec.shape, dtype=spec.torch_dtype), self.transfer_timeout_s)
                self._streams[seq.request_id] = stream
                self._transfers.submit(self._transfer, job, seq, partial(self._send_layers, job, spec, stream))
                streaming.append((stream, seq.block_table[job.kv_block_offset :]))
        if not streaming:
            return None
        kv = self.owner.kv_cache.kv

        def on_layer_done(layer: int) -> None:
            for stream, blocks in streaming:
                stream.buffer[layer] = kv[layer, :, blocks]  # [2, n, block, heads, dim]
                stream.layer_done(layer)

        return on_layer_done

    def pass_failed(self, completing: list[Sequence], error: Exception) -> list[Sequence]:
        """Streams of the failed pass carry partial K/V: fail them; the engine fails their sequences."""
        lost = []
        for seq in completing:
            stream = self._streams.pop(seq.request_id, None)
            if stream is not None:
                stream.fail(error)
                lost.append(seq)
        return lost

    def prefill_done(self, seq: Sequence, first_token: int) -> None:
        job = self.owner.prefilled(seq)
        stream = self._streams.pop(seq.request_id, None)
        if stream is not None:
            stream.finish(first_token)  # its transfer thread is already sending
        else:
            shipped = list(seq.block_table[job.kv_block_offset :])
            self._transfers.submit(self._transfer, job, seq, partial(self._send_blocks, job, shipped, first_token))

    # ----- transfer threads -------------------------------------------------------------------
    def _transfer(self, job: PrefillJob, seq: Sequence, send: Callable[[], tuple[KvSpec, int]]) -> None:
        """Run `send` (it returns what it shipped and the first token), tell the owner how it went,
        and in every case have it release `seq`'s blocks."""
        start = time.perf_counter()
        try:
            spec, token = send()
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            log.warning("request_id=%s: KV transfer to %s failed: %s", job.request_id, job.kv_target, exc)
            self.owner.not_shipped(job, exc)
        else:
            self.owner.shipped(job, spec, token, time.perf_counter() - start)
        finally:
            self.owner.transfer_ended(job, seq)

    def _send_blocks(self, job: PrefillJob, shipped: list[int], token: int) -> tuple[KvSpec, int]:
        """Ship the job's blocks once its pass is over (`--kv-streaming request`)."""
        spec = self.spec_for(job)
        sender = self._sender(job)
        cache = self.owner.kv_cache
        fault = self.faults.next_filter()
        if fault is None:
            sender.send_blocks(spec, cache, shipped, token, timeout_s=self.transfer_timeout_s, checksum=job.kv_checksum)
        else:
            log.warning("request_id=%s: injecting a KV fault (%s)", job.request_id, fault.__name__)
            sender.send(spec, cache.gather(shipped), token, timeout_s=self.transfer_timeout_s, frame_filter=fault)  # type: ignore[call-arg]
        return spec, token

    def _send_layers(self, job: PrefillJob, spec: KvSpec, stream: LayerStream) -> tuple[KvSpec, int]:
        """Stream frames as the pass fills `stream` layer by layer, then take the first token."""
        self._sender(job).send_layers(spec, stream, timeout_s=self.transfer_timeout_s)
        return spec, stream.first_token()

    def _can_stream_layers(self, job: PrefillJob) -> bool:
        try:
            return self._sender(job).supports_layer_streaming
        except Exception:  # noqa: BLE001 - a bad backend or target fails the job in `_send_blocks`, not the pass
            return False

    @staticmethod
    def _sender(job: PrefillJob) -> KvSender:
        return get_backend(job.kv_backend).sender_factory(job.kv_target)
