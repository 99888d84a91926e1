"""Backend-neutral KV transfer interface: spec, sender/receiver contracts, backend registry.

Role: the prefill worker (sender) ships one request's KV tensor
``kv[:, :, block_ids]`` of shape ``[num_layers, 2, n_blocks, block_size, num_kv_heads,
head_dim]`` to the decode worker (receiver), which writes it into its own blocks.

Invariants (every backend must keep them):

- The RECEIVER reserves the KV blocks for a request *before* any byte can arrive:
  ``expect(spec, ExpectOptions(deadline_s, ...))`` registers a pending intake. Bytes for a request that is not
  pending are refused. The intake completes exactly once: with the assembled tensor and the
  first token id, or with a :class:`KvTransferError` (invalid frame, broken stream, deadline
  passed, cancelled). On failure the *owner* (decode worker) frees the reserved blocks.
- The SENDER frees nothing itself: ``send()`` returns once the receiver acknowledged every
  byte, or raises :class:`KvTransferError`; either way the caller (prefill worker) frees its
  own copy of the blocks afterwards.
- Both sides agree on a :class:`KvSpec`; the receiver accepts only data matching the spec it
  registered, so a sender can never make it write outside the reserved size.
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from pdserve.engine.kv_cache import KVCache, KVCacheShape
    from pdserve.v1.kv_pb2 import KvAck

#: Wire dtype names -> torch dtypes. Only these are accepted.
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
MAX_REQUEST_ID_CHARS = 256
MAX_FINGERPRINT_CHARS = 256


class KvTransferError(RuntimeError):
    """A KV transfer failed (refused, invalid data, RPC error, deadline, cancelled)."""


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype for a wire dtype name; ValueError if unsupported."""
    try:
        return SUPPORTED_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unsupported {name!r}; supported: {sorted(SUPPORTED_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Return the wire name of a torch dtype; ValueError if unsupported."""
    for name, value in SUPPORTED_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype: unsupported {dtype}; supported: {sorted(SUPPORTED_DTYPES)}")


@dataclass(frozen=True)
class KvSpec:
    """What one request's KV payload looks like; both sides must agree on every field.

    shape is ``(num_layers, 2, n_blocks, block_size, num_kv_heads, head_dim)`` with
    ``n_blocks == ceil(num_tokens / block_size) - block_offset``: the payload holds blocks
    ``[block_offset, ceil(num_tokens / block_size))`` of the request's block table, the receiver
    already holding the first ``block_offset`` (a cached prefix). Only slots of the first
    ``num_tokens`` tokens are meaningful; the rest of the last block is shipped but must be ignored.
    """

    request_id: str
    model_fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    block_size: int
    num_tokens: int
    block_offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        _check_text("request_id", self.request_id, MAX_REQUEST_ID_CHARS)
        _check_text("model_fingerprint", self.model_fingerprint, MAX_FINGERPRINT_CHARS)
        dtype_from_name(self.dtype)
        self._check_geometry()

    def _check_geometry(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens: must be >= 1, got {self.num_tokens}")
        if len(self.shape) != 6 or any(d < 1 for d in self.shape):
            raise ValueError(f"shape: need 6 positive dims [L,2,n_blocks,block_size,H,D], got {self.shape}")
        if self.shape[1] != 2:
            raise ValueError(f"shape: dim 1 must be 2 (k, v), got {self.shape}")
        if self.shape[3] != self.block_size:
            raise ValueError(f"shape: dim 3 must equal block_size {self.block_size}, got {self.shape}")
        n_blocks = math.ceil(self.num_tokens / self.block_size)
        if not 0 <= self.block_offset < n_blocks:
            raise ValueError(f"block_offset: must be in [0, {n_blocks}), got {self.block_offset}")
        if self.shape[2] != n_blocks - self.block_offset:
            raise ValueError(
                f"shape: dim 2 must be ceil(num_tokens / block_size) - block_offset = "
                f"{n_blocks - self.block_offset}, got {self.shape}"
            )

    @classmethod
    def for_cache(
        cls, request_id: str, model_fingerprint: str, cache: KVCacheShape, num_tokens: int, block_offset: int = 0
    ) -> KvSpec:
        """The payload of `num_tokens` tokens of a cache of geometry `cache`, from block `block_offset` on."""
        n = math.ceil(num_tokens / cache.block_size) - block_offset
        return cls(
            request_id=request_id,
            model_fingerprint=model_fingerprint,
            dtype=dtype_name(cache.dtype),
            shape=(cache.num_layers, 2, n, cache.block_size, cache.num_kv_heads, cache.head_dim),
            block_size=cache.block_size,
            num_tokens=num_tokens,
            block_offset=block_offset,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by ``dtype``."""
        return SUPPORTED_DTYPES[self.dtype]

    @property
    def num_layers(self) -> int:
        """Number of layers (shape[0])."""
        return self.shape[0]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's slice ``kv[l]`` (contiguous in C order)."""
        return math.prod(self.shape[1:]) * self.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole payload tensor."""
        return self.num_layers * self.layer_nbytes


def check_request_id(request_id: str) -> None:
    """ValueError unless `request_id` can name a KV transfer (what KvSpec accepts): check it before
    any work is done for a request."""
    _check_text("request_id", request_id, MAX_REQUEST_ID_CHARS)


def _check_text(field: str, value: str, max_chars: int) -> None:
    if not isinstance(value, str) or not value or len(value) > max_chars:
        raise ValueError(f"{field}: need a non-empty string of at most {max_chars} chars, got {value!r}")
    if not value.isprintable():
        raise ValueError(f"{field}: must be printable, got {value!r}")


class PendingKv(abc.ABC):
    """Handle of one registered intake; completes exactly once (result or error)."""

    @property
    @abc.abstractmethod
    def request_id(self) -> str:
        """Id of the request this intake is for."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> tuple[torch.Tensor | InPlaceCopy, int]:
        """Block until complete; return ``(kv_tensor, first_token_id)``, or, for an intake expected
        ``in_place`` that arrived in shared memory, ``(InPlaceCopy, first_token_id)``.

        Raises KvTransferError if the intake failed, or if ``timeout`` seconds passed first
        (a wait timeout does not fail the intake; its own deadline does).
        """

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the intake completed or failed."""

    @abc.abstractmethod
    def cancel(self, reason: str = "cancelled") -> bool:
        """Fail the intake (if still pending) and refuse further bytes; True if it was pending."""

    @abc.abstractmethod
    def add_done_callback(self, fn: Callable[[PendingKv], None]) -> None:
        """Call ``fn(self)`` once complete (immediately if already complete); any thread."""

    @abc.abstractmethod
    def error(self) -> str:
        """The failure message, or "" if not failed (yet)."""


class LayerSource(Protocol):
    """A request's K/V filled layer by layer while its prefill pass still runs (layer-wise streaming).

    ``buffer`` has the spec's shape; ``wait_layers(n)`` blocks until layers [0, n) hold their final
    bytes and raises if the pass failed or took too long."""

    buffer: torch.Tensor

    def wait_layers(self, count: int) -> None: ...


class InPlaceCopy(Protocol):
    """K/V an ``in_place`` intake left where the sender put it (``shm_backend.InPlaceKv``): call it with
    (the cache tensor, the block ids to fill) to copy the blocks in, or release it."""

    nbytes: int

    def __call__(self, kv: torch.Tensor, block_ids: list[int]) -> None: ...

    def release(self) -> None: ...


class KvSender(abc.ABC):
    """Prefill side. Thread-safe; one instance may serve many concurrent sends."""

    #: True when :meth:`send_layers` ships layers while the pass still runs.
    supports_layer_streaming = False

    @abc.abstractmethod
    def send(self, spec: KvSpec, kv: torch.Tensor, first_token_id: int, timeout_s: float) -> KvAck:
        """Ship ``kv`` (shape/dtype per ``spec``) and return the receiver's ok ack.

        Raises KvTransferError on refusal, invalid data, RPC error or after ``timeout_s``.
        Frees nothing: the caller frees its blocks after this returns or raises.
        """

    def send_blocks(
        self,
        spec: KvSpec,
        cache: KVCache,
        block_ids: list[int],
        first_token_id: int,
        timeout_s: float,
        checksum: str = "",
    ) -> KvAck:
        """Ship blocks `block_ids` of a worker's KV cache (the spec's blocks, in order). Backends that
        can read the cache in place override this; the default gathers a copy and `send`s it.
        `checksum`: the receiver asked for a checksum of the blocks with this algorithm; backends that
        always checksum ("grpc": crc32 per frame) or cannot ("ray") ignore it; "shm" adds it."""
        return self.send(spec, cache.gather(block_ids), first_token_id, timeout_s)

    def send_layers(self, spec: KvSpec, source: LayerSource, timeout_s: float) -> KvAck:
        """Ship ``source.buffer`` layer by layer as its layers become ready; the first token travels
        in the PrefillResponse (receivers see 0). Same contract as :meth:`send` otherwise."""
        raise KvTransferError(f"{type(self).__name__} cannot stream KV layer by layer")

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release connections; the sender must not be used afterwards."""


#: Checksums a receiver may require of shared-memory K/V; xxh3 (64 bit) is several times faster than crc32.
CHECKSUM_ALGORITHMS = ("xxh3", "crc32")


@dataclass(frozen=True)
class ExpectOptions:
    """How one intake may be completed: the one argument of :meth:`KvReceiver.expect`, the same for
    every receiver. A receiver that cannot honour an option refuses the intake (ValueError naming the
    option) rather than ignoring it.

    - ``deadline_s``: the intake fails this many seconds after it is registered.
    - ``in_place``: the consumer can copy the sender's K/V straight into its cache: an "shm" or
      "cuda_ipc" transfer then completes the intake with a ``kv_transfer.shm_backend.InPlaceKv`` (a
      callable ``(cache tensor, block ids)``, or ``release()`` it) instead of a tensor.
    - ``shm_segment_prefix``: the identity of the prefill worker called for the request: the "shm"
      backend may deliver this intake only from segments whose names start with it, and "cuda_ipc"
      only from the device pool mapped for it (`cuda_ipc_backend.mapped_pool`); empty refuses every
      shared-memory and device frame.
    - ``require_checksum``: the bytes must come with a checksum of this algorithm ("xxh3" or "crc32"),
      checked over the copied bytes ("": none asked). Framed gRPC streams always carry one per frame.
    """

    deadline_s: float
    in_place: bool = False
    shm_segment_prefix: str = ""
    require_checksum: str = ""

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")
        if self.require_checksum not in CHECKSUM_ALGORITHMS + ("",):
            raise ValueError(
                f"require_checksum: {self.require_checksum!r} is not one of {', '.join(CHECKSUM_ALGORITHMS)}"
            )


class KvReceiver(abc.ABC):
    """Decode side. Thread-safe."""

    @abc.abstractmethod
    def expect(self, spec: KvSpec, options: ExpectOptions) -> PendingKv:
        """Register a pending intake for ``spec.request_id``, failing it ``options.deadline_s`` from now.

        Call only after the blocks are reserved. ValueError if the id is already pending, the
        payload is larger than the receiver accepts, or an option cannot be honoured here.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Fail every pending intake and stop background work."""


SenderT = TypeVar("SenderT", bound=KvSender)


class SenderCache(Generic[SenderT]):
    """One sender (and its channel or actor handle) per target address, shared by every thread of
    the process: backends use it as their sender factory so no transfer opens its own connection."""

    def __init__(self, factory: Callable[[str], SenderT]) -> None:
        self._factory = factory
        self._senders: dict[str, SenderT] = {}
        self._lock = threading.Lock()

    def get(self, target_address: str) -> SenderT:
        with self._lock:
            sender = self._senders.get(target_address)
            if sender is None:
                sender = self._senders[target_address] = self._factory(target_address)
            return sender

    def close_all(self) -> None:
        with self._lock:
            senders = list(self._senders.values())
            self._senders.clear()
        for sender in senders:
            sender.close()


@dataclass(frozen=True)
class KvBackend:
    """A named transport, as the sending side sees it: ``sender_factory(target_address)``. Every
    backend delivers into the decode worker's one intake registry (``KvTransferServicer``); which
    backend a transfer takes is chosen by ``kv_transfer.routing``."""

    name: str
    sender_factory: Callable[[str], KvSender]


_BACKENDS: dict[str, KvBackend] = {}
_BACKENDS_LOCK = threading.Lock()


def register_backend(name: str, sender_factory: Callable[[str], KvSender]) -> None:
    """Register a backend under ``name``; re-registering a name replaces it."""
    if not name:
        raise ValueError("backend name must be non-empty")
    with _BACKENDS_LOCK:
        _BACKENDS[name] = KvBackend(name, sender_factory)


def get_backend(name: str) -> KvBackend:
    """Return the backend registered as ``name``; ValueError listing known names otherwise."""
    with _BACKENDS_LOCK:
        backend = _BACKENDS.get(name)
        known = sorted(_BACKENDS)
    if backend is None:
        raise ValueError(f"unknown kv backend {name!r}; known backends: {known}")
    return backend
