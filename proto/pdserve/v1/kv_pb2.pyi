from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvHeader(_message.Message):
    __slots__ = ("request_id", "model_fingerprint", "dtype", "shape", "block_size", "num_tokens", "layer_start", "layer_end", "byte_offset", "byte_length", "frame_index", "total_frames", "checksum", "first_token_id", "last", "shm_name", "block_offset", "shm_block_ids", "shm_num_blocks", "shm_checksum", "shm_checksum_algorithm", "cuda_ipc_descriptor")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SHM_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHM_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SHM_CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_fingerprint: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_tokens: int
    layer_start: int
    layer_end: int
    byte_offset: int
    byte_length: int
    frame_index: int
    total_frames: int
    checksum: int
    first_token_id: int
    last: bool
    shm_name: str
    block_offset: int
    shm_block_ids: _containers.RepeatedScalarFieldContainer[int]
    shm_num_blocks: int
    shm_checksum: int
    shm_checksum_algorithm: str
    cuda_ipc_descriptor: bytes
    def __init__(self, request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., byte_offset: _Optional[int] = ..., byte_length: _Optional[int] = ..., frame_index: _Optional[int] = ..., total_frames: _Optional[int] = ..., checksum: _Optional[int] = ..., first_token_id: _Optional[int] = ..., last: _Optional[bool] = ..., shm_name: _Optional[str] = ..., block_offset: _Optional[int] = ..., shm_block_ids: _Optional[_Iterable[int]] = ..., shm_num_blocks: _Optional[int] = ..., shm_checksum: _Optional[int] = ..., shm_checksum_algorithm: _Optional[str] = ..., cuda_ipc_descriptor: _Optional[bytes] = ...) -> None: ...

class KvFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KvHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[KvHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class KvAck(_message.Message):
    __slots__ = ("request_id", "ok", "error", "bytes_received")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ok: bool
    error: str
    bytes_received: int
    def __init__(self, request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...
