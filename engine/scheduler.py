"""Continuous-batching scheduler of every worker role: who gets blocks, what runs in the next pass.

A pass (`schedule`) is planned in two phases:
1. Decode: every running sequence gets room for one more token. When the pool cannot give it a
   block, newer work is preempted (sequences still prefilling first, newest first, then the newest
   running one): its blocks are freed and it waits to be recomputed (prompt plus the tokens it
   already has), so nothing crashes and nothing is lost.
2. Prefill: the rest of the token budget (`max_num_batched_tokens`) goes to prompts, first come
   first served: sequences already prefilling continue, then waiting ones are admitted. Each gets
   at most `prefill_chunk_tokens` tokens per pass (chunked prefill: a long prompt cannot hold short
   ones back). While streams decode in the pass, its prompt chunks together cost at most one
   plain chunk (`engine.chunk_cost`: a chunk deep in a long prompt attends to more context, so it
   gets fewer tokens), so a running stream stalls one chunk's time at most, whatever the prompts
   beside it. Admission allocates blocks for every token the sequence must prefill, taking the
   blocks of its longest cached prefix from the pool (prefix caching); the blocks it computes are
   registered for later prompts as soon as they are full.

Roles: a prefill worker's engine hands each finished prefill off (`keeps_decoding=False`); its
sequences never decode, so admission keeps no blocks of headroom for their growth. Decode and
colocated workers keep decoding. Nothing else differs.

Invariant: blocks are taken only by `grow` and `_admit` and given back only by `preempt` and
`remove`, each of which empties the sequence's block table, so no block is freed twice.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool, block_hashes, blocks_for_tokens
from pdserve.engine.chunk_cost import chunk_cost, next_chunk, stream_allowance
from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import Sequence, SequenceStatus

#: Prompt chunks of a request that wants prompt log-probabilities are at most this long: each of its
#: positions costs a log_softmax over the vocabulary (and its logits are kept), so a normal-sized chunk
#: stalled the running streams several times longer than a plain one, and held chunk x vocab floats.
PROMPT_LOGPROB_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class PassItem:
    """One sequence's share of a pass: the tokens whose K/V it computes."""

    seq: Sequence
    token_ids: list[int]
    is_prefill: bool

    @property
    def completes_prefill(self) -> bool:
        """This pass computes the last of the tokens the sequence had to prefill."""
        return self.is_prefill and self.seq.num_cached + len(self.token_ids) == len(self.seq.prefill_ids)

    @property
    def samples(self) -> bool:
        """After this pass every token of the sequence is cached: its next token is sampled. (A
        recomputed sequence is not sampled: it already holds its next input token.)"""
        return self.seq.num_cached + len(self.token_ids) == self.seq.num_tokens


@dataclass(frozen=True)
class ScheduledPass:
    """What one forward pass computes: decode steps first (the model runner relies on the order)."""

    items: list[PassItem]

    @property
    def num_decode(self) -> int:
        return sum(1 for item in self.items if not item.is_prefill)

    @property
    def num_prefill_seqs(self) -> int:
        return len(self.items) - self.num_decode

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(item.token_ids) for item in self.items if item.is_prefill)


