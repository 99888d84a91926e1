"""Protobuf <-> the decode worker's typed values: a DecodeRequest read into what the core takes
(`read_request`), and the core's outputs written as GenerateResponses (`response_of`). Validation of
client input raises RequestInvalid; anything else raised while reading is our bug (`internal_fault`).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from pdserve.decode_worker.kv_intake import PrefillOutcome
from pdserve.decode_worker.outcomes import internal_fault
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine import structured
from pdserve.engine.llm_engine import TokenOutput
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.trace import token_bytes
from pdserve.failures import RequestInvalid
from pdserve.telemetry.memory import trim as trim_heap
from pdserve.tokenization import chat_from_pb, check_input_fits, encode_chat, encode_text, input_chars
from pdserve.v1 import common_pb2, router_pb2, worker_pb2
from pdserve.worker.runtime import finish_reason_to_pb, logprobs_to_pb, sampling_params_from_pb

#: Prompts (or chats) of more characters are tokenized in a thread, not on the event loop: tokenizing
#: 1M characters, or templating 256 long messages, took 1-13 s, during which every stream froze.
INLINE_TOKENIZE_CHARS = 16 * 1024


@dataclass(frozen=True)
class ReadRequest:
    prompt_ids: list[int]
    params: SamplingParams
    resume_ids: list[int]  # output tokens a previous decode worker produced (failover, migration)
    tokenize_s: float


def prompt_ids_from_pb(loaded: LoadedModel, request: worker_pb2.DecodeRequest) -> list[int]:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return encode_text(loaded.tokenizer, request.prompt)
    if kind == "messages":
        return encode_chat(loaded.tokenizer, *chat_from_pb(request.messages))
    if kind == "token_ids":
        count = len(request.token_ids.ids)
        if not count:
            raise RequestInvalid("token_ids: must not be empty")
        if count >= loaded.max_model_len:  # the engine's own refusal, before a million ids become a list
            raise RequestInvalid(f"prompt has {count} tokens; the model's context is {loaded.max_model_len}")
        return list(request.token_ids.ids)
    raise RequestInvalid("input: one of prompt, messages or token_ids is required")


def _tokenize_large(loaded: LoadedModel, request: worker_pb2.DecodeRequest) -> list[int]:
    """`prompt_ids_from_pb` of a large input, then the freed heap back to the OS: tokenizing 1M
    characters in a thread left ~150 MB in that thread's malloc arena otherwise."""
    try:
        return prompt_ids_from_pb(loaded, request)
    finally:
        trim_heap()


async def read_request(
    loaded: LoadedModel, request: worker_pb2.DecodeRequest, worker_id: str, request_id: str
) -> ReadRequest:
    """Tokenize and check a DecodeRequest; RequestInvalid for a bad one, RequestFault for our bug."""
    try:
        start = time.perf_counter()
        check_input_fits(loaded.tokenizer, request, loaded.max_model_len)  # before any template or tokenizer work
        if input_chars(request) <= INLINE_TOKENIZE_CHARS:
            prompt_ids = prompt_ids_from_pb(loaded, request)
        else:  # a large prompt or chat: off the event loop that relays every other stream
            prompt_ids = await asyncio.to_thread(_tokenize_large, loaded, request)
        tokenize_s = time.perf_counter() - start
        params = sampling_params_from_pb(request.params)
        resume_ids = list(request.resume_output_ids)
        if len(resume_ids) >= params.max_tokens:
            raise RequestInvalid("resume_output_ids: as many tokens as max_tokens; nothing left to do")
        if params.structured is not None:  # a bad schema is the request's 400, before any work
            await asyncio.to_thread(structured.check, loaded, *params.structured)
    except RequestInvalid:
        raise
    except Exception as exc:  # noqa: BLE001 - not the request's fault: our bug, said as such
        raise internal_fault(worker_id, request_id, "reading the request", exc) from exc
    return ReadRequest(prompt_ids, params, resume_ids, tokenize_s)


def tokenize_event(
    loaded: LoadedModel, worker_id: str, prompt_ids: list[int], tokenize_s: float
) -> common_pb2.TraceEvent:
    pieces = token_bytes(loaded.tokenizer, prompt_ids)
    return common_pb2.TraceEvent(
        worker_id=worker_id, tokenize=common_pb2.TraceTokenize(token_ids=prompt_ids, pieces=pieces, time_s=tokenize_s)
    )


