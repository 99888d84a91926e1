"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

A seeded request draws its i-th output token from a generator seeded by (seed, i) alone, so the
draw never depends on the batch it ran in, nor on where an interrupted request is resumed.
Unseeded requests draw from the process's generator.

Device: greedy rows take their argmax where the logits are (one small copy back); rows that draw
are moved to the CPU first and draw from CPU generators, so a seeded request yields the same
tokens whichever device computed its logits (given the same logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15


def step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for output position `step` of a request seeded with `seed`."""
    return (seed * _SEED_MIX + step * 0xBF58476D1CE4E5B9 + 1) % (2**63)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] float32 -> same shape with filtered entries at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Draw one token id from logits [V] for output position `step`."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = _filter_top_k_top_p(logits.float().cpu() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(step_seed(params.seed, step))
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits: [B, V] on any device; one SamplingParams and output position per row -> B token ids."""
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    if logits.device.type != "cpu":
        logits = logits.float().cpu()  # one copy for the whole batch, not one per row
    return [sample_one(logits[i], p, s) for i, (p, s) in enumerate(zip(params, steps, strict=True))]


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability (None: the first prompt token) and the `top` most likely tokens
    at its position, most likely first. Values are log_softmax of the fp32 logits, taken before
    temperature, top-k and top-p (what the model assigns, whatever the sampling settings)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """logits [N, V] (row i predicts token_ids[i]) -> one TokenLogprob per row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    if num_top:
        values, ids = torch.topk(logprobs, num_top, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops, strict=True)]
