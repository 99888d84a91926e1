"""One prompt to prefill for a decode worker (`PrefillJob`) and what came of it (`PrefillResult`):
what the prefill worker's core and its KV connector (`KvHandoff`) share."""

from __future__ import annotations

import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from pdserve.engine.sampler import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.trace import TraceEvent


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    kv_target: str
    kv_backend: str = "grpc"
    output_index: int = 0  # output position of the token sampled here (> 0 for resumed requests)
    kv_block_offset: int = 0  # leading blocks the decode worker already holds: not shipped
    trace: bool = False  # collect the step trace of its passes (engine.trace)
    kv_checksum: str = ""  # checksum algorithm the decode worker asked for ("": none; shm backend)
    enqueued_at: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)
    # set on the loop thread
    seq: Sequence | None = None  # its sequence in the engine, once queued there
    prefill_s: float = 0.0  # admission -> first token
    trace_events: tuple[TraceEvent, ...] = ()  # its prefill passes, when traced
    first_logprob: TokenLogprob | None = None  # params.logprobs: the first token's, sampled here
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # params.prompt_logprobs, computed here


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    kv_bytes: int
    trace: tuple[TraceEvent, ...] = ()  # the prefill passes (PrefillJob.trace)
    cached_tokens: int = 0  # prompt tokens taken from this worker's prefix cache
    first_logprob: TokenLogprob | None = None  # PrefillJob.first_logprob
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # PrefillJob.prompt_logprobs


def settle(future: Future, result: object = None, error: BaseException | None = None) -> None:
    """Complete `future` unless the caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
