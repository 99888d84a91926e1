"""One request's state inside an engine: tokens, blocks, stop state, text stream.

Life cycle (the scheduler moves a sequence along it; `status` says where it is):
WAITING (queued, no blocks) -> PREFILLING (blocks for every token to prefill held, K/V computed
chunk by chunk) -> RUNNING (decoding), or HANDED_OFF on a prefill worker (prompt computed, first
token sampled, blocks held until its K/V are shipped) -> FINISHED. A preempted sequence goes back
to WAITING; RESERVED is a decode worker's sequence whose K/V arrive from a prefill worker.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampler import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stop_checker import StopChecker
from pdserve.engine.trace import DetokenizeHoldEvent, TraceEvent
from pdserve.failures import RequestInvalid


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)computation of its prefix
    PREFILLING = "prefilling"  # admitted: blocks held, K/V of its prefix computed chunk by chunk
    RESERVED = "reserved"  # blocks held, K/V arriving from a prefill worker
    RUNNING = "running"  # in the decode batch
    HANDED_OFF = "handed_off"  # prefill worker: prompt computed, blocks held while its K/V are shipped
    FINISHED = "finished"


@dataclass(eq=False)  # identity: a sequence is one request's state, never equal to another's
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stopper: StopChecker
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in this engine's cache
    num_reused_blocks: int = 0  # leading blocks of a reservation taken from this engine's prefix cache
    num_prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from this engine's prefix cache (usage)
    prefix_hashes: list[bytes] = field(default_factory=list)  # of each full block it prefills (prefix caching)
    # output position of the first token sampled here: > 0 when `prompt_ids` already end with
    # earlier outputs (a prefill worker computing a resumed request's K/V); seeds depend on it
    output_index_base: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # first admitted for prefill (queue time ends here)
    first_token_time: float | None = None
    last_token_time: float | None = None
    detokenize_s: float = 0.0  # time spent turning its output ids into streamed text
    trace: list[TraceEvent] | None = None  # step trace (engine.trace), collected only when asked
    # SamplingParams.prompt_logprobs: one entry per prompt token computed so far (the first has none)
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_sent: bool = False
    next_logprob: TokenLogprob | None = None  # SamplingParams.logprobs: of the token being appended
    constraint: Any = None  # engine.structured.Constraint of a structured-output request

    @property
    def queue_and_prefill_s(self) -> tuple[float, float]:
        """(queued -> admitted for prefill, admitted -> first token) when this engine prefilled it;
        (0, 0) for a sequence whose K/V came from elsewhere."""
        if self.scheduled_time is None or self.first_token_time is None:
            return 0.0, 0.0
        return self.scheduled_time - self.arrival_time, self.first_token_time - self.scheduled_time

    def take_trace(self) -> tuple[TraceEvent, ...]:
        """The trace events since the last call (empty when untraced)."""
        if not self.trace:
            return ()
        events, self.trace[:] = tuple(self.trace), []
        return events

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        trace: bool = False,
    ) -> Sequence:
        return cls(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(
                tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                prompt_ids=prompt_ids,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            ),
            stopper=StopChecker(params, eos_token_ids),
            trace=[] if trace else None,
            prompt_logprobs=[TokenLogprob(prompt_ids[0], None)] if params.prompt_logprobs is not None else None,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_ids(self) -> list[int]:
        """Tokens whose K/V an admitted sequence computes before it decodes: the prompt, or all but
        the last token of a preempted or resumed one (that token is the input of its next step)."""
        return self.all_ids[:-1] if self.output_ids else self.prompt_ids

    @property
    def next_output_index(self) -> int:
        """Output position of the next token to sample (per-request seeds are keyed on it)."""
        return self.output_index_base + len(self.output_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.stopper.finish_reason

    @property
    def is_finished(self) -> bool:
        return self.stopper.finish_reason is not None

    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities asked for and not all computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def add_prompt_logprobs(self, first_position: int, entries: list[TokenLogprob]) -> None:
        """Entries for prompt positions first_position, first_position + 1, ... (a recomputed chunk
        after preemption repeats positions already known: those are skipped)."""
        assert self.prompt_logprobs is not None
        for position, entry in enumerate(entries, start=first_position):
            if position == len(self.prompt_logprobs) < len(self.prompt_ids):
                self.prompt_logprobs.append(entry)

    def append_token(self, token_id: int) -> str:
        """Record a sampled token; return the text that may be streamed for it."""
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.output_ids.append(token_id)
        text = self.detokenizer.add(token_id)
        if self.trace is not None and self.detokenizer.waiting:
            self.trace.append(DetokenizeHoldEvent(token_id, tuple(self.detokenizer.held_ids)))
        self.detokenize_s += time.perf_counter() - now
        delta = self.stopper.on_token(token_id, len(self.output_ids), text)
        if self.is_finished:
            delta += self.stopper.on_flush(self._flush_detokenizer())
        return delta

    def _flush_detokenizer(self) -> str:
        started = time.perf_counter()
        text = self.detokenizer.flush()
        self.detokenize_s += time.perf_counter() - started
        return text

    def replay(self, token_ids: list[int]) -> None:
        """Adopt output tokens already delivered elsewhere (failover): the detokenizer and stop
        state advance exactly as they did there, and their text is not streamed again."""
        for token_id in token_ids:
            self.output_ids.append(token_id)
            self.stopper.on_token(token_id, len(self.output_ids), self.detokenizer.add(token_id))
        if self.is_finished:
            raise RequestInvalid("resume_output_ids: the request had already finished")

    def finish(self, reason: str) -> str:
        """End the sequence from outside (abort, context limit); return any held-back text."""
        if self.stopper.finish_reason is None:
            self.stopper.finish_reason = reason
            return self.stopper.on_flush(self._flush_detokenizer())
        return ""
