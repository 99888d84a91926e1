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

Failures: an owner that died (``OwnerDiedError``) or a lost object (``ObjectLostError``) fails the
intake, and the decode worker then answers UNAVAILABLE "prefill failed on ..." so the router
prefills the request elsewhere. A header that does not match fails that intake only.

Only this module and ``cluster/`` import ``ray``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, ObjectLostError, RayError

from kv_transfer.base import KvReceiver, KvSender, KvSpec, KvTransferError, SenderCache, register_backend
from kv_transfer.grpc_backend import KvTransferServicer
from pdserve.v1.kv_pb2 import KvAck

BACKEND_NAME = "ray"
TARGET_PREFIX = "ray:"
NAMESPACE = "pdserve"
HEADER_FIELDS = ("request_id", "model_fingerprint", "dtype", "shape", "block_size", "num_tokens",
                 "block_offset", "first_token_id", "total_bytes")


def actor_name(target: str) -> str:
    """``ray:decode-0`` -> ``decode-0``; ValueError for anything else."""
    if not target.startswith(TARGET_PREFIX) or not target[len(TARGET_PREFIX):]:
        raise ValueError(f"ray KV target must look like 'ray:<actor name>', got {target!r}")
    return target[len(TARGET_PREFIX):]


def header_for(spec: KvSpec, first_token_id: int) -> dict[str, Any]:
    """The plain-dict header of one payload (what ``KvHeader`` says about a whole transfer)."""
    return {"request_id": spec.request_id, "model_fingerprint": spec.model_fingerprint, "dtype": spec.dtype,
            "shape": list(spec.shape), "block_size": spec.block_size, "num_tokens": spec.num_tokens,
            "block_offset": spec.block_offset, "first_token_id": int(first_token_id), "total_bytes": spec.nbytes}


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
    spec = KvSpec(request_id=header["request_id"], model_fingerprint=header["model_fingerprint"],
                  dtype=header["dtype"], shape=tuple(shape), block_size=header["block_size"],
                  num_tokens=header["num_tokens"], block_offset=header["block_offset"])
    if header["total_bytes"] != spec.nbytes:
        raise ValueError(f"total_bytes: {header['total_bytes']} != {spec.nbytes} implied by shape and dtype")
    if header["first_token_id"] < 0:
        raise ValueError(f"first_token_id: must be >= 0, got {header['first_token_id']}")
    return spec, header["first_token_id"]


def payload_of(kv: torch.Tensor) -> np.ndarray:
    """The KV tensor as a flat uint8 numpy array in C order (no copy when already contiguous on CPU)."""
    return kv.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class RayKvSender(KvSender):
    """Puts one request's KV into the object store and hands the ref to the named decode actor."""

    def __init__(self, target_address: str) -> None:
        self.target_address = target_address
        self.actor_name = actor_name(target_address)
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
                f"KV {spec.request_id!r} to {self.target_address}: no answer in {timeout_s}s") from exc
        except Exception as exc:  # noqa: BLE001 - RayError, or a submit to an actor that is gone
            with self._lock:
                self._actor = None  # look the actor up again next time (it may have been replaced)
            raise KvTransferError(f"KV {spec.request_id!r} to {self.target_address} failed: {exc}") from exc
        finally:
            refs.clear()  # our ref: the object is freed once the receiver dropped its own
        if not isinstance(ack, dict) or not ack.get("ok"):
            error = ack.get("error") if isinstance(ack, dict) else f"bad answer {ack!r}"
            raise KvTransferError(f"KV {spec.request_id!r} refused by {self.target_address}: {error}")
        return KvAck(request_id=spec.request_id, ok=True, bytes_received=spec.nbytes)


_SENDERS: SenderCache[RayKvSender] = SenderCache(RayKvSender)


def get_sender(target_address: str) -> RayKvSender:
    """The process-wide cached sender for ``target_address`` (``ray:<actor name>``)."""
    return _SENDERS.get(target_address)


class RayKvReceiver(KvReceiver):
    """Decode side: completes intakes registered on ``intake`` from ``receive(header, [ref])`` calls."""

    def __init__(self, intake: KvTransferServicer | None = None, get_timeout_s: float = 60.0) -> None:
        self.intake = intake or KvTransferServicer()
        self.get_timeout_s = get_timeout_s
        self.transfers_received = 0  # intakes completed through this backend
        self.bytes_received = 0

    def expect(self, spec: KvSpec, deadline_s: float):  # noqa: ANN201 - the intake's PendingKv
        return self.intake.expect(spec, deadline_s)

    def close(self) -> None:
        self.intake.close()

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
        self.transfers_received += 1
        self.bytes_received += spec.nbytes
        return _ack(True, "", spec.nbytes)

    def _fetch(self, spec: KvSpec, ref: ray.ObjectRef) -> torch.Tensor:
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
        if array.nbytes != spec.nbytes:
            raise KvTransferError(f"KV payload has {array.nbytes} bytes, expected {spec.nbytes}")
        with warnings.catch_warnings():  # zero-copy view of read-only shared memory; nobody writes to it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(array)
        return flat.view(spec.torch_dtype).reshape(spec.shape)


def _ack(ok: bool, error: str, bytes_received: int = 0) -> dict[str, Any]:
    return {"ok": ok, "error": error, "bytes_received": bytes_received}


register_backend(BACKEND_NAME, get_sender, RayKvReceiver)
