"""What a prompt chunk costs a pass, so that the prompts a pass carries beside running streams cost
at most one plain chunk however long their cached context.

A chunk of `new` tokens on `cached` tokens of context costs about `new` token-passes through the
dense layers plus attention work `new * (cached + new)` (the pass model of `engine.sim_profile`).
In units of one token through the dense layers that is::

    cost(new, cached) = new * (1 + (cached + new) / K)

where K, the model's *attention crossover*, is the context length at which a token's attention
costs as much as its dense layers. Without this, a chunk's cost grows with its position in the
prompt: on the default model at one thread the fifth 512-token chunk of a 2,560-token prompt took
1.7-3.1x the first (measured pass times), and every stream decoding beside it stalled that long
(issue 29, row 5).
"""

from __future__ import annotations

import math
from typing import Any

#: Attention's FLOPs run at about half the rate of the dense layers' GEMMs (head_dim 64, masked
#: SDPA on a CPU): the default model's profile fit (capacity/profiles/cpu-smollm2-135m.json,
#: b / c = 1,760 tokens against a FLOP crossover of 3,072) gives 0.57, a side-by-side timing of
#: one layer's linears and its attention at 512 x 2,560 gave 0.68-0.74. Lower means smaller
#: chunks at long contexts, which errs on the side of the running streams.
ATTENTION_EFFICIENCY = 0.5


def chunk_cost(new: int, cached: int, crossover: float) -> float:
    """A prompt chunk's cost in dense-layer token-passes (see the module docstring)."""
    return new * (1.0 + (cached + new) / crossover)


def largest_chunk(cached: int, allowance: float, crossover: float) -> int:
    """The most new tokens on `cached` tokens of context whose `chunk_cost` fits `allowance`
    (the positive root of n^2 + n (K + cached) - K allowance = 0), possibly 0."""
    if allowance <= 0:
        return 0
    if math.isinf(crossover):  # attention is free: the cost is the token count
        return int(allowance)
    span = crossover + cached
    n = int((math.sqrt(span * span + 4.0 * crossover * allowance) - span) / 2.0)
    while n > 0 and chunk_cost(n, cached, crossover) > allowance:  # float rounding
        n -= 1
    return n


def stream_allowance(chunk_tokens: int, crossover: float) -> float:
    """What the prompt chunks of a pass that carries decoding streams may cost together: one plain
    chunk of `chunk_tokens`, on no context."""
    return chunk_cost(chunk_tokens, 0, crossover)


def next_chunk(left: int, cached: int, chunk: int, budget: int, allowance: float, crossover: float, first: bool) -> int:
    """New tokens of a prompt's next chunk: at most `chunk`, the pass's token `budget` and the `left`
    tokens; with a finite `allowance` (streams decode in the pass) at most what fits it on `cached`
    tokens of context, yet one for the pass's `first` chunk, so a prompt always progresses. The
    scheduler (`engine.scheduler`) and the capacity simulator both size chunks with it."""
    if allowance != math.inf:
        fits = largest_chunk(cached, allowance, crossover)
        chunk = min(chunk, max(fits, 1) if first else fits)
    return max(0, min(left, chunk, budget))


def profile_crossover(profile: Any) -> float:  # noqa: ANN401 - an engine.sim_profile.Profile
    """K of a latency profile: its prefill cost per token over its cost per unit of attention work
    (b / c); infinite when attention is free."""
    cost = profile.prefill
    return cost.b / cost.c if cost.c > 0 else math.inf


def attention_crossover(loaded: Any) -> float:  # noqa: ANN401 - a LoadedModel or a sim one
    """K for a loaded model: from a sim model's latency profile (`profile_crossover`), else from the
    transformers config's shapes (dense FLOPs per token over attention FLOPs per context token,
    scaled by `ATTENTION_EFFICIENCY`). Infinite when attention is free (chunks never shrink)."""
    profile = getattr(loaded.model, "profile", None)
    if profile is not None:
        return profile_crossover(profile)
    c = loaded.config
    hidden, heads, kv_heads = int(c.hidden_size), int(c.num_attention_heads), int(c.num_key_value_heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    dense = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * int(c.intermediate_size)  # MACs
    attention = 2 * heads * head_dim  # MACs per context token: q.k and p.v
    return ATTENTION_EFFICIENCY * dense / attention
