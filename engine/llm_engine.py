"""The engine one worker runs: a model, its paged cache, a scheduler, sampling and stopping.

Not thread-safe by design: one loop thread owns an engine and calls `step()`; other threads hand
it work through the worker's own queues. Every path that ends a sequence (finish, abort, overflow)
goes through `Scheduler.remove`, which frees the sequence's blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool, block_hashes, blocks_for_tokens
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.model_loader import LoadedModel
from engine.model_runner import StepInput
from engine.runners import build_runner
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.stop_checker import FINISH_ABORT, FINISH_LENGTH

log = logging.getLogger(__name__)

#: Writes a request's received K/V into (the cache tensor, the block ids to fill).
BlockWriter = Callable[[torch.Tensor, list[int]], None]


@dataclass(frozen=True)
class TokenOutput:
    """One new token of one request, as produced by a step."""

    request_id: str
    token_id: int
    text: str  # streamable text delta (may be empty while bytes of a character are held back)
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


def build_cache(loaded: LoadedModel, config: EngineConfig, shared: bool = False) -> KVCache:
    """A KV cache sized by `num_blocks` or by the memory budget (`shared`: in shared memory)."""
    shape = loaded.kv_shape(config.block_size)
    num_blocks = config.num_blocks or shape.blocks_for_budget(config.kv_cache_memory_mb * 2**20)
    return KVCache(shape, num_blocks, device=config.device, shared=shared)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.kv_cache = build_cache(loaded, config)
        self.pool = BlockPool(self.kv_cache.num_blocks, config.block_size)
        self.runner = build_runner(loaded, self.kv_cache)
        self.scheduler = Scheduler(config, self.pool)
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.sequences: dict[str, Sequence] = {}

    # ----- admission -------------------------------------------------------------------------
    def new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     resume_ids: list[int] | None = None) -> Sequence:
        """A validated sequence; `resume_ids` are output tokens already delivered (failover)."""
        resume_ids = resume_ids or []
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in this engine")
        if not prompt_ids:
            raise ValueError("prompt must have at least one token")
        if len(prompt_ids) + len(resume_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids) + len(resume_ids)} tokens; the model's context is {self.max_model_len}"
            )
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids + resume_ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        seq = Sequence.create(request_id, prompt_ids, params, self.loaded.tokenizer, self.loaded.eos_token_ids)
        seq.replay(resume_ids)
        self.sequences[request_id] = seq
        return seq

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    resume_ids: list[int] | None = None) -> Sequence:
        """Queue a request for local prefill and decode (resumed ones recompute their outputs' K/V)."""
        seq = self.new_sequence(request_id, prompt_ids, params, resume_ids)
        self.scheduler.add_waiting(seq)
        return seq

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                resume_ids: list[int] | None = None) -> Sequence | None:
        """Hold blocks for tokens whose K/V will arrive from elsewhere; None if the pool is full.

        With prefix caching, the leading full blocks this engine already holds for the same tokens
        (from an earlier transfer) are shared instead: `seq.num_reused_blocks` of them, never the
        block of the last token, so at least one block always arrives."""
        seq = self.new_sequence(request_id, prompt_ids, params, resume_ids)
        seq.status = SequenceStatus.RESERVED
        if self.config.prefix_caching:
            hashes = block_hashes(seq.all_ids, self.pool.block_size)
            seq.block_table = self.pool.lookup(hashes[: (seq.num_tokens - 1) // self.pool.block_size])
            seq.num_reused_blocks = len(seq.block_table)
        if not self.scheduler.grow(seq, seq.num_tokens + 1):
            self.pool.free(seq.block_table)
            seq.block_table, seq.num_reused_blocks = [], 0
            del self.sequences[request_id]
            return None
        return seq

    def commit_prefilled(self, seq: Sequence, kv_blocks: torch.Tensor | BlockWriter, first_token: int) -> TokenOutput:
        """K/V arrived for blocks [num_reused_blocks, ...) of every token so far: a tensor
        [L, 2, n_blocks, block_size, H, D] to store, or a writer that copies them straight into
        `(cache tensor, block ids)`. Then start decoding."""
        offset = seq.num_reused_blocks
        targets = seq.block_table[offset : blocks_for_tokens(seq.num_tokens, self.pool.block_size)]
        if isinstance(kv_blocks, torch.Tensor):
            self.kv_cache.scatter(targets, kv_blocks)
        else:
            kv_blocks(self.kv_cache.kv, targets)
        seq.num_cached = seq.num_tokens
        if self.config.prefix_caching:  # full blocks are never written again: later requests may share them
            for block, prefix_hash in zip(seq.block_table, block_hashes(seq.all_ids, self.pool.block_size),
                                          strict=False):
                self.pool.cache_block(block, prefix_hash)
        out = self._append(seq, first_token)
        if not seq.is_finished:
            self.scheduler.add_running(seq)
        return out

    def abort(self, request_id: str) -> None:
        """End a request wherever it is and free its blocks (no-op if unknown)."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            seq.finish(FINISH_ABORT)
            self.scheduler.remove(seq)

    # ----- stepping --------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenOutput]:
        """Run one pass: a decode step of every running sequence plus, in the same pass, prefills of
        waiting sequences that fit the remaining token budget and batch slots (mixed batch: a
        request joining mid-run costs no pass of its own)."""
        decode = self.scheduler.schedule_decode()
        outputs = [self._finish(seq, FINISH_LENGTH, None) for seq in self._drain_overflowed()]
        prefill = self.scheduler.schedule_prefill(self.config.max_num_batched_tokens - len(decode))
        if not decode and not prefill:
            return outputs
        new_tokens = [[s.output_ids[-1]] for s in decode] + [self.scheduler.prefill_tokens(s) for s in prefill]
        return outputs + self._run(decode + prefill, new_tokens)

    def _drain_overflowed(self) -> list[Sequence]:
        seqs, self.scheduler.overflowed = self.scheduler.overflowed, []
        return seqs

    def _run(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> list[TokenOutput]:
        items = [StepInput(t, s.num_cached, s.block_table) for s, t in zip(seqs, new_tokens, strict=True)]
        logits = self.runner.forward(items)
        for seq, tokens in zip(seqs, new_tokens, strict=True):
            seq.num_cached += len(tokens)
        # recomputed (preempted) sequences already have their next input token: no sampling
        fresh = [i for i, s in enumerate(seqs) if s.num_cached == s.num_tokens]
        tokens = sample(logits[fresh], [seqs[i].params for i in fresh], [len(seqs[i].output_ids) for i in fresh])
        outputs = [self._append(seqs[i], tok) for i, tok in zip(fresh, tokens, strict=True)]
        for seq in seqs:
            if seq.status is SequenceStatus.WAITING and not seq.is_finished:
                self.scheduler.add_running(seq)
        return outputs

    def _append(self, seq: Sequence, token_id: int) -> TokenOutput:
        text = seq.append_token(token_id)
        if not seq.is_finished and seq.num_tokens >= self.max_model_len:
            text += seq.finish(FINISH_LENGTH)
        if seq.is_finished:
            self.sequences.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        return self._output(seq, token_id, text)

    def _finish(self, seq: Sequence, reason: str, token_id: int | None) -> TokenOutput:
        text = seq.finish(reason)
        self.sequences.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        return self._output(seq, -1 if token_id is None else token_id, text)

    @staticmethod
    def _output(seq: Sequence, token_id: int, text: str) -> TokenOutput:
        return TokenOutput(
            request_id=seq.request_id, token_id=token_id, text=text, finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids), num_output_tokens=len(seq.output_ids),
        )

    # ----- convenience -----------------------------------------------------------------------
    def generate(
        self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); return their output ids."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}-{id(p)}" for i, p in enumerate(prompts)]
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        while self.has_work:
            for out in self.step():
                if out.token_id >= 0:
                    results[out.request_id].append(out.token_id)
        return [results[rid] for rid in ids]
