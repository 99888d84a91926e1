"""GPU-ready K/V hand-off, through its CPU paths: K/V of another dtype is refused naming the dtype
(frames and shm control frames), CUDA IPC descriptors travel as validated bytes, and without CUDA
export falls back explicitly to the host path."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kv_transfer import cuda_ipc
from pdserve.kv_transfer.base import KvSpec
from pdserve.kv_transfer.framing import FrameAssembler, KvFrameError, encode_frames
from pdserve.kv_transfer.shm_backend import check_header, header_for


def spec(dtype: str, fingerprint: str) -> KvSpec:
    shape = (2, 2, math.ceil(5 / 4), 4, 2, 8)
    return KvSpec("req-1", fingerprint, dtype, shape, 4, 5)


def test_frames_of_another_dtype_are_refused_by_name() -> None:
    sent = spec("bfloat16", "weights-bf16")
    frames = list(encode_frames(sent, torch.zeros(sent.shape, dtype=torch.bfloat16), 3))
    assembler = FrameAssembler(spec("float32", "weights-fp32"))
    with pytest.raises(KvFrameError, match="same --dtype") as err:
        assembler.add(frames[0])
    assert err.value.field == "dtype"


def test_shm_control_frame_of_another_dtype_is_refused_by_name() -> None:
    header = header_for(spec("bfloat16", "weights-bf16"), 3, "pdserve-kv-1-abc")
    assert check_header(header, spec("float32", "weights-fp32")).startswith("dtype:")


def descriptor(**overrides: object) -> cuda_ipc.IpcDescriptor:
    fields = dict(
        device=1,
        dtype="bfloat16",
        shape=(2, 2, 3, 16, 4, 64),
        strides=(24576, 12288, 4096, 256, 64, 1),
        storage_offset=128,
        storage_size_bytes=2 * 128 + 2 * 49152 * 2,
        storage_offset_bytes=0,
        memory_handle=bytes(range(64)),
        ref_counter_handle=b"/torch_123_456",
        ref_counter_offset=8,
        event_handle=bytes(64),
        event_sync_required=True,
    )
    return cuda_ipc.IpcDescriptor(**{**fields, **overrides})  # type: ignore[arg-type]


def test_ipc_descriptor_roundtrips_as_bytes() -> None:
    d = descriptor()
    data = cuda_ipc.pack(d)
    assert isinstance(data, bytes) and data.startswith(cuda_ipc.MAGIC)
    assert cuda_ipc.unpack(data) == d
    assert d.nbytes == 2 * 2 * 3 * 16 * 4 * 64 * 2


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b"NOTIPC" + b[6:], "bad magic"),
        (lambda b: b[:-1], "truncated"),
        (lambda b: b + b"\0", "trailing bytes"),
        (lambda b: b[:6] + b"\x01\x00\x05" + b"int64" + b[17:], "dtype"),
    ],
)
def test_malformed_descriptors_are_refused(mutate, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        cuda_ipc.unpack(mutate(cuda_ipc.pack(descriptor())))


def test_descriptor_must_stay_inside_its_storage() -> None:
    with pytest.raises(ValueError, match="past its storage"):
        descriptor(storage_size_bytes=1024)
    with pytest.raises(ValueError, match="memory_handle"):
        descriptor(memory_handle=b"")


def test_without_cuda_export_falls_back_to_the_host_path() -> None:
    with pytest.raises(cuda_ipc.IpcUnavailable):
        cuda_ipc.export_tensor(torch.zeros(4))
    if not torch.cuda.is_available():
        with pytest.raises(cuda_ipc.IpcUnavailable):
            cuda_ipc.import_tensor(descriptor(), descriptor().shape, "bfloat16")


def test_import_checks_the_expected_kv_before_mapping() -> None:
    with pytest.raises(ValueError, match="not the expected"):
        cuda_ipc.import_tensor(descriptor(), (2, 2, 3, 16, 4, 64), "float32")
