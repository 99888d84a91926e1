from pdserve.v1 import common_pb2 as _common_pb2
from pdserve.v1 import router_pb2 as _router_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvEventsRequest(_message.Message):
    __slots__ = ("epoch", "after_seq")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    after_seq: int
    def __init__(self, epoch: _Optional[int] = ..., after_seq: _Optional[int] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("worker_id", "epoch", "first_seq", "last_seq", "snapshot", "keys", "stored")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    first_seq: int
    last_seq: int
    snapshot: bool
    keys: _containers.RepeatedScalarFieldContainer[int]
    stored: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., first_seq: _Optional[int] = ..., last_seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., keys: _Optional[_Iterable[int]] = ..., stored: _Optional[_Iterable[bool]] = ...) -> None: ...

class KvLookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[int]] = ...) -> None: ...

class KvLookupResponse(_message.Message):
    __slots__ = ("cached_blocks", "epoch")
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    cached_blocks: int
    epoch: int
    def __init__(self, cached_blocks: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    drain_timeout_s: float
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class MuxRequest(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: MuxOpen
    cancel: str
    def __init__(self, open: _Optional[_Union[MuxOpen, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class MuxOpen(_message.Message):
    __slots__ = ("request", "timeout_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request: DecodeRequest
    timeout_s: float
    def __init__(self, request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class MuxResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[MuxItem]
    def __init__(self, items: _Optional[_Iterable[_Union[MuxItem, _Mapping]]] = ...) -> None: ...

class MuxItem(_message.Message):
    __slots__ = ("request_id", "response", "end", "code", "details", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: _router_pb2.GenerateResponse
    end: bool
    code: int
    details: str
    failure: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[_router_pb2.GenerateResponse, _Mapping]] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., failure: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "token_ids", "params", "prefill_address", "resume_output_ids", "client_request_id", "trace", "migrate_from_address", "migrate_request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESUME_OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_FROM_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _common_pb2.ChatMessages
    token_ids: _common_pb2.TokenIds
    params: _common_pb2.SamplingParams
    prefill_address: str
    resume_output_ids: _containers.RepeatedScalarFieldContainer[int]
    client_request_id: str
    trace: bool
    migrate_from_address: str
    migrate_request_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., resume_output_ids: _Optional[_Iterable[int]] = ..., client_request_id: _Optional[str] = ..., trace: _Optional[bool] = ..., migrate_from_address: _Optional[str] = ..., migrate_request_id: _Optional[str] = ...) -> None: ...

class SuspendRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SuspendResponse(_message.Message):
    __slots__ = ("num_output_tokens", "num_cached_tokens")
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_output_tokens: int
    num_cached_tokens: int
    def __init__(self, num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class MigrateOutRequest(_message.Message):
    __slots__ = ("request_id", "target_request_id", "kv_target_address", "kv_backend", "num_tokens", "kv_block_offset", "target_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TARGET_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target_request_id: str
    kv_target_address: str
    kv_backend: str
    num_tokens: int
    kv_block_offset: int
    target_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., target_request_id: _Optional[str] = ..., kv_target_address: _Optional[str] = ..., kv_backend: _Optional[str] = ..., num_tokens: _Optional[int] = ..., kv_block_offset: _Optional[int] = ..., target_worker_id: _Optional[str] = ...) -> None: ...

class MigrateOutResponse(_message.Message):
    __slots__ = ("kv_bytes", "kv_transfer_s", "last_token_id")
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    kv_bytes: int
    kv_transfer_s: float
    last_token_id: int
    def __init__(self, kv_bytes: _Optional[int] = ..., kv_transfer_s: _Optional[float] = ..., last_token_id: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "add_special_tokens", "add_generation_prompt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _common_pb2.ChatMessages
    add_special_tokens: bool
    add_generation_prompt: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "max_model_len")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    def __init__(self, prompt: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class KvTargets(_message.Message):
    __slots__ = ("targets",)
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, targets: _Optional[_Iterable[str]] = ...) -> None: ...

class KvTargetsAck(_message.Message):
    __slots__ = ("num_targets",)
    NUM_TARGETS_FIELD_NUMBER: _ClassVar[int]
    num_targets: int
    def __init__(self, num_targets: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "kv_target_address", "kv_backend", "decode_worker_id", "output_index", "kv_block_offset", "trace", "kv_checksum")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    kv_target_address: str
    kv_backend: str
    decode_worker_id: str
    output_index: int
    kv_block_offset: int
    trace: bool
    kv_checksum: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_target_address: _Optional[str] = ..., kv_backend: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., output_index: _Optional[int] = ..., kv_block_offset: _Optional[int] = ..., trace: _Optional[bool] = ..., kv_checksum: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "timings", "kv_bytes", "trace", "cached_tokens", "first_logprob", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    timings: _common_pb2.Timings
    kv_bytes: int
    trace: _containers.RepeatedCompositeFieldContainer[_common_pb2.TraceEvent]
    cached_tokens: int
    first_logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., kv_bytes: _Optional[int] = ..., trace: _Optional[_Iterable[_Union[_common_pb2.TraceEvent, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
