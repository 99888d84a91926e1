"""gRPC KV transfer backend ("grpc"): client-streaming ``KvTransfer.PushKv``.

Sender (prefill worker): :class:`GrpcKvSender` streams the frames of
:func:`kv_transfer.framing.encode_frames` over one cached channel per target address and
returns the receiver's ack, or raises :class:`KvTransferError`.

Receiver (decode worker): :class:`KvTransferServicer`, added to the worker's ``grpc.Server``,
holds the pending intakes registered with :meth:`KvTransferServicer.expect`.

Invariants:

- A stream is accepted only for a pending, not yet claimed request id; anything else is
  refused with ``ok=false`` and touches no other request.
- An invalid frame, a broken stream, a missed deadline or a cancel fails THAT intake only
  (its :class:`PendingKv` gets a :class:`KvTransferError`) and the server keeps serving.
- Every intake completes exactly once and leaves the registry when it does; a background
  reaper fails intakes whose deadline passed (and cancels their stalled RPC), so waiters never
  hang past the deadline.
- The receiving ``grpc.Server`` must accept messages of ``max_frame_bytes`` plus header: build
  it with ``options=grpc_message_options(max_frame_bytes)``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import grpc
import torch

from pdserve.kv_transfer.base import (
    ExpectOptions,
    KvReceiver,
    KvSender,
    KvSpec,
    KvTransferError,
    LayerSource,
    PendingKv,
    SenderCache,
    register_backend,
)
from pdserve.kv_transfer.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_TOTAL_BYTES,
    FrameAssembler,
    KvFrameError,
    encode_frames,
    encode_frames_as_ready,
)
from pdserve.transport import open_channel
from pdserve.v1 import kv_pb2_grpc
from pdserve.v1.kv_pb2 import KvAck, KvFrame

BACKEND_NAME = "grpc"
#: Room for the KvHeader and protobuf overhead on top of a frame's data.
HEADER_MARGIN_BYTES = 64 * 1024


def grpc_message_options(max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[tuple[str, int]]:
    """Channel/server options letting frames of ``max_frame_bytes`` data through."""
    size = max_frame_bytes + HEADER_MARGIN_BYTES
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


class GrpcKvSender(KvSender):
    """Pushes KV to one receiver address over a single (thread-safe) cached channel."""

    supports_layer_streaming = True

    def __init__(self, target_address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.target_address = target_address
        self.max_frame_bytes = max_frame_bytes
        self._channel = open_channel(target_address, options=grpc_message_options(max_frame_bytes))
        self._stub = kv_pb2_grpc.KvTransferStub(self._channel)

    def send(
        self,
        spec: KvSpec,
        kv: torch.Tensor,
        first_token_id: int,
        timeout_s: float,
        frame_filter: Callable[[Iterator[KvFrame]], Iterator[KvFrame]] | None = None,
    ) -> KvAck:
        """Stream ``kv`` to the receiver; return its ok ack or raise KvTransferError.

        ``frame_filter`` rewrites the frame stream on its way out; only fault injection uses it."""
        frames = encode_frames(spec, kv, first_token_id, self.max_frame_bytes)
        if frame_filter is not None:
            frames = frame_filter(frames)
        return self.send_frames(spec, frames, timeout_s)

    def send_layers(self, spec: KvSpec, source: LayerSource, timeout_s: float) -> KvAck:
        """Layer-wise streaming: each frame is built once the layers it covers are ready."""
        return self.send_frames(spec, encode_frames_as_ready(spec, source.buffer, 0, source.wait_layers), timeout_s)

    def send_frames(self, spec: KvSpec, frames: Iterator[KvFrame], timeout_s: float) -> KvAck:
        """Stream frames already built (by `send`, or as layers land for layer-wise streaming)."""
        try:
            ack: KvAck = self._stub.PushKv(frames, timeout=timeout_s)
        except grpc.RpcError as err:
            code = err.code().name if isinstance(err, grpc.Call) else "UNKNOWN"
            details = err.details() if isinstance(err, grpc.Call) else str(err)
            raise KvTransferError(
                f"PushKv {spec.request_id!r} to {self.target_address} failed: {code}: {details}"
            ) from err
        if not ack.ok:
            raise KvTransferError(f"PushKv {spec.request_id!r} refused by {self.target_address}: {ack.error}")
        return ack

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


_SENDERS: SenderCache[GrpcKvSender] = SenderCache(GrpcKvSender)


def get_sender(target_address: str) -> GrpcKvSender:
    """Return the process-wide cached sender (and channel) for ``target_address``."""
    return _SENDERS.get(target_address)


def close_senders() -> None:
    """Close every cached sender (process shutdown, tests)."""
    _SENDERS.close_all()


class GrpcPendingKv(PendingKv):
    """One registered intake: a future completed once by the stream handler, reaper or cancel."""

    def __init__(self, spec: KvSpec, options: ExpectOptions, on_finish: Callable[[GrpcPendingKv], None]) -> None:
        self.spec = spec
        self.options = options  # how it may be completed (KvReceiver.expect)
        self.deadline_s = options.deadline_s
        self.deadline_at = time.monotonic() + options.deadline_s
        self._future: concurrent.futures.Future[tuple[torch.Tensor, int]] = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._on_finish = on_finish
        self._claimed = False
        self._context: grpc.ServicerContext | None = None

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    def wait(self, timeout: float | None = None) -> tuple[torch.Tensor, int]:
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise KvTransferError(f"KV for {self.request_id!r} not complete after waiting {timeout}s") from None

    def done(self) -> bool:
        return self._future.done()

    def cancel(self, reason: str = "cancelled") -> bool:
        return self.fail(f"KV intake for {self.request_id!r} cancelled: {reason}")

    def add_done_callback(self, fn: Callable[[PendingKv], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def error(self) -> str:
        """The failure message, or "" if not failed (yet)."""
        if not self._future.done() or self._future.exception() is None:
            return ""
        return str(self._future.exception())

    def claim(self, context: grpc.ServicerContext) -> bool:
        """Bind the (single) incoming stream to this intake; False if already bound or done."""
        with self._lock:
            if self._claimed or self._future.done():
                return False
            self._claimed, self._context = True, context
            return True

    def unclaim(self) -> None:
        """Let another stream deliver this intake (its sender takes another path for the same K/V)."""
        with self._lock:
            self._claimed, self._context = False, None

    def succeed(self, kv: torch.Tensor, first_token_id: int) -> bool:
        """Complete with the assembled tensor; False if it had already failed."""
        with self._lock:
            if self._future.done():
                return False
            self._future.set_result((kv, first_token_id))
        self._on_finish(self)
        return True

    def fail(self, message: str, cancel_stream: bool = True) -> bool:
        """Fail with KvTransferError(message); False if already done.

        ``cancel_stream`` cancels a bound PushKv RPC (stalled sender); the stream handler itself
        passes False so that its ok=false ack still reaches the sender.
        """
        with self._lock:
            if self._future.done():
                return False
            self._future.set_exception(KvTransferError(message))
            context = self._context
        self._on_finish(self)
        cancel = getattr(context, "cancel", None)  # grpc.aio runs PushKv with a context that cannot cancel
        if cancel_stream and cancel is not None:
            cancel()
        return True


class KvTransferServicer(kv_pb2_grpc.KvTransferServicer, KvReceiver):
    """Receiving side: registry of pending intakes plus the ``PushKv`` handler."""

    def __init__(self, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> None:
        self.max_total_bytes = max_total_bytes
        self._pending: dict[str, GrpcPendingKv] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._reaper = threading.Thread(target=self._reap_loop, name="kv-intake-reaper", daemon=True)
        self._reaper.start()

    def add_to_server(self, server: grpc.Server) -> None:
        """Register this servicer on ``server`` (built with ``grpc_message_options``)."""
        kv_pb2_grpc.add_KvTransferServicer_to_server(self, server)

    def expect(self, spec: KvSpec, options: ExpectOptions) -> GrpcPendingKv:
        """Register an intake for ``spec.request_id`` (every option of ExpectOptions is honoured: the
        gRPC stream, the "shm" control frame and `deliver` all complete intakes registered here)."""
        if spec.nbytes > self.max_total_bytes:
            raise ValueError(f"KV payload of {spec.nbytes} bytes exceeds limit {self.max_total_bytes}")
        pending = GrpcPendingKv(spec, options, self._forget)
        with self._cond:
            if self._closed:
                raise KvTransferError("KV receiver is closed")
            if spec.request_id in self._pending:
                raise ValueError(f"request_id {spec.request_id!r} already has a pending KV intake")
            self._pending[spec.request_id] = pending
            self._cond.notify_all()
        return pending

    def pending(self, request_id: str) -> GrpcPendingKv | None:
        """The registered, not yet complete intake of ``request_id``, or None."""
        with self._cond:
            return self._pending.get(request_id)

    def num_pending(self) -> int:
        """Intakes registered and not yet complete."""
        with self._cond:
            return len(self._pending)

    def close(self) -> None:
        """Fail every pending intake and stop the reaper."""
        with self._cond:
            self._closed = True
            pending = list(self._pending.values())
            self._cond.notify_all()
        for p in pending:
            p.fail(f"KV receiver closed before KV for {p.request_id!r} arrived")

    def deliver(self, spec: KvSpec, kv: torch.Tensor | Callable[[], torch.Tensor], first_token_id: int) -> None:
        """Complete the pending intake of ``spec.request_id`` with an already-assembled tensor (other
        backends, e.g. "ray"). ``kv`` may be a callable that fetches the tensor: it runs only after
        the intake was found, claimed and its spec matched. Every check failure fails THAT intake
        (the owner then frees its blocks) and raises KvTransferError; so does an unknown request id."""
        pending = self.pending(spec.request_id)
        if pending is None:
            raise KvTransferError(f"unknown request_id {spec.request_id!r}: no pending KV intake")
        if not pending.claim(None):  # type: ignore[arg-type]
            raise KvTransferError(f"request_id {spec.request_id!r} is already being received")
        try:
            if spec != pending.spec:
                raise KvTransferError(f"KV header {spec} does not match the expected {pending.spec}")
            if pending.options.require_checksum:
                raise KvTransferError(
                    f"a delivered tensor carries no checksum; the intake requires {pending.options.require_checksum}"
                )
            tensor = kv() if callable(kv) else kv
            if tuple(tensor.shape) != pending.spec.shape or tensor.dtype != pending.spec.torch_dtype:
                raise KvTransferError(
                    f"KV tensor {tuple(tensor.shape)} {tensor.dtype} does not match the "
                    f"expected {pending.spec.shape} {pending.spec.dtype}"
                )
        except Exception as err:  # noqa: BLE001 - fail this intake only, tell the caller why
            message = err if isinstance(err, KvTransferError) else f"{type(err).__name__}: {err}"
            pending.fail(f"KV for {spec.request_id!r} refused: {message}", cancel_stream=False)
            raise KvTransferError(pending.error() or str(message)) from err
        if not pending.succeed(tensor, first_token_id):
            raise KvTransferError(pending.error() or f"KV intake for {spec.request_id!r} already finished")

    def PushKv(self, request_iterator: Iterable[KvFrame], context: grpc.ServicerContext) -> KvAck:  # noqa: N802
        """Receive one request's frames; ack ok only when the intake completed."""
        frames = iter(request_iterator)
        first = next(frames, None)
        if first is None:
            return KvAck(ok=False, error="empty KV stream")
        request_id = first.header.request_id
        pending = self.pending(request_id)
        if pending is None:
            return KvAck(
                request_id=request_id,
                ok=False,
                error=f"unknown request_id {request_id!r}: no pending KV intake",
            )
        if not pending.claim(context):
            return KvAck(request_id=request_id, ok=False, error=f"request_id {request_id!r} is already being received")
        if first.header.shm_name or first.header.cuda_ipc_descriptor:  # same host: one control frame
            return self._receive_control(pending, first, context)
        return self._receive(pending, itertools.chain([first], frames))

    def _receive_control(self, pending: GrpcPendingKv, frame: KvFrame, context: grpc.ServicerContext) -> KvAck:
        """A control frame naming the sender's memory: a shared-memory segment ("shm") or a device
        pool's CUDA IPC handle ("cuda_ipc"); the blocks are copied from there, never sent."""
        from pdserve.kv_transfer import cuda_ipc_backend, shm_backend
        from pdserve.kv_transfer.cuda_ipc import IpcUnavailable
        from pdserve.kv_transfer.shm_backend import ACK_MARGIN_S, InPlaceKv, expected_checksum, read_blocks

        header = frame.header
        options = pending.options
        kind = "cuda_ipc" if header.cuda_ipc_descriptor else "shm"
        locate = cuda_ipc_backend.locate_blocks if header.cuda_ipc_descriptor else shm_backend.locate_blocks
        error = ""
        try:
            source, ids = locate(header, pending.spec, options.shm_segment_prefix, options.require_checksum)
        except IpcUnavailable as err:  # this process cannot map that device: the sender takes the host path
            pending.unclaim()
            return KvAck(request_id=pending.request_id, ok=False, error=f"{cuda_ipc_backend.HOST_PATH_PLEASE}: {err}")
        except ValueError as err:
            error = str(err)
        if not error:
            try:
                if options.in_place:  # the consumer copies into its cache; ack once it did
                    kv = InPlaceKv(source, ids, pending.spec.nbytes, expected_checksum(header))
                    if pending.succeed(kv, frame.header.first_token_id):  # type: ignore[arg-type]
                        remaining = context.time_remaining()
                        budget = pending.deadline_s if remaining is None else remaining - ACK_MARGIN_S
                        if kv.wait_consumed(budget):
                            return KvAck(request_id=pending.request_id, ok=True, bytes_received=pending.spec.nbytes)
                        return KvAck(
                            request_id=pending.request_id,
                            ok=False,
                            error=kv.error or "the decode worker did not take the KV (request ended or timed out)",
                        )
                elif pending.succeed(
                    read_blocks(source, ids, pending.spec, expected_checksum(header)), frame.header.first_token_id
                ):
                    return KvAck(request_id=pending.request_id, ok=True, bytes_received=pending.spec.nbytes)
                error = pending.error() or "KV intake already finished"
            except (OSError, ValueError) as err:
                error = f"shm segment {frame.header.shm_name!r}: {err}" if kind == "shm" else str(err)
        pending.fail(f"invalid {kind} KV for {pending.request_id!r}: {error}", cancel_stream=False)
        return KvAck(request_id=pending.request_id, ok=False, error=pending.error() or error)

    def _receive(self, pending: GrpcPendingKv, frames: Iterator[KvFrame]) -> KvAck:
        assembler = FrameAssembler(pending.spec, self.max_total_bytes)
        try:
            for frame in frames:
                if pending.done():
                    break
                assembler.add(frame)
                if assembler.complete:
                    break
            if not pending.done():
                kv, first_token_id = assembler.finish()
                if pending.succeed(kv, first_token_id):
                    return self._ack(pending, assembler, "")
        except KvFrameError as err:
            pending.fail(f"invalid KV frame for {pending.request_id!r}: {err}", cancel_stream=False)
        except Exception as err:  # noqa: BLE001 - broken/cancelled stream: fail this intake only
            pending.fail(
                f"KV stream for {pending.request_id!r} broke: {type(err).__name__}: {err}",
                cancel_stream=False,
            )
        return self._ack(pending, assembler, pending.error() or "KV intake already finished")

    @staticmethod
    def _ack(pending: GrpcPendingKv, assembler: FrameAssembler, error: str) -> KvAck:
        return KvAck(request_id=pending.request_id, ok=not error, error=error, bytes_received=assembler.bytes_received)

    def _forget(self, pending: GrpcPendingKv) -> None:
        with self._cond:
            if self._pending.get(pending.request_id) is pending:
                del self._pending[pending.request_id]

    def _reap_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                expired = [p for p in self._pending.values() if p.deadline_at <= now]
                if not expired:
                    next_at = min((p.deadline_at for p in self._pending.values()), default=None)
                    self._cond.wait(None if next_at is None else next_at - now)
                    continue
            for p in expired:
                p.fail(f"deadline: KV for {p.request_id!r} not received within {p.deadline_s}s")


register_backend(BACKEND_NAME, get_sender)