def record_prefill(
    outcome: PrefillOutcome, worker_id: str, timings: common_pb2.Timings, trace: list[common_pb2.TraceEvent] | None
) -> None:
    """Add a remote prefill's timings, and (traced) its passes and the K/V hand-off, to the request's."""
    response = outcome.response
    timings.MergeFrom(response.timings)
    if trace is not None:
        trace.extend(response.trace)
        trace.append(
            common_pb2.TraceEvent(
                worker_id=worker_id,
                kv_transfer=common_pb2.TraceKvTransfer(
                    backend=outcome.backend, bytes=response.kv_bytes, time_s=response.timings.kv_transfer_s
                ),
            )
        )


def response_of(
    request_id: str,
    out: TokenOutput,
    timings: common_pb2.Timings,
    start: float,
    first_at: float,
    prefill_cached: int = 0,
) -> router_pb2.GenerateResponse:
    response = router_pb2.GenerateResponse(request_id=request_id, text=out.text)
    if out.token_id >= 0:
        response.token_ids.append(out.token_id)
    if out.finish_reason is not None:
        response.finish_reason = finish_reason_to_pb(out.finish_reason)
        response.usage.prompt_tokens = out.num_prompt_tokens
        response.usage.completion_tokens = out.num_output_tokens
        # both are leading prefixes of the prompt: the longer one was not computed on one side
        response.usage.cached_tokens = min(max(out.num_cached_tokens, prefill_cached), out.num_prompt_tokens)
        now = time.perf_counter()
        response.timings.CopyFrom(timings)
        response.timings.decode_s = now - first_at
        response.timings.e2e_s = now - start
        response.timings.detokenize_s = out.detokenize_s
        if out.prefill_s and not timings.prefill_s:  # prefilled here (colocated, or a short prompt)
            response.timings.queue_s, response.timings.prefill_s = out.queue_s, out.prefill_s
    return response


def add_logprobs(response: router_pb2.GenerateResponse, out: TokenOutput, tokenizer: Any) -> None:  # noqa: ANN401
    """The log-probabilities an engine output carries, with each token decoded alone."""
    entries = ([out.logprob] if out.logprob is not None else []) + list(out.prompt_logprobs or ())
    converted = logprobs_to_pb(entries, tokenizer)
    if out.logprob is not None:
        response.logprobs.append(converted.pop(0))
    if out.prompt_logprobs is not None:
        response.prompt_logprobs.extend(converted)


def worker_info(
    worker: DecodeWorker,
    worker_id: str,
    address: str,
    kv_target: str,
    colocated: bool,
    unhealthy_reason: str,
    node: tuple[str, str],
) -> common_pb2.WorkerInfo:
    """GetInfo's answer: the worker's load, KV pool and counters."""
    s = worker.stats()
    return common_pb2.WorkerInfo(
        worker_id=worker_id,
        address=address,
        pid=os.getpid(),
        kv_address=kv_target,
        role=common_pb2.WORKER_ROLE_COLOCATED if colocated else common_pb2.WORKER_ROLE_DECODE,
        queue_depth=s["queue_depth"],
        kv_blocks_used=s["kv_used"],
        kv_blocks_total=s["kv_total"],
        running_requests=s["running"],
        healthy=not unhealthy_reason,
        unhealthy_reason=unhealthy_reason,
        prefill_tokens_computed=s["prefill_tokens_computed"],
        kv_bytes_received=worker.kv_bytes_received,
        requests_finished=worker.requests_finished,
        prefix_cache_hit_blocks=s["prefix_cache_hit_blocks"],
        prefix_cache_blocks=s["prefix_cache_blocks"],
        max_running_requests=worker.engine.config.max_num_seqs,
        node_id=node[0],
        host=node[1],
        requests_migrated_in=worker.requests_migrated_in,
        requests_migrated_out=worker.requests_migrated_out,
        kv_block_size=worker.engine.pool.block_size,
        kernels=getattr(worker.engine.runner, "kernels", ""),
    )
