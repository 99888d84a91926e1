"""KV cache transfer between prefill and decode workers.

``base`` defines the backend-neutral contract (:class:`KvSpec`, :class:`KvSender`,
:class:`KvReceiver`, :class:`PendingKv`, the backend registry), ``framing`` the validated
wire framing, ``grpc_backend`` the "grpc" backend (registered on import of this package).
Needs ``proto/`` on ``sys.path`` for the generated ``pdserve.v1`` stubs.
"""

from kv_transfer.base import (
    KvBackend,
    KvReceiver,
    KvSender,
    KvSpec,
    KvTransferError,
    PendingKv,
    get_backend,
    register_backend,
)
from kv_transfer.framing import FrameAssembler, KvFrameError, encode_frames
from kv_transfer.grpc_backend import GrpcKvSender, KvTransferServicer, grpc_message_options

__all__ = [
    "FrameAssembler",
    "GrpcKvSender",
    "KvBackend",
    "KvFrameError",
    "KvReceiver",
    "KvSender",
    "KvSpec",
    "KvTransferError",
    "KvTransferServicer",
    "PendingKv",
    "encode_frames",
    "get_backend",
    "grpc_message_options",
    "register_backend",
]
