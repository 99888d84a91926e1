"""pdserve's shared compute package: what both worker roles run.

Role: load a decoder-only Hugging Face model, hold its K/V in a paged block pool, run prefill and
batched decode steps over that pool, sample, stop and detokenize. Both `prefill_worker` and
`decode_worker` import this package; it imports neither of them, nor `router`, nor `ray`.

Invariants:
- K/V live only in `KVCache.kv`, one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim];
  a sequence owns the blocks listed in its block table and nothing else.
- Every block handed out by `BlockPool` is returned by whoever ends the sequence (finish, abort,
  error, preemption); `BlockPool.assert_all_free()` checks it when idle.
- The model's weights come from transformers; the forward is `engine.fast_forward` for the Llama
  family (transformers' own modules otherwise), and attention over the paged cache is ours
  (`engine.attention`).
"""

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError
from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams

__all__ = ["BlockPool", "EngineConfig", "NoFreeBlocksError", "SamplingParams"]
