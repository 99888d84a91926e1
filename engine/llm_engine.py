"""The engine every worker runs: a model, its paged cache, a scheduler, sampling and stopping.

One engine serves every role. Without a `KvConnector` it prefills and keeps decoding (decode and
colocated workers); with one (a prefill worker) each finished prefill is handed to the connector
and its blocks are held until `release_handoff`. Chunked prefill, the prefix cache and preemption
live in the scheduler, the same for both.

Not thread-safe by design: one loop thread owns an engine and calls `step()`; other threads hand
it work through the worker's own queues. Every path that ends a sequence (finish, abort, overflow,
error, hand-off released) goes through `Scheduler.remove`, which frees the sequence's blocks.

Step isolation: a pass that raises is retried without the sequences that make it fail. The engine
splits the pass in halves and runs each alone, recursively, so a sequence that fails alone is
failed alone (an output with `error` set) while every other sequence's tokens come from passes
that succeeded, as in an undisturbed run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from pdserve.engine import structured
from pdserve.engine.block_pool import BlockPool, block_hashes, blocks_for_tokens
from pdserve.engine.chunk_cost import attention_crossover
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_connector import KvConnector
from pdserve.engine.kv_events import KvEventLog
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.model_runner import StepInput
from pdserve.engine.pass_log import PassLog
from pdserve.engine.runners import build_runner
from pdserve.engine.sampler import TokenHistory, TokenLogprob, sample, token_logprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import PassItem, ScheduledPass, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.sim_profile import prefill_terms, split_pass
from pdserve.engine.stop_checker import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from pdserve.engine.structured import Constraint
from pdserve.engine.thread_governor import ThreadGovernor, adapt_requested
from pdserve.engine.trace import DecodeStepEvent, PrefillPassEvent, TraceEvent
from pdserve.failures import RequestInvalid

log = logging.getLogger(__name__)

#: Writes a request's received K/V into (the cache tensor, the block ids to fill).
BlockWriter = Callable[[torch.Tensor, list[int]], None]


def bad_words_ids(tokenizer: object, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad-word token sequences: each word encoded as is and after a space, without special
    tokens, duplicates dropped (the same on every worker, so both phases ban the same tokens)."""
    found: list[tuple[int, ...]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
            if ids and ids not in found:
                found.append(ids)
    return tuple(found)


@dataclass(frozen=True)
class TokenOutput:
    """One new token of one request, as produced by a step."""

    request_id: str
    token_id: int
    text: str  # streamable text delta (may be empty while bytes of a character are held back)
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens this engine took from its prefix cache (Sequence.num_prefix_hit_tokens)
    error: str | None = None  # set (with finish_reason "error", token_id -1) when a pass failed it
    detokenize_s: float = 0.0  # the request's detokenization time so far
    queue_s: float = 0.0  # queued -> admitted, when this engine prefilled the prompt (else 0)
    prefill_s: float = 0.0  # admitted -> first token, when this engine prefilled the prompt (else 0)
    trace: tuple[TraceEvent, ...] = ()  # step-trace events since its previous output (traced requests)
    logprob: TokenLogprob | None = None  # of token_id (SamplingParams.logprobs)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # every prompt token's, on its first token output


@dataclass(frozen=True)
class PrefillLogprobs:
    """What the engine that prefilled a prompt computed with it, for the request's first token on
    the engine that decodes it: that token's log-probability (SamplingParams.logprobs) and every
    prompt token's (SamplingParams.prompt_logprobs, the first entry without one)."""

    first: TokenLogprob | None = None
    prompt: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class _PassLogprobs:
    """What one pass computed for one item: prompt entries (first position, entries) and the
    sampled token's entry."""

    prompt: tuple[int, list[TokenLogprob]] | None = None
    token: TokenLogprob | None = None


def build_cache(loaded: LoadedModel, config: EngineConfig, shared: bool = False) -> KVCache:
    """A KV cache sized by `num_blocks` or by the memory budget (`shared`: in shared memory)."""
    shape = loaded.kv_shape(config.block_size)
    num_blocks = config.num_blocks or shape.blocks_for_budget(config.kv_cache_memory_mb * 2**20)
    return KVCache(shape, num_blocks, device=config.device, shared=shared)


def _pass_shape(items: list[PassItem]) -> tuple[int, int, int, int]:
    """(decode batch, decode context tokens, prompt tokens, prompt attention) of a pass, counted by
    the pass model's own split, as the simulated engine counts them."""
    prefill, batch, context = split_pass((len(item.token_ids), item.seq.num_cached) for item in items)
    return (batch, context, *prefill_terms(prefill))


class LLMEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        connector: KvConnector | None = None,
        shared_kv_cache: bool = False,
        kv_cache: KVCache | None = None,
    ) -> None:
        """`connector`: hand finished prefills to it instead of decoding them (a prefill worker).
        `shared_kv_cache`: put the KV cache in shared memory (same-host peers read it in place).
        `kv_cache`: use this (idle) cache instead of allocating one: a worker that changes role
        re-purposes its KV memory for a new engine (`elastic_worker`); every block starts free."""
        self.loaded = loaded
        self.config = config
        self.connector = connector
        self.kv_cache = kv_cache if kv_cache is not None else build_cache(loaded, config, shared=shared_kv_cache)
        self.pool = BlockPool(self.kv_cache.num_blocks, config.block_size)
        self.kv_events = self.pool.events = KvEventLog()  # the prefix cache's changes, for the router
        self.runner = build_runner(
            loaded,
            self.kv_cache,
            compile=config.compile,
            deterministic=config.deterministic,
            kernel_table=config.kernel_table,
        )
        self.scheduler = Scheduler(
            config, self.pool, keeps_decoding=connector is None, attention_crossover=attention_crossover(loaded)
        )
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.sequences: dict[str, Sequence] = {}  # every sequence not finished, handed-off ones included
        self.last_pass: ScheduledPass | None = None  # what the latest step planned (for metrics)
        self.pass_log = PassLog.from_env()  # PDSERVE_PASS_LOG: every pass's time and shape (profile fitting)
        self.governor = self._thread_governor()  # None: every pass on the worker's thread count

    # ----- admission -------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], resume_ids: list[int] | None = None) -> None:
        """RequestInvalid naming what is wrong with a request; reads only immutable state, so any
        thread may call it."""
        resume_ids = resume_ids or []
        num_tokens = len(prompt_ids) + len(resume_ids)
        if not prompt_ids:
            raise RequestInvalid("prompt must have at least one token")
        if num_tokens >= self.max_model_len:
            raise RequestInvalid(f"prompt has {num_tokens} tokens; the model's context is {self.max_model_len}")
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids + resume_ids):
            raise RequestInvalid(f"token ids must be in [0, {vocab})")

    def check_fits_pool(self, num_tokens: int) -> None:
        """RequestInvalid if `num_tokens` tokens can never be prefilled here, even with the pool to themselves."""
        if blocks_for_tokens(num_tokens, self.pool.block_size) > self.pool.num_blocks:
            raise RequestInvalid(
                f"prompt of {num_tokens} tokens does not fit this worker's KV pool "
                f"({self.pool.num_blocks} blocks of {self.pool.block_size} tokens)"
            )

    def new_sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        resume_ids: list[int] | None = None,
        trace: bool = False,
    ) -> Sequence:
        """A validated sequence; `resume_ids` are output tokens already delivered (failover);
        `trace`: collect its step trace (engine.trace)."""
        resume_ids = resume_ids or []
        if request_id in self.sequences:
            raise RequestInvalid(f"request id {request_id!r} is already in this engine")
        self.check_request(prompt_ids, resume_ids)
        vocab = self.loaded.config.vocab_size
        for name, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("allowed_token_ids", list(params.allowed_token_ids)),
        ):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise RequestInvalid(f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab})")
        if params.bad_words and not params.bad_words_ids:
            params = dataclasses.replace(params, bad_words_ids=bad_words_ids(self.loaded.tokenizer, params.bad_words))
        seq = Sequence.create(
            request_id, prompt_ids, params, self.loaded.tokenizer, self.loaded.eos_token_ids, trace=trace
        )
        seq.replay(resume_ids)
        if params.structured is not None:  # rebuilt from the tokens: the same on every worker
            seq.constraint = Constraint(self.loaded, *params.structured)
            seq.constraint.advance(resume_ids)
        self.sequences[request_id] = seq
        return seq

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        resume_ids: list[int] | None = None,
        output_index: int = 0,
        trace: bool = False,
    ) -> Sequence:
        """Queue a request for prefill here (resumed ones recompute their outputs' K/V).
        `output_index`: output position of the token sampled after the prompt, when the prompt
        already ends with earlier outputs (a prefill worker computing a resumed request)."""
        self.check_fits_pool(len(prompt_ids) + len(resume_ids or []))
        seq = self.new_sequence(request_id, prompt_ids, params, resume_ids, trace)
        seq.output_index_base = output_index
        if seq.constraint is not None and output_index:  # the prompt ends with earlier outputs
            seq.constraint.advance(prompt_ids[len(prompt_ids) - output_index :])
        self.scheduler.add_waiting(seq)
        return seq

    def reserve(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        resume_ids: list[int] | None = None,
        trace: bool = False,
    ) -> Sequence | None:
        """Hold blocks for tokens whose K/V will arrive from elsewhere; None if the pool is full.

        With prefix caching, the leading full blocks this engine already holds for the same tokens
        (from an earlier transfer) are shared instead: `seq.num_reused_blocks` of them, never the
        block of the last token, so at least one block always arrives."""
        seq = self.new_sequence(request_id, prompt_ids, params, resume_ids, trace)
        seq.status = SequenceStatus.RESERVED
        if self.config.prefix_caching:
            hashes = block_hashes(seq.all_ids, self.pool.block_size, seq.params.cache_salt)
            seq.block_table = self.pool.lookup(hashes[: (seq.num_tokens - 1) // self.pool.block_size])
            seq.num_reused_blocks = len(seq.block_table)
            seq.num_prefix_hit_tokens = min(seq.num_reused_blocks * self.pool.block_size, len(seq.prompt_ids))
        if not self.scheduler.grow(seq, seq.num_tokens + 1):
            self.pool.free(seq.block_table)
            seq.block_table, seq.num_reused_blocks = [], 0
            del self.sequences[request_id]
            return None
        return seq

    def commit_prefilled(
        self,
        seq: Sequence,
        kv_blocks: torch.Tensor | BlockWriter,
        first_token: int,
        logprobs: PrefillLogprobs | None = None,
    ) -> TokenOutput:
        """`store_prefilled`, then `start_decoding`."""
        self.store_prefilled(seq, kv_blocks)
        return self.start_decoding(seq, first_token, logprobs)

    def store_prefilled(self, seq: Sequence, kv_blocks: torch.Tensor | BlockWriter) -> None:
        """K/V arrived for blocks [num_reused_blocks, ...) of every token so far: a tensor
        [L, 2, n_blocks, block_size, H, D] to store, or a writer that copies them straight into
        `(cache tensor, block ids)`. The sequence stays reserved until `start_decoding`."""
        offset = seq.num_reused_blocks
        targets = seq.block_table[offset : blocks_for_tokens(seq.num_tokens, self.pool.block_size)]
        if isinstance(kv_blocks, torch.Tensor):
            self.kv_cache.scatter(targets, kv_blocks)
        else:
            kv_blocks(self.kv_cache.kv, targets)
        seq.num_cached = seq.num_tokens
        if self.config.prefix_caching:  # full blocks are never written again: later requests may share them
            seq.prefix_hashes = block_hashes(seq.all_ids, self.pool.block_size, seq.params.cache_salt)
            self.scheduler.cache_computed_blocks(seq, 0)

    def start_decoding(self, seq: Sequence, first_token: int, logprobs: PrefillLogprobs | None = None) -> TokenOutput:
        """A stored prefilled sequence emits the first token the prefill side sampled, with the
        log-probabilities it computed (`logprobs`: this engine computed none of the prompt's), and
        decodes from then on."""
        if logprobs is not None:
            if logprobs.first is not None:
                seq.next_logprob = logprobs.first
            if logprobs.prompt is not None and seq.prompt_logprobs is not None:
                if len(logprobs.prompt) != len(seq.prompt_ids):
                    raise ValueError(
                        f"prompt logprobs: {len(logprobs.prompt)} entries for {len(seq.prompt_ids)} prompt tokens"
                    )
                seq.prompt_logprobs = list(logprobs.prompt)
        out = self._append(seq, first_token)
        if not seq.is_finished:
            self.scheduler.add_running(seq)
        return out

    def commit_migrated(self, seq: Sequence, kv_blocks: torch.Tensor, block_offset: int) -> None:
        """Live migration, target side: K/V [L, 2, n, block_size, H, D] arrived for blocks
        [block_offset, ...) of every token but the last of reserved `seq` (its prompt, and outputs
        replayed from the source); blocks it shares from this engine's prefix cache are not written.
        The last output is the input of its next decode step, as on the source: nothing is emitted
        now, and no prompt token is computed here."""
        num_cached = seq.num_tokens - 1
        first = max(block_offset, seq.num_reused_blocks)
        targets = seq.block_table[first : blocks_for_tokens(num_cached, self.pool.block_size)]
        if targets:
            self.kv_cache.scatter(targets, kv_blocks[:, :, first - block_offset :])
        seq.num_cached = num_cached
        if self.config.prefix_caching:
            seq.prefix_hashes = block_hashes(seq.all_ids, self.pool.block_size, seq.params.cache_salt)
            self.scheduler.cache_computed_blocks(seq, 0)
        seq.status = SequenceStatus.RUNNING
        self.scheduler.add_running(seq)

    def suspend(self, request_id: str) -> Sequence:
        """Live migration, source side: take a decoding sequence out of the batch between steps,
        keeping its blocks (status HANDED_OFF: `abort` leaves it alone, `release_handoff` frees it).
        Every token it sampled was already emitted. KeyError if unknown, ValueError if not decoding."""
        seq = self.sequences[request_id]
        if seq.status is not SequenceStatus.RUNNING or seq not in self.scheduler.running:
            raise ValueError(f"request {request_id} is not decoding (status {seq.status.value})")
        self.scheduler.running.remove(seq)
        seq.status = SequenceStatus.HANDED_OFF
        return seq

    def abort(self, request_id: str) -> None:
        """End a request wherever it is and free its blocks (no-op if unknown). A handed-off
        sequence is left alone: its K/V may still be read; `release_handoff` frees it."""
        seq = self.sequences.get(request_id)
        if seq is not None and seq.status is not SequenceStatus.HANDED_OFF:
            del self.sequences[request_id]
            seq.finish(FINISH_ABORT)
            self.scheduler.remove(seq)

    def release_handoff(self, seq: Sequence) -> None:
        """The K/V of handed-off `seq` left (or failed to): free its blocks. Idempotent, and a no-op
        for a sequence the engine already ended (e.g. failed with its pass)."""
        if self.sequences.get(seq.request_id) is seq and seq.status is SequenceStatus.HANDED_OFF:
            del self.sequences[seq.request_id]
            self.scheduler.remove(seq)

    # ----- stepping --------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenOutput]:
        """Run one pass: a decode step of every running sequence plus, in the same pass, prompt
        chunks that fit the remaining token budget and batch slots (mixed batch: a request joining
        mid-run costs no pass of its own)."""
        started = time.perf_counter()
        planned = self.scheduler.schedule()
        self.last_pass = planned
        outputs = [self._finish(seq, FINISH_LENGTH) for seq in self._drain_overflowed()]
        if planned.items:
            shape = _pass_shape(planned.items) if self.pass_log is not None else None
            outputs += self._run(planned.items)
            if shape is not None:
                self.pass_log.write(started, time.perf_counter() - started, *shape)  # type: ignore[union-attr]
        return outputs

    def _thread_governor(self) -> ThreadGovernor | None:
        """The engine's thread governor (engine/thread_governor.py), where it may choose: more than
        one torch thread, the CPU, not deterministic mode, and a fast forward whose linears give the
        same bits at both thread counts."""
        threads = torch.get_num_threads()
        fast = getattr(self.runner, "fast", None)
        if not adapt_requested(self.config.adapt_threads) or threads < 2 or self.config.deterministic:
            return None
        if self.config.device != "cpu" or fast is None:
            return None
        if not fast.thread_invariant((threads, threads - 1)):
            log.info("engine threads fixed at %d: a linear kernel's bits change with the thread count here", threads)
            return None
        return ThreadGovernor(threads)

    def _drain_overflowed(self) -> list[Sequence]:
        seqs, self.scheduler.overflowed = self.scheduler.overflowed, []
        return seqs

    def _run(self, items: list[PassItem]) -> list[TokenOutput]:
        """Compute a pass and apply it; if it raises, isolate the sequences that make it fail."""
        governor, key, threads = self.governor, None, 0
        if governor is not None:
            key = len(items) if all(not item.is_prefill for item in items) else None  # pure decode: comparable
            threads = governor.threads_for(key)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        started = time.perf_counter()
        try:
            sampled, logprobs = self._compute(items)
        except Exception as exc:  # noqa: BLE001 - a failing pass fails only the sequences that cause it
            return self._isolate(items, exc)
        took = time.perf_counter() - started
        if governor is not None:
            governor.record(key, threads, took)
        return self._apply(items, sampled, took, logprobs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], histories: list[TokenHistory | None]) -> list[int]:
        """One token per row; in deterministic mode each row is sampled alone (a batched sort, top-k
        or softmax could order or sum a row otherwise beside rows of other widths)."""
        params, steps = [seq.params for seq in seqs], [seq.next_output_index for seq in seqs]
        eos = self.loaded.eos_token_ids
        if not self.config.deterministic:
            return sample(logits, params, steps, histories, eos)
        return [
            sample(logits[r : r + 1], params[r : r + 1], steps[r : r + 1], histories[r : r + 1], eos)[0]
            for r in range(len(seqs))
        ]

    def _compute(self, items: list[PassItem]) -> tuple[list[int], dict[int, _PassLogprobs]]:
        """Forward pass and sampling, with no change to any sequence: a failed attempt leaves
        nothing to undo (K/V slots it wrote are rewritten by the retry). Returns one token per
        item that samples, in order, and the log-probabilities asked for (by item row)."""
        completing = [item.seq for item in items if item.completes_prefill]
        on_layer = self.connector.layer_hook(completing) if self.connector and completing else None
        full_rows = [row for row, item in enumerate(items) if item.is_prefill and item.seq.wants_prompt_logprobs()]
        extra = {"full_rows": full_rows} if full_rows else {}  # only the real runner computes them
        rows = [row for row, item in enumerate(items) if item.samples]
        seqs = [items[r].seq for r in rows]
        # grammar masks are computed while the model runs (llguidance's threads, without the GIL)
        masks = (
            structured.start_masks([seq.constraint for seq in seqs], int(self.loaded.config.vocab_size))
            if any(seq.constraint is not None for seq in seqs)
            else None
        )
        try:
            logits = self.runner.forward(
                [StepInput(item.token_ids, item.seq.num_cached, item.seq.block_table) for item in items],
                on_layer_done=on_layer,
                **extra,
            )
        finally:
            if masks is not None:  # a failed pass still waits: the matchers must be idle before anything else
                structured.finish_masks(masks)
        histories = [TokenHistory(seq.all_ids, seq.next_output_index) if seq.params.penalized else None for seq in seqs]
        # every row samples in a pure decode pass: no [rows, vocab] copy then (masks write into theirs)
        row_logits = logits if masks is None and len(rows) == logits.shape[0] else logits[rows]
        if masks is not None:
            structured.apply_masks(row_logits, masks)
        sampled = self._sample(row_logits, seqs, histories)
        logprobs: dict[int, _PassLogprobs] = {}
        for row in full_rows:
            seq, start = items[row].seq, items[row].seq.num_cached
            # the logits at position p predict prompt token p + 1
            targets = seq.prompt_ids[start + 1 : start + 1 + len(items[row].token_ids)]
            entries = (
                token_logprobs(self.runner.full_logits[row][: len(targets)], targets, seq.params.prompt_logprobs or 0)
                if targets
                else []
            )
            logprobs[row] = _PassLogprobs(prompt=(start + 1, entries))
        for slot, (row, token) in enumerate(zip(rows, sampled, strict=True)):
            num_top = items[row].seq.params.logprobs
            if num_top is not None:
                entry = token_logprobs(row_logits[slot : slot + 1], [token], num_top)[0]
                logprobs[row] = _PassLogprobs(logprobs[row].prompt if row in logprobs else None, entry)
        return sampled, logprobs

    def _isolate(self, items: list[PassItem], error: Exception) -> list[TokenOutput]:
        """Fail what cannot be retried (K/V already streaming, or a pass of one sequence); retry the
        rest, whole if some were dropped, else in halves."""
        completing = [item.seq for item in items if item.completes_prefill]
        streamed = self.connector.pass_failed(completing, error) if self.connector and completing else []
        lost = {id(seq) for seq in streamed}
        if len(items) == 1:
            lost.add(id(items[0].seq))
        outputs = [self._fail(item.seq, error) for item in items if id(item.seq) in lost]
        rest = [item for item in items if id(item.seq) not in lost]
        if not rest:
            return outputs
        log.warning("a pass of %d sequences failed (%s); retrying %d of them apart", len(items), error, len(rest))
        if len(rest) < len(items):
            return outputs + self._run(rest)
        half = len(rest) // 2
        return outputs + self._run(rest[:half]) + self._run(rest[half:])

    def _apply(
        self, items: list[PassItem], sampled: list[int], pass_s: float, logprobs: dict[int, _PassLogprobs] | None = None
    ) -> list[TokenOutput]:
        """Advance every sequence of a successful pass; emit (or hand off) the sampled tokens."""
        tokens = iter(sampled)
        outputs = []
        for row, item in enumerate(items):
            seq, done_prefill, samples = item.seq, item.completes_prefill, item.samples
            extra = (logprobs or {}).get(row)
            if extra is not None and extra.prompt is not None:
                seq.add_prompt_logprobs(*extra.prompt)
            seq.next_logprob = extra.token if extra is not None else None
            before, seq.num_cached = seq.num_cached, seq.num_cached + len(item.token_ids)
            token = next(tokens) if samples else None
            if seq.trace is not None:
                seq.trace.append(_trace_event(item, before, token, pass_s))
            if item.is_prefill:
                self.scheduler.cache_computed_blocks(seq, before)
            if done_prefill:
                self.scheduler.finish_prefill(seq)
            if token is not None and self.connector is not None:
                self._hand_off(seq, token)
                continue
            if token is not None:
                outputs.append(self._append(seq, token))
            if done_prefill and not seq.is_finished:
                self.scheduler.add_running(seq)
        return outputs

    def _hand_off(self, seq: Sequence, first_token: int) -> None:
        seq.status = SequenceStatus.HANDED_OFF
        self.connector.prefill_done(seq, first_token)  # type: ignore[union-attr]

    def _append(self, seq: Sequence, token_id: int) -> TokenOutput:
        text = seq.append_token(token_id)
        if seq.constraint is not None:
            seq.constraint.consume(token_id)
            if seq.constraint.done and not seq.is_finished:  # the structured output is complete
                text += seq.finish(FINISH_STOP)
        if not seq.is_finished and seq.num_tokens >= self.max_model_len:
            text += seq.finish(FINISH_LENGTH)
        if seq.is_finished:
            self.sequences.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        return self._output(seq, token_id, text)

    def _finish(self, seq: Sequence, reason: str) -> TokenOutput:
        text = seq.finish(reason)
        self.sequences.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        return self._output(seq, -1, text)

    def _fail(self, seq: Sequence, error: Exception) -> TokenOutput:
        """End `seq` because a pass failed with it alone (or its K/V already left): blocks freed."""
        log.warning("request_id=%s: failed by its forward pass: %s", seq.request_id, error)
        seq.finish(FINISH_ERROR)
        self.sequences.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        return TokenOutput(
            request_id=seq.request_id,
            token_id=-1,
            text="",
            finish_reason=FINISH_ERROR,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            error=str(error) or type(error).__name__,
            detokenize_s=seq.detokenize_s,
            trace=seq.take_trace(),
        )

    @staticmethod
    def _output(seq: Sequence, token_id: int, text: str) -> TokenOutput:
        queue_s, prefill_s = seq.queue_and_prefill_s if seq.is_finished else (0.0, 0.0)
        logprob, seq.next_logprob = (seq.next_logprob if token_id >= 0 else None), None
        prompt_logprobs = None
        if token_id >= 0 and seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs, seq.prompt_logprobs_sent = tuple(seq.prompt_logprobs), True
        return TokenOutput(
            logprob=logprob,
            prompt_logprobs=prompt_logprobs,
            request_id=seq.request_id,
            token_id=token_id,
            text=text,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            num_cached_tokens=seq.num_prefix_hit_tokens,
            detokenize_s=seq.detokenize_s,
            queue_s=queue_s,
            prefill_s=prefill_s,
            trace=seq.take_trace(),
        )

    # ----- convenience -----------------------------------------------------------------------
    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); return their output ids."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}-{id(p)}" for i, p in enumerate(prompts)]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        while self.has_work:
            for out in self.step():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.token_id >= 0:
                    results[out.request_id].append(out.token_id)
        return [results[rid] for rid in ids]


def _trace_event(item: PassItem, kv_before: int, token: int | None, pass_s: float) -> TraceEvent:
    """The trace event of one sequence's part of a pass: a prefill pass (chunk) or a decode step."""
    seq = item.seq
    if item.is_prefill:
        return PrefillPassEvent(len(item.token_ids), kv_before, seq.num_cached, pass_s, token)
    last = seq.last_token_time or seq.first_token_time or seq.arrival_time
    return DecodeStepEvent(token if token is not None else -1, seq.num_cached, time.perf_counter() - last)