class Scheduler:
    def __init__(
        self, config: EngineConfig, pool: BlockPool, keeps_decoding: bool = True, attention_crossover: float = math.inf
    ) -> None:
        """`attention_crossover`: the model's K of `engine.chunk_cost` (infinite: a chunk's cost
        does not grow with its context)."""
        self.config = config
        self.pool = pool
        self.keeps_decoding = keeps_decoding
        self.attention_crossover = attention_crossover
        self.waiting: deque[Sequence] = deque()  # no blocks yet (or preempted), FIFO
        self.prefilling: list[Sequence] = []  # admitted, K/V of their prefix partly computed, FIFO
        self.running: list[Sequence] = []  # decoding, oldest first
        self.num_preemptions = 0
        self.overflowed: list[Sequence] = []  # alone and still too long for the pool: must finish

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def pending_prefill_tokens(self) -> int:
        """Tokens still to prefill here (safe to call from any thread: it reads copies)."""
        return sum(len(s.prefill_ids) - s.num_cached for s in [*list(self.waiting), *list(self.prefilling)])

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens` tokens in total; False if the pool cannot."""
        missing = blocks_for_tokens(num_tokens, self.pool.block_size) - len(seq.block_table)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        seq.block_table.extend(self.pool.allocate(missing))
        return True

    # ----- planning a pass ---------------------------------------------------------------------
    def schedule(self) -> ScheduledPass:
        """Plan the next pass: a decode step of every running sequence, then prompt chunks within
        the remaining token budget and batch slots."""
        decode = self.schedule_decode()
        items = [PassItem(seq, [seq.output_ids[-1]], is_prefill=False) for seq in decode]
        budget = self.config.max_num_batched_tokens - len(decode)
        allowance = self.stream_allowance if decode else math.inf
        for seq, num_new in self.schedule_prefill(budget, allowance):
            start = seq.num_cached
            items.append(PassItem(seq, seq.prefill_ids[start : start + num_new], is_prefill=True))
        return ScheduledPass(items)

    def schedule_decode(self) -> list[Sequence]:
        """Make room for one more token in each running sequence, preempting newer work if needed."""
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.pop(0)
            if self._make_room(seq, scheduled):
                scheduled.append(seq)
        self.running = scheduled
        return list(scheduled)

    def _make_room(self, seq: Sequence, scheduled: list[Sequence]) -> bool:
        while not self.grow(seq, seq.num_tokens):
            victim = self._newest_preemptible()
            if victim is not None:
                self.preempt(victim)
                continue
            if scheduled:  # `seq` is itself the newest: it waits
                self.preempt(seq)
            else:  # alone with the whole pool and still too long
                self._overflow(seq)
            return False
        return True

    def _newest_preemptible(self) -> Sequence | None:
        """Newest work not yet in this pass: a sequence still prefilling, else a running one."""
        if self.prefilling:
            return self.prefilling.pop()
        if self.running:
            return self.running.pop()
        return None

    @property
    def stream_allowance(self) -> float:
        """What the prompt chunks of a pass that carries decoding streams may cost together: one
        plain chunk, on no context (`engine.chunk_cost` units)."""
        chunk = self.config.prefill_chunk_tokens or self.config.max_num_batched_tokens
        return stream_allowance(chunk, self.attention_crossover)

    def schedule_prefill(self, budget: int, allowance: float = math.inf) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens) pairs within `budget` tokens and `allowance` cost: prefilling
        sequences continue FIFO, then waiting ones are admitted FIFO while slots and blocks allow.
        The first chunk gets at least one token, so a prompt always progresses."""
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.prefilling:
            num_new = self._chunk_size(seq, budget, allowance, first=not chunks)
            if num_new == 0:
                break
            chunks.append((seq, num_new))
            budget -= num_new
            allowance -= chunk_cost(num_new, seq.num_cached, self.attention_crossover)
        while budget > 0 and allowance >= 1 and self.waiting and self._has_slot() and self._admit(self.waiting[0]):
            seq = self.waiting.popleft()
            self.prefilling.append(seq)
            num_new = self._chunk_size(seq, budget, allowance, first=not chunks)
            if num_new == 0:  # admitted (its prefix cache hits held), it starts next pass
                break
            chunks.append((seq, num_new))
            budget -= num_new
            allowance -= chunk_cost(num_new, seq.num_cached, self.attention_crossover)
        return chunks

    def _chunk_size(self, seq: Sequence, budget: int, allowance: float = math.inf, first: bool = False) -> int:
        chunk = self.config.prefill_chunk_tokens or self.config.max_num_batched_tokens
        if seq.wants_prompt_logprobs():  # every position's log_softmax over the vocabulary: smaller chunks
            chunk = min(chunk, PROMPT_LOGPROB_CHUNK_TOKENS)
        return next_chunk(
            len(seq.prefill_ids) - seq.num_cached,
            seq.num_cached,
            chunk,
            budget,
            allowance,
            self.attention_crossover,
            first,
        )

    def _has_slot(self) -> bool:
        return len(self.running) + len(self.prefilling) < self.config.max_num_seqs

    def _admit(self, seq: Sequence) -> bool:
        """Allocate blocks for every token `seq` must prefill (its cached prefix's blocks shared, the
        last token always computed); False, touching nothing, if the pool cannot."""
        tokens = seq.prefill_ids
        needed = blocks_for_tokens(len(tokens), self.pool.block_size)
        # keep a block of headroom per sequence that will decode, so prefill does not force preemption
        headroom = len(self.running) + len(self.prefilling) if self.keeps_decoding else 0
        if not self.pool.can_allocate(needed + headroom):
            return False
        salt = seq.params.cache_salt
        hashes = block_hashes(tokens, self.pool.block_size, salt) if self.config.prefix_caching else []
        # prompt log-probabilities need the logits at every prompt position: compute them all
        usable = 0 if seq.wants_prompt_logprobs() else (len(tokens) - 1) // self.pool.block_size
        hits = self.pool.lookup(hashes[:usable])
        seq.block_table = hits + self.pool.allocate(needed - len(hits))
        seq.prefix_hashes = hashes
        seq.num_cached = len(hits) * self.pool.block_size
        if seq.scheduled_time is None:  # first admission (not a re-admission after preemption)
            seq.num_prefix_hit_tokens = min(seq.num_cached, len(seq.prompt_ids))
        seq.status = SequenceStatus.PREFILLING
        if seq.scheduled_time is None:
            seq.scheduled_time = time.perf_counter()
        return True

    # ----- after a pass ------------------------------------------------------------------------
    def cache_computed_blocks(self, seq: Sequence, num_cached_before: int) -> None:
        """Register the blocks of `seq.prefix_hashes` that became full of computed K/V since
        `num_cached_before` tokens were cached, so later prompts with the same prefix share them."""
        first = num_cached_before // self.pool.block_size
        last = min(len(seq.prefix_hashes), seq.num_cached // self.pool.block_size)
        for index in range(first, last):
            self.pool.cache_block(seq.block_table[index], seq.prefix_hashes[index])

    def finish_prefill(self, seq: Sequence) -> None:
        """`seq`'s prefix is computed: it leaves the prefilling list (the engine decides where to)."""
        self.prefilling.remove(seq)

    # ----- ending and preempting -----------------------------------------------------------------
    def _overflow(self, seq: Sequence) -> None:
        """`seq` cannot grow even with the pool to itself: it ends (the engine reports 'length')."""
        self.remove(seq)
        self.overflowed.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free the blocks of `seq` (already out of the running or prefilling list) and queue it for
        recomputation ahead of new arrivals."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of every queue and free its blocks (finish, abort, error, hand-off done)."""
        for queue in (self.running, self.prefilling, self.waiting):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self.pool.free(seq.block_table)
            seq.block_table = []
        seq.status = SequenceStatus.FINISHED
