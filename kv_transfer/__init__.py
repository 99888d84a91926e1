"""KV cache transfer between prefill and decode workers.

``base`` defines the backend-neutral contract (:class:`KvSpec`, :class:`KvSender`,
:class:`KvReceiver`, :class:`PendingKv`, the backend registry), ``framing`` the validated
wire framing, ``grpc_backend`` the "grpc" backend (registered on import of this package),
``shm_backend`` and ``cuda_ipc_backend`` the same-host "shm" and "cuda_ipc" backends (registered
here too), ``ray_backend`` the "ray" backend (registered here too, but imported, with ``ray``, only on first use).
Needs ``proto/`` on ``sys.path`` for the generated ``pdserve.v1`` stubs.
"""

from pdserve.kv_transfer.base import (
    ExpectOptions,
    KvBackend,
    KvReceiver,
    KvSender,
    KvSpec,
    KvTransferError,
    PendingKv,
    get_backend,
    register_backend,
)
from pdserve.kv_transfer.cuda_ipc_backend import CudaIpcKvSender  # registers "cuda_ipc"
from pdserve.kv_transfer.framing import FrameAssembler, KvFrameError, encode_frames
from pdserve.kv_transfer.grpc_backend import GrpcKvSender, KvTransferServicer, grpc_message_options
from pdserve.kv_transfer.shm_backend import ShmKvSender  # registers the "shm" backend


def _ray_sender(target_address: str) -> KvSender:
    from pdserve.kv_transfer.ray_backend import get_sender

    return get_sender(target_address)


register_backend("ray", _ray_sender)

__all__ = [
    "CudaIpcKvSender",
    "ExpectOptions",
    "FrameAssembler",
    "GrpcKvSender",
    "ShmKvSender",
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
