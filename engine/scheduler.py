"""Continuous-batching scheduler: who gets blocks, who runs in the next pass.

Waiting sequences are prefilled first-come first-served within a token budget; running sequences
then take one decode step each. When the pool cannot give a running sequence the block its next
token needs, the newest running sequence is preempted: its blocks are freed and it waits to be
recomputed (prompt plus the tokens it already has), so nothing crashes and nothing is lost.
"""

from __future__ import annotations

from collections import deque

from engine.block_pool import BlockPool, blocks_for_tokens
from engine.config import EngineConfig
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.overflowed: list[Sequence] = []  # alone and still too long for the pool: must finish

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def prefill_tokens(self, seq: Sequence) -> list[int]:
        """Tokens a waiting sequence must compute: the prompt, or everything but the last token
        of a preempted sequence (which re-enters decode with that token as its input)."""
        return seq.all_ids[:-1] if seq.output_ids else seq.prompt_ids

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens` tokens in total; False if the pool cannot."""
        missing = blocks_for_tokens(num_tokens, self.pool.block_size) - len(seq.block_table)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        seq.block_table.extend(self.pool.allocate(missing))
        return True

    def schedule_prefill(self, budget: int | None = None) -> list[Sequence]:
        """Take waiting sequences FIFO while tokens (`budget`, default the whole pass budget), batch
        slots and blocks allow. The first one is taken whatever its length (so none starves)."""
        batch: list[Sequence] = []
        budget = self.config.max_num_batched_tokens if budget is None else budget
        while self.waiting and len(self.running) + len(batch) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = len(self.prefill_tokens(seq))
            if batch and num_new > budget:
                break
            # keep a block of headroom per running sequence so prefill does not force preemption
            headroom = len(self.running) + len(batch)
            needed = blocks_for_tokens(num_new, self.pool.block_size) + headroom
            if not self.pool.can_allocate(needed) or not self.grow(seq, num_new):
                break
            self.waiting.popleft()
            batch.append(seq)
            budget -= num_new
        return batch

    def schedule_decode(self) -> list[Sequence]:
        """Make room for one more token in each running sequence, preempting the newest if needed."""
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.pop(0)
            while not self.grow(seq, seq.num_tokens):
                if self.running:  # preempt the newest sequence not yet in this step
                    self.preempt(self.running.pop())
                    continue
                if scheduled:  # `seq` is itself the newest: it waits
                    self.preempt(seq)
                else:  # alone with the whole pool and still too long
                    self._overflow(seq)
                break
            else:
                scheduled.append(seq)
        self.running = scheduled
        return list(scheduled)

    def _overflow(self, seq: Sequence) -> None:
        """`seq` cannot grow even with the pool to itself: it ends (the engine reports 'length')."""
        self.remove(seq)
        self.overflowed.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it for recomputation ahead of new arrivals."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of every queue and free its blocks (finish, abort, error)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.pool.free(seq.block_table)
            seq.block_table = []
        seq.status = SequenceStatus.FINISHED
