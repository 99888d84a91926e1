"""Ray object-store KV transfer backend ("ray"), for workers running as Ray actors.

Sender (prefill worker): :class:`RayKvSender` ``ray.put``s the request's KV as a flat uint8 numpy
array (C order, so any dtype incl. bfloat16 travels as plain bytes), then calls ``receive_kv`` of the decode
actor named by the target (``ray:<actor name>``, namespace :data:`NAMESPACE`) with a plain dict header
(the fields of ``KvHeader`` that describe a whole payload) and the ObjectRef wrapped in a list (so
Ray hands the ref over instead of resolving it). It returns once the receiver answered, after
which the caller frees its blocks and the ref goes out of scope.

Receiver (decode worker): :class:`RayKvReceiver` completes the pending intakes of the worker's
:class:`KvTransferServicer` (the same registry the gRPC backend uses): it rebuilds a
:class:`KvSpec` from the header, and :meth:`KvTransferServicer.deliver` checks it against the
pending intake BEFORE the object is fetched; only then ``ray.get`` (zero-copy from shared memory
on the same node), a size/type check, and a dtype/shape view of the bytes. Our code unpickles
nothing: the header is a dict of str/int, the payload a numpy byte array (Ray's own
serialization of actor-call arguments is Ray's business).

Layer-wise streaming (``--kv-streaming layer``): :meth:`RayKvSender.send_layers` splits the request
into parts of whole layers (:func:`plan_parts`: at least :data:`MIN_PART_BYTES` each), and as soon as a
part's layers are final it ``ray.put``s them and submits a non-blocking ``receive_kv_part(header,
part, [ref])`` call, so parts travel while later layers are still computed; it returns once every
part was acknowledged. The header is the whole-request one with first_token_id 0 (the first token
travels in the PrefillResponse), ``part`` a plain dict ``{layer_start, layer_end, part_bytes}``.
:meth:`RayKvReceiver.receive_part` takes parts in any order and concurrently: the first part of a
request claims its pending intake (so no other transfer can complete it) and each part is checked
(header == the intake's spec, layer range inside the spec, no overlap with layers already taken,
payload of exactly the range's bytes) before it is copied into the request's assembly buffer; the
part completing the last layer completes the intake. A bad part fails that intake only; a sender
whose layers never became ready (prefill failed, deadline) sends ``{"abort": reason}`` instead. An
assembly lives exactly as long as its intake is pending: when the intake completes, fails, is
cancelled or expires (its done callback), the assembly and its buffer are dropped.

Failures: an owner that died (``OwnerDiedError``) or a lost object (``ObjectLostError``) fails the
intake, and the decode worker then answers UNAVAILABLE "prefill failed on ..." so the router
prefills the request elsewhere. A header that does not match fails that intake only.

Only this module and ``cluster/`` import ``ray``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Any

import numpy as np
import torch

from pdserve.constants import RAY_NAMESPACE
from pdserve.extras import missing_extra

try:
    import ray
    from ray.exceptions import GetTimeoutError, ObjectLostError, RayError
except ImportError as exc:
    raise missing_extra("ray", "The ray KV backend (--kv-backend ray)") from exc

from pdserve.kv_transfer.base import (
    ExpectOptions,
    KvReceiver,
    KvSender,
    KvSpec,
    KvTransferError,
    LayerSource,
    SenderCache,
    register_backend,
)
from pdserve.kv_transfer.grpc_backend import GrpcPendingKv, KvTransferServicer
from pdserve.v1.kv_pb2 import KvAck

BACKEND_NAME = "ray"
TARGET_PREFIX = "ray:"
NAMESPACE = RAY_NAMESPACE
HEADER_FIELDS = (
    "request_id",
    "model_fingerprint",
    "dtype",
    "shape",
    "block_size",
    "num_tokens",
    "block_offset",
    "first_token_id",
    "total_bytes",
)
PART_FIELDS = ("layer_start", "layer_end", "part_bytes")
#: Smallest part of a layer-wise send: whole layers are grouped until a part holds at least this many
#: bytes. Each part costs a ray.put and an actor call (a fraction of a millisecond, and objects under
#: 100 KiB are copied inline through the call), which would dominate for small layers (short prompts,
#: small models); from 1 MiB on the copy dominates, and a long prompt's layers exceed it on their own,
#: so they still travel one per part. The tail after the pass is at most one part.
MIN_PART_BYTES = 1 << 20
#: How long a failed layer-wise send waits for the receiver to take its abort (best effort).
ABORT_WAIT_S = 2.0
MAX_ABORT_CHARS = 1000


def actor_name(target: str) -> str:
    """``ray:decode-0`` -> ``decode-0``; ValueError for anything else."""
    if not target.startswith(TARGET_PREFIX) or not target[len(TARGET_PREFIX) :]:
        raise ValueError(f"ray KV target must look like 'ray:<actor name>', got {target!r}")
    return target[len(TARGET_PREFIX) :]


def header_for(spec: KvSpec, first_token_id: int) -> dict[str, Any]:
    """The plain-dict header of one payload (what ``KvHeader`` says about a whole transfer)."""
    return {
        "request_id": spec.request_id,
        "model_fingerprint": spec.model_fingerprint,
        "dtype": spec.dtype,
        "shape": list(spec.shape),
        "block_size": spec.block_size,
        "num_tokens": spec.num_tokens,
        "block_offset": spec.block_offset,
        "first_token_id": int(first_token_id),
        "total_bytes": spec.nbytes,
    }


def spec_from_header(header: object) -> tuple[KvSpec, int]:
    """Validate a received header; ValueError naming the field otherwise."""
    if not isinstance(header, dict) or set(header) != set(HEADER_FIELDS):
        raise ValueError(f"header: need exactly the fields {HEADER_FIELDS}")
    for name in ("block_size", "num_tokens", "block_offset", "first_token_id", "total_bytes"):
        if type(header[name]) is not int:
            raise ValueError(f"{name}: must be an int, got {type(header[name]).__name__}")
    shape = header["shape"]
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        raise ValueError("shape: must be a list of ints")
    spec = KvSpec(
        request_id=header["request_id"],
        model_fingerprint=header["model_fingerprint"],
        dtype=header["dtype"],
        shape=tuple(shape),
        block_size=header["block_size"],
        num_tokens=header["num_tokens"],
        block_offset=header["block_offset"],
    )
    if header["total_bytes"] != spec.nbytes:
        raise ValueError(f"total_bytes: {header['total_bytes']} != {spec.nbytes} implied by shape and dtype")
    if header["first_token_id"] < 0:
        raise ValueError(f"first_token_id: must be >= 0, got {header['first_token_id']}")
    return spec, header["first_token_id"]


def plan_parts(spec: KvSpec, min_part_bytes: int = MIN_PART_BYTES) -> list[tuple[int, int]]:
    """Layer ranges ``[start, end)`` of a layer-wise send, in order and covering every layer once: each
    holds ``ceil(min_part_bytes / spec.layer_nbytes)`` layers (at least one), the last possibly fewer."""
    if min_part_bytes < 1:
        raise ValueError(f"min_part_bytes: must be >= 1, got {min_part_bytes}")
    per_part = max(1, -(-min_part_bytes // spec.layer_nbytes))
    return [(start, min(start + per_part, spec.num_layers)) for start in range(0, spec.num_layers, per_part)]


def part_for(spec: KvSpec, layer_start: int, layer_end: int) -> dict[str, int]:
    """The plain-dict description of the part holding layers ``[layer_start, layer_end)``."""
    return {
        "layer_start": layer_start,
        "layer_end": layer_end,
        "part_bytes": (layer_end - layer_start) * spec.layer_nbytes,
    }


def part_range(part: object, spec: KvSpec) -> tuple[int, int]:
    """Validate a received part description against ``spec``; return its ``(layer_start, layer_end)``.
    ValueError naming the field otherwise."""
    if not isinstance(part, dict) or set(part) != set(PART_FIELDS):
        raise ValueError(f"part: need exactly the fields {PART_FIELDS}")
    for name in PART_FIELDS:
        if type(part[name]) is not int:
            raise ValueError(f"{name}: must be an int, got {type(part[name]).__name__}")
    start, end = part["layer_start"], part["layer_end"]
    if not 0 <= start < spec.num_layers:
        raise ValueError(f"layer_start: must be in [0, {spec.num_layers}), got {start}")
    if not start < end <= spec.num_layers:
        raise ValueError(f"layer_end: must be in [{start + 1}, {spec.num_layers}] (after layer_start), got {end}")
    expected = (end - start) * spec.layer_nbytes
    if part["part_bytes"] != expected:
        raise ValueError(f"part_bytes: {part['part_bytes']} != {expected}, the bytes of layers [{start}, {end})")
    return start, end


def payload_of(kv: torch.Tensor) -> np.ndarray:
    """The KV tensor as a flat uint8 numpy array in C order (no copy when already contiguous on CPU)."""
    return kv.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class RayKvSender(KvSender):
    """Puts one request's KV into the object store and hands the ref to the named decode actor
    (whole, or part by part as its layers become ready)."""

    supports_layer_streaming = True

    def __init__(self, target_address: str, min_part_bytes: int = MIN_PART_BYTES) -> None:
        if min_part_bytes < 1:
            raise ValueError(f"min_part_bytes: must be >= 1, got {min_part_bytes}")
        self.target_address = target_address
        self.actor_name = actor_name(target_address)
        self.min_part_bytes = min_part_bytes
        self._actor: Any = None
        self._lock = threading.Lock()

    def _handle(self) -> Any:  # noqa: ANN401 - a Ray ActorHandle
        with self._lock:
            if self._actor is None:
                try:
                    self._actor = ray.get_actor(self.actor_name, namespace=NAMESPACE)
                except ValueError as exc:
                    raise KvTransferError(f"no Ray actor {self.actor_name!r} in namespace {NAMESPACE!r}") from exc
            return self._actor

    def send(self, spec: KvSpec, kv: torch.Tensor, first_token_id: int, timeout_s: float) -> KvAck:
        if tuple(kv.shape) != spec.shape or kv.dtype != spec.torch_dtype:
            raise KvTransferError(f"KV tensor {tuple(kv.shape)} {kv.dtype} does not match {spec}")
        refs = [ray.put(payload_of(kv))]
        try:
            call = self._handle().receive_kv.remote(header_for(spec, first_token_id), refs)
            ack = ray.get(call, timeout=timeout_s)
        except GetTimeoutError as exc:
            ray.cancel(call)
            raise KvTransferError(
                f"KV {spec.request_id!r} to {self.target_address}: no answer in {timeout_s}s"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - RayError, or a submit to an actor that is gone
            with self._lock:
                self._actor = None  # look the actor up again next time (it may have been replaced)
            raise KvTransferError(f"KV {spec.request_id!r} to {self.target_address} failed: {exc}") from exc
        finally:
            refs.clear()  # our ref: the object is freed once the receiver dropped its own
        _check_acks([ack], f"KV {spec.request_id!r} refused by {self.target_address}")
        return KvAck(request_id=spec.request_id, ok=True, bytes_received=spec.nbytes)

    def send_layers(self, spec: KvSpec, source: LayerSource, timeout_s: float) -> KvAck:
        """Ship ``source.buffer`` part by part (:func:`plan_parts`): once ``source.wait_layers`` says a
        part's layers are final, ``ray.put`` them and submit ``receive_kv_part`` without waiting, so
        parts travel while later layers are computed; return once every part was acknowledged.

        Raises KvTransferError if a part was refused (the receiver already failed the intake), on a
        Ray error, or when the source failed or ``timeout_s`` passed (then the receiver is first told
        to abort the intake, so it drops what it assembled)."""
        buf = source.buffer
        if tuple(buf.shape) != spec.shape or buf.dtype != spec.torch_dtype or not buf.is_contiguous():
            raise KvTransferError(
                f"layer buffer {tuple(buf.shape)} {buf.dtype} does not match {spec} (or is not contiguous)"
            )
        deadline = time.monotonic() + timeout_s
        header = header_for(spec, 0)
        where = f"KV {spec.request_id!r} to {self.target_address}"
        actor: Any = None
        calls: list[Any] = []  # receive_kv_part calls whose answer was not checked yet
        try:
            actor = self._handle()
            for start, end in plan_parts(spec, self.min_part_bytes):
                try:
                    source.wait_layers(end)
                except Exception as exc:  # noqa: BLE001 - the prefill pass failed or stalled
                    raise self._abort(actor, header, where, f"layers [0, {end}) not ready: {exc}") from exc
                if time.monotonic() >= deadline:
                    raise self._abort(actor, header, where, f"not sent within {timeout_s}s")
                # The ref travels nested in a list (Ray hands it over unresolved and keeps the object
                # alive until the call finished); we keep no ref, so each part is freed once received.
                calls.append(
                    actor.receive_kv_part.remote(
                        header, part_for(spec, start, end), [ray.put(payload_of(buf[start:end]))]
                    )
                )
                done, calls = ray.wait(calls, num_returns=len(calls), timeout=0)
                _check_acks(ray.get(done), f"{where}: part refused")  # a refused part ends the send early
            _check_acks(ray.get(calls, timeout=max(0.0, deadline - time.monotonic())), f"{where}: part refused")
        except KvTransferError:
            raise
        except GetTimeoutError as exc:
            raise self._abort(actor, header, where, f"no answer in {timeout_s}s") from exc
        except Exception as exc:  # noqa: BLE001 - RayError, or a submit to an actor that is gone
            with self._lock:
                self._actor = None  # look the actor up again next time (it may have been replaced)
            raise self._abort(actor, header, where, f"failed: {type(exc).__name__}: {exc}") from exc
        return KvAck(request_id=spec.request_id, ok=True, bytes_received=spec.nbytes)

    @staticmethod
    def _abort(actor: Any, header: dict[str, Any], where: str, reason: str) -> KvTransferError:  # noqa: ANN401
        """Tell the receiver to fail the intake and drop its partial buffer (best effort: waited at most
        :data:`ABORT_WAIT_S`; the intake's deadline drops it otherwise); return the error to raise."""
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.get(
                    actor.receive_kv_part.remote(header, {"abort": reason[:MAX_ABORT_CHARS]}, []), timeout=ABORT_WAIT_S
                )
        return KvTransferError(f"{where}: {reason}")


def _check_acks(acks: list[Any], refused: str) -> None:
    """Raise KvTransferError(f"{refused}: <why>") for the first answer of a receiver that is not ok."""
    for ack in acks:
        if not isinstance(ack, dict) or not ack.get("ok"):
            error = ack.get("error") if isinstance(ack, dict) else f"bad answer {ack!r}"
            raise KvTransferError(f"{refused}: {error}")


_SENDERS: SenderCache[RayKvSender] = SenderCache(RayKvSender)


def get_sender(target_address: str) -> RayKvSender:
    """The process-wide cached sender for ``target_address`` (``ray:<actor name>``)."""
    return _SENDERS.get(target_address)


class _Assembly:
    """A request's layer-wise intake on the receiver: its pending intake (claimed by the part that
    created the assembly, unless ``owned`` stays False), the layers taken by a part (copying or
    copied), and the buffer of ``spec.shape`` they are copied into. Fields other than ``pending``,
    ``spec`` and ``ready`` are guarded by the receiver's lock."""

    def __init__(self, pending: GrpcPendingKv) -> None:
        self.pending = pending
        self.spec = pending.spec
        self.ready = threading.Event()  # set once the creating part tried to claim the intake
        self.owned = False  # that claim succeeded: this assembly alone completes or fails the intake
        self.taken = [False] * self.spec.num_layers
        self.layers_copied = 0
        self.buffer: torch.Tensor | None = None  # allocated by the first data part, dropped with the assembly
        self.closed = ""  # why it left the receiver ("" while it is open)


class RayKvReceiver(KvReceiver):
    """Decode side: completes intakes registered on ``intake`` from ``receive(header, [ref])`` calls
    (a whole request) or ``receive_part(header, part, [ref])`` calls (layer-wise parts)."""

    def __init__(self, intake: KvTransferServicer | None = None, get_timeout_s: float = 60.0) -> None:
        self.intake = intake or KvTransferServicer()
        self.get_timeout_s = get_timeout_s
        self.transfers_received = 0  # intakes completed through this backend
        self.bytes_received = 0
        self.parts_received = 0  # layer-wise parts copied
        self._assemblies: dict[str, _Assembly] = {}
        # Guards _assemblies, the assemblies' fields and the counters. Never held while calling into a
        # pending intake: its completion runs our done callback (which takes this lock) under its own lock.
        self._lock = threading.Lock()

    def expect(self, spec: KvSpec, options: ExpectOptions):  # noqa: ANN201 - the intake's PendingKv
        """Register on the shared intake; Ray delivers whole tensors (no shared-memory segment, no
        checksum), so an intake that asks for either is refused here rather than never completed."""
        if options.shm_segment_prefix or options.require_checksum:
            raise ValueError("the ray backend cannot honour shm_segment_prefix or require_checksum")
        return self.intake.expect(spec, options)

    def close(self) -> None:
        self.intake.close()  # fails every pending intake, which drops every assembly

    def partial_layers(self) -> dict[str, int]:
        """Request id -> layers copied, of every layer-wise intake under way (empty when none)."""
        with self._lock:
            return {rid: asm.layers_copied for rid, asm in self._assemblies.items()}

    def receive(self, header: object, refs: object) -> dict[str, Any]:
        """Handle one transfer; returns ``{"ok", "error", "bytes_received"}`` (never raises)."""
        try:
            spec, first_token_id = spec_from_header(header)
        except (ValueError, TypeError) as exc:
            return _ack(False, f"invalid KV header: {exc}")
        if not isinstance(refs, list) or len(refs) != 1 or not isinstance(refs[0], ray.ObjectRef):
            return _ack(False, "expected exactly one ObjectRef in a list")
        held = [refs.pop()]
        try:
            self.intake.deliver(spec, lambda: self._fetch(spec, held[0]), first_token_id)
        except KvTransferError as exc:
            return _ack(False, str(exc))
        finally:
            held.clear()  # release our reference; the tensor handed on keeps the shared memory mapped
        with self._lock:
            self.transfers_received += 1
            self.bytes_received += spec.nbytes
        return _ack(True, "", spec.nbytes)

    def receive_part(self, header: object, part: object, refs: object) -> dict[str, Any]:
        """Handle one layer-wise part, or the sender's abort (``part == {"abort": reason}``, no refs);
        returns ``{"ok", "error", "bytes_received"}`` (never raises).

        ok=True: the part's layers were copied (and, for the last of them, the intake completed). An
        invalid part (header, range, overlap, size, lost object) fails the request's intake; a part
        for an unknown, finished or otherwise claimed intake is only refused."""
        request_id = header.get("request_id") if isinstance(header, dict) else None
        try:
            spec, first_token_id = spec_from_header(header)
            if first_token_id != 0:
                raise ValueError(
                    f"first_token_id: layer-wise parts carry 0 (the first token travels in the "
                    f"PrefillResponse), got {first_token_id}"
                )
        except (ValueError, TypeError) as exc:
            return _ack(False, self._fail_request(request_id, f"invalid KV part header: {exc}"))
        asm, error = self._attach(spec)
        if asm is None:
            return _ack(False, error)
        rid = spec.request_id
        if spec != asm.spec:
            return _ack(
                False,
                self._fail(asm, f"KV for {rid!r} refused: KV header {spec} does not match the expected {asm.spec}"),
            )
        if isinstance(part, dict) and set(part) == {"abort"}:
            self._fail(asm, f"KV for {rid!r} aborted by the sender: {str(part['abort'])[:MAX_ABORT_CHARS]}")
            return _ack(True, "")
        try:
            start, end = part_range(part, spec)
            if not isinstance(refs, list) or len(refs) != 1 or not isinstance(refs[0], ray.ObjectRef):
                raise ValueError("refs: expected exactly one ObjectRef in a list")
        except ValueError as exc:
            return _ack(False, self._fail(asm, f"invalid KV part for {rid!r}: {exc}"))
        nbytes = (end - start) * spec.layer_nbytes
        with self._lock:
            closed, overlap = asm.closed, any(asm.taken[start:end])
            if not closed and not overlap:
                asm.taken[start:end] = [True] * (end - start)
                if asm.buffer is None:
                    asm.buffer = torch.empty(spec.shape, dtype=spec.torch_dtype)
                buffer = asm.buffer
        if closed:
            return _ack(False, asm.pending.error() or closed)
        if overlap:
            return _ack(
                False,
                self._fail(
                    asm,
                    f"invalid KV part for {rid!r}: layer_start: layers [{start}, {end}) "
                    f"overlap layers already received",
                ),
            )
        held = [refs.pop()]
        try:
            array = self._fetch_array(held[0])
            if array.nbytes != nbytes:
                raise KvTransferError(
                    f"part_bytes: payload has {array.nbytes} bytes, expected {nbytes} for layers [{start}, {end})"
                )
            # Disjoint layer ranges: parts copy concurrently, outside the lock.
            payload_of(buffer)[start * spec.layer_nbytes : end * spec.layer_nbytes] = array  # a view: writes land
        except KvTransferError as exc:
            return _ack(False, self._fail(asm, f"invalid KV part for {rid!r}: {exc}"))
        finally:
            held.clear()
        with self._lock:
            closed = asm.closed
            complete = False
            if not closed:
                self.parts_received += 1
                asm.layers_copied += end - start
                complete = asm.layers_copied == spec.num_layers
                if complete:
                    del self._assemblies[rid]
                    asm.closed, asm.buffer = "complete", None
        if closed:  # failed, cancelled or expired while this part was copied
            return _ack(False, asm.pending.error() or closed)
        if complete:
            if not asm.pending.succeed(buffer, 0):
                return _ack(False, asm.pending.error() or f"KV intake for {rid!r} already finished")
            with self._lock:
                self.transfers_received += 1
                self.bytes_received += spec.nbytes
        return _ack(True, "", nbytes)

    def _attach(self, spec: KvSpec) -> tuple[_Assembly | None, str]:
        """The open assembly of ``spec.request_id``, or ``(None, why)``. The request's first part creates
        it and claims the pending intake, so no other transfer can complete that intake; the intake's
        done callback drops the assembly (completed, failed, cancelled, expired, receiver closed)."""
        rid = spec.request_id
        with self._lock:
            asm = self._assemblies.get(rid)
            creator = asm is None
            if asm is None:
                pending = self.intake.pending(rid)
                if pending is None:
                    return None, f"unknown request_id {rid!r}: no pending KV intake"
                asm = self._assemblies[rid] = _Assembly(pending)
        if creator:
            try:
                if asm.pending.claim(None):  # type: ignore[arg-type]  # no gRPC stream to cancel
                    asm.owned = True
                    created = asm
                    asm.pending.add_done_callback(lambda p: self._drop(created, p.error() or "KV intake finished"))
                else:
                    self._drop(asm, f"request_id {rid!r} is already being received")
            finally:
                asm.ready.set()
        elif not asm.ready.wait(self.get_timeout_s):
            return None, f"KV intake for {rid!r} was not claimed within {self.get_timeout_s}s"
        with self._lock:
            if asm.closed:
                return None, (asm.pending.error() if asm.owned else "") or asm.closed
        return asm, ""

    def _drop(self, asm: _Assembly, reason: str) -> None:
        """Forget ``asm`` and its buffer (idempotent); parts still copying into it are then refused."""
        with self._lock:
            if self._assemblies.get(asm.spec.request_id) is asm:
                del self._assemblies[asm.spec.request_id]
            asm.closed = asm.closed or reason
            asm.buffer = None

    def _fail(self, asm: _Assembly, message: str) -> str:
        """Fail the intake behind ``asm`` (if this assembly owns it) and drop the assembly; return the error."""
        asm.ready.wait(self.get_timeout_s)
        if asm.owned:
            asm.pending.fail(message, cancel_stream=False)
        self._drop(asm, message)
        return (asm.pending.error() if asm.owned else "") or message

    def _fail_request(self, request_id: object, message: str) -> str:
        """A part whose header is invalid: fail the intake of its request id, if that is pending and not
        being received by another transfer; return the error."""
        if not isinstance(request_id, str):
            return message
        with self._lock:
            asm = self._assemblies.get(request_id)
            pending = self.intake.pending(request_id) if asm is None else None
        if asm is not None:
            return self._fail(asm, message)
        if pending is not None and pending.claim(None):  # type: ignore[arg-type]  # no gRPC stream to cancel
            pending.fail(message, cancel_stream=False)
            return pending.error() or message
        return message

    def _fetch(self, spec: KvSpec, ref: ray.ObjectRef) -> torch.Tensor:
        array = self._fetch_array(ref)
        if array.nbytes != spec.nbytes:
            raise KvTransferError(f"KV payload has {array.nbytes} bytes, expected {spec.nbytes}")
        with warnings.catch_warnings():  # zero-copy view of read-only shared memory; nobody writes to it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(array)
        return flat.view(spec.torch_dtype).reshape(spec.shape)

    def _fetch_array(self, ref: ray.ObjectRef) -> np.ndarray:
        """``ray.get`` a payload: a flat uint8 numpy array, else KvTransferError."""
        try:
            array = ray.get(ref, timeout=self.get_timeout_s)
        except ObjectLostError as exc:  # includes OwnerDiedError: the prefill worker is gone
            raise KvTransferError(f"KV object lost ({type(exc).__name__}): {exc}") from exc
        except GetTimeoutError as exc:
            raise KvTransferError(f"KV object not available within {self.get_timeout_s}s") from exc
        except RayError as exc:
            raise KvTransferError(f"KV object could not be fetched: {type(exc).__name__}: {exc}") from exc
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
            raise KvTransferError(f"KV payload must be a flat uint8 numpy array, got {type(array).__name__}")
        return array


def _ack(ok: bool, error: str, bytes_received: int = 0) -> dict[str, Any]:
    return {"ok": ok, "error": error, "bytes_received": bytes_received}


register_backend(BACKEND_NAME, get_sender)
