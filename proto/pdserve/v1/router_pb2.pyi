from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SwitchRoleRequest(_message.Message):
    __slots__ = ("worker_id", "role", "drain_timeout_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    drain_timeout_s: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("worker", "previous_role", "drain_s", "switch_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    previous_role: _common_pb2.WorkerRole
    drain_s: float
    switch_s: float
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., previous_role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., drain_s: _Optional[float] = ..., switch_s: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "token_ids", "params", "priority", "trace", "slo_ttft_ms", "best_effort")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    BEST_EFFORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _common_pb2.ChatMessages
    token_ids: _common_pb2.TokenIds
    params: _common_pb2.SamplingParams
    priority: int
    trace: bool
    slo_ttft_ms: int
    best_effort: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., trace: _Optional[bool] = ..., slo_ttft_ms: _Optional[int] = ..., best_effort: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "timings", "error", "trace", "logprobs", "prompt_logprobs", "migration", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    error: str
    trace: _containers.RepeatedCompositeFieldContainer[_common_pb2.TraceEvent]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    migration: MigrationMarker
    index: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., error: _Optional[str] = ..., trace: _Optional[_Iterable[_Union[_common_pb2.TraceEvent, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., migration: _Optional[_Union[MigrationMarker, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class MigrationMarker(_message.Message):
    __slots__ = ("suspended", "resumed", "num_tokens", "kv_bytes", "kv_transfer_s")
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    suspended: bool
    resumed: bool
    num_tokens: int
    kv_bytes: int
    kv_transfer_s: float
    def __init__(self, suspended: _Optional[bool] = ..., resumed: _Optional[bool] = ..., num_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_transfer_s: _Optional[float] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "to_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TO_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    to_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., to_worker_id: _Optional[str] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("request_id", "from_address", "to_address", "num_tokens", "kv_bytes", "migrate_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TO_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_address: str
    to_address: str
    num_tokens: int
    kv_bytes: int
    migrate_s: float
    def __init__(self, request_id: _Optional[str] = ..., from_address: _Optional[str] = ..., to_address: _Optional[str] = ..., num_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., migrate_s: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("recent_window_s",)
    RECENT_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    recent_window_s: float
    def __init__(self, recent_window_s: _Optional[float] = ...) -> None: ...

class FinishedRequest(_message.Message):
    __slots__ = ("finished_ago_s", "ttft_s", "tpot_s", "queue_s", "prompt_tokens", "output_tokens", "ok")
    FINISHED_AGO_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    finished_ago_s: float
    ttft_s: float
    tpot_s: float
    queue_s: float
    prompt_tokens: int
    output_tokens: int
    ok: bool
    def __init__(self, finished_ago_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., ok: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("workers", "in_flight_requests", "total_requests", "queued_requests", "max_queued_requests", "dequeued_requests", "queue_time_s_sum", "recent", "slo_shed_requests")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DEQUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_SUM_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    SLO_SHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerInfo]
    in_flight_requests: int
    total_requests: int
    queued_requests: int
    max_queued_requests: int
    dequeued_requests: int
    queue_time_s_sum: float
    recent: _containers.RepeatedCompositeFieldContainer[FinishedRequest]
    slo_shed_requests: int
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerInfo, _Mapping]]] = ..., in_flight_requests: _Optional[int] = ..., total_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., dequeued_requests: _Optional[int] = ..., queue_time_s_sum: _Optional[float] = ..., recent: _Optional[_Iterable[_Union[FinishedRequest, _Mapping]]] = ..., slo_shed_requests: _Optional[int] = ...) -> None: ...
