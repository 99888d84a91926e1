from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_COLOCATED: _ClassVar[WorkerRole]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_COLOCATED: WorkerRole

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "skip_special_tokens", "cache_salt", "structured", "n", "include_stop_str_in_output", "spaces_between_special_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    cache_salt: str
    structured: StructuredOutput
    n: int
    include_stop_str_in_output: bool
    spaces_between_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., n: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "kv_transfer_s", "ttft_s", "decode_s", "e2e_s", "tokenize_s", "detokenize_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_S_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    ttft_s: float
    decode_s: float
    e2e_s: float
    tokenize_s: float
    detokenize_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., tokenize_s: _Optional[float] = ..., detokenize_s: _Optional[float] = ...) -> None: ...

class TraceEvent(_message.Message):
    __slots__ = ("worker_id", "tokenize", "prefill", "kv_transfer", "decode", "hold", "route")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tokenize: TraceTokenize
    prefill: TracePrefillPass
    kv_transfer: TraceKvTransfer
    decode: TraceDecodeStep
    hold: TraceDetokenizeHold
    route: TraceRoute
    def __init__(self, worker_id: _Optional[str] = ..., tokenize: _Optional[_Union[TraceTokenize, _Mapping]] = ..., prefill: _Optional[_Union[TracePrefillPass, _Mapping]] = ..., kv_transfer: _Optional[_Union[TraceKvTransfer, _Mapping]] = ..., decode: _Optional[_Union[TraceDecodeStep, _Mapping]] = ..., hold: _Optional[_Union[TraceDetokenizeHold, _Mapping]] = ..., route: _Optional[_Union[TraceRoute, _Mapping]] = ...) -> None: ...

class TraceRoute(_message.Message):
    __slots__ = ("decision", "decode_worker", "prefill_worker", "prompt_tokens", "decode_cached_tokens", "prefill_cached_tokens")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    decision: str
    decode_worker: str
    prefill_worker: str
    prompt_tokens: int
    decode_cached_tokens: int
    prefill_cached_tokens: int
    def __init__(self, decision: _Optional[str] = ..., decode_worker: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., decode_cached_tokens: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ...) -> None: ...

class TraceTokenize(_message.Message):
    __slots__ = ("token_ids", "pieces", "time_s")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    time_s: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[bytes]] = ..., time_s: _Optional[float] = ...) -> None: ...

class TracePrefillPass(_message.Message):
    __slots__ = ("num_tokens", "kv_len_before", "kv_len_after", "samples", "first_token_id", "first_token_piece", "time_s")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LEN_BEFORE_FIELD_NUMBER: _ClassVar[int]
    KV_LEN_AFTER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_PIECE_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    kv_len_before: int
    kv_len_after: int
    samples: bool
    first_token_id: int
    first_token_piece: bytes
    time_s: float
    def __init__(self, num_tokens: _Optional[int] = ..., kv_len_before: _Optional[int] = ..., kv_len_after: _Optional[int] = ..., samples: _Optional[bool] = ..., first_token_id: _Optional[int] = ..., first_token_piece: _Optional[bytes] = ..., time_s: _Optional[float] = ...) -> None: ...

class TraceKvTransfer(_message.Message):
    __slots__ = ("backend", "bytes", "time_s")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    backend: str
    bytes: int
    time_s: float
    def __init__(self, backend: _Optional[str] = ..., bytes: _Optional[int] = ..., time_s: _Optional[float] = ...) -> None: ...

class TraceDecodeStep(_message.Message):
    __slots__ = ("token_id", "piece", "kv_len", "itl_s")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    KV_LEN_FIELD_NUMBER: _ClassVar[int]
    ITL_S_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    piece: bytes
    kv_len: int
    itl_s: float
    def __init__(self, token_id: _Optional[int] = ..., piece: _Optional[bytes] = ..., kv_len: _Optional[int] = ..., itl_s: _Optional[float] = ...) -> None: ...

class TraceDetokenizeHold(_message.Message):
    __slots__ = ("token_id", "held", "held_tokens")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    held: bytes
    held_tokens: int
    def __init__(self, token_id: _Optional[int] = ..., held: _Optional[bytes] = ..., held_tokens: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "pid", "queue_depth", "queued_prompt_tokens", "kv_blocks_used", "kv_blocks_total", "running_requests", "healthy", "kv_address", "prefill_tokens_computed", "kv_bytes_sent", "kv_bytes_received", "requests_finished", "prefix_cache_hit_blocks", "prefix_cache_blocks", "max_running_requests", "unhealthy_reason", "kv_segment_prefix", "node_id", "host", "requests_migrated_in", "requests_migrated_out", "kv_block_size", "kernels")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_SEGMENT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MIGRATED_IN_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MIGRATED_OUT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    address: str
    pid: int
    queue_depth: int
    queued_prompt_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    running_requests: int
    healthy: bool
    kv_address: str
    prefill_tokens_computed: int
    kv_bytes_sent: int
    kv_bytes_received: int
    requests_finished: int
    prefix_cache_hit_blocks: int
    prefix_cache_blocks: int
    max_running_requests: int
    unhealthy_reason: str
    kv_segment_prefix: str
    node_id: str
    host: str
    requests_migrated_in: int
    requests_migrated_out: int
    kv_block_size: int
    kernels: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., queue_depth: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., running_requests: _Optional[int] = ..., healthy: _Optional[bool] = ..., kv_address: _Optional[str] = ..., prefill_tokens_computed: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., requests_finished: _Optional[int] = ..., prefix_cache_hit_blocks: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., unhealthy_reason: _Optional[str] = ..., kv_segment_prefix: _Optional[str] = ..., node_id: _Optional[str] = ..., host: _Optional[str] = ..., requests_migrated_in: _Optional[int] = ..., requests_migrated_out: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kernels: _Optional[str] = ...) -> None: ...
