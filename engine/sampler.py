"""Token sampling: penalties and biases, then greedy or temperature, top-k, top-p and min-p, with
per-request seeds.

Penalties (`apply_penalties`) run on the whole batch at once, as tensors, before anything else: a
[R, V] table of which tokens each penalized row has seen (prompt and output) and how often each
appeared in its output, built from the row's tokens alone (`TokenHistory`). Nothing else is
kept between steps, so a prefill worker sampling the first token and the decode worker sampling
the rest apply the same rule, and a failover or a migration rebuilds it exactly.

A seeded request draws its i-th output token from a generator seeded by (seed, i) alone, so the
draw never depends on the batch it ran in, nor on where an interrupted request is resumed.
Unseeded requests draw from the process's generator.

Device: greedy rows take their argmax where the logits are (one small copy back); rows that draw
are moved to the CPU first and draw from CPU generators, so a seeded request yields the same
tokens whichever device computed its logits (given the same logits).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
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
        drop[0] = False  # a top_p below float32's range (1e-300 rounds to 0) must not drop them all
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


@dataclass(frozen=True)
class TokenHistory:
    """What a row's penalties read: its tokens (prompt, then output so far) and how many of the
    last ones are output."""

    ids: Sequence[int]
    num_output: int


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[TokenHistory | None], eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """logits [B, V] -> a new [B, V] tensor with each penalized row's repetition, presence and
    frequency penalties, logit bias, bad words, min_tokens mask and allowed tokens applied (vLLM's
    semantics); rows without any are unchanged. `histories[i]` must be given for every penalized row."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    out = logits.float().clone()
    sub = out[rows]  # [R, V]
    row_of_seen, seen_ids, row_of_output, output_ids = [], [], [], []
    bias_rows, bias_ids, bias_values, banned_rows, banned_ids = [], [], [], [], []
    for r, i in enumerate(rows):
        p, history = params[i], histories[i]
        assert history is not None, "a penalized row needs its token history"
        ids = [t for t in history.ids if 0 <= t < vocab]
        outputs = [t for t in history.ids[len(history.ids) - history.num_output :] if 0 <= t < vocab]
        if p.repetition_penalty != 1.0:
            row_of_seen += [r] * len(ids)
            seen_ids += ids
        if p.presence_penalty or p.frequency_penalty:
            row_of_output += [r] * len(outputs)
            output_ids += outputs
        for token, bias in p.logit_bias:
            if token < vocab:
                bias_rows.append(r)
                bias_ids.append(token)
                bias_values.append(bias)
        for word in p.bad_words_ids:
            if len(word) == 1 or tuple(outputs[len(outputs) - len(word) + 1 :]) == word[:-1]:
                if word[-1] < vocab:
                    banned_rows.append(r)
                    banned_ids.append(word[-1])
        if history.num_output < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            stops = {t for t in stops if t < vocab}
            banned_rows += [r] * len(stops)
            banned_ids += sorted(stops)

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    if seen_ids:
        seen = torch.zeros_like(sub, dtype=torch.bool)
        seen[index(row_of_seen), index(seen_ids)] = True
        penalty = torch.tensor([params[i].repetition_penalty for i in rows], device=device).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if output_ids:
        counts = torch.zeros_like(sub)
        counts.index_put_((index(row_of_output), index(output_ids)), torch.ones(len(output_ids), device=device),
                          accumulate=True)
        presence = torch.tensor([params[i].presence_penalty for i in rows], device=device).unsqueeze(1)
        frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=device).unsqueeze(1)
        sub = sub - frequency * counts - presence * (counts > 0)
    if bias_ids:
        sub.index_put_((index(bias_rows), index(bias_ids)), torch.tensor(bias_values, device=device),
                       accumulate=True)
    if banned_ids:
        sub[index(banned_rows), index(banned_ids)] = float("-inf")
    allowed = [(r, [t for t in params[i].allowed_token_ids if t < vocab]) for r, i in enumerate(rows)
               if params[i].allowed_token_ids]
    if allowed:
        keep = torch.zeros_like(sub, dtype=torch.bool)
        keep[index([r for r, ids in allowed for _ in ids]), index([t for _, ids in allowed for t in ids])] = True
        keep[index([r for r in range(len(rows)) if not params[rows[r]].allowed_token_ids])] = True
        sub = sub.masked_fill(~keep, float("-inf"))
    out[rows] = sub
    return out


def _filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits [V] (after temperature) -> tokens whose probability is below min_p times the most
    likely token's at -inf."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Draw one token id from logits [V] (penalties already applied) for output position `step`."""
    if params.greedy:
        return int(torch.argmax(logits))
    raw = logits.float().cpu()
    logits = _filter_top_k_top_p(raw / params.temperature, params.top_k, params.top_p)
    if params.min_p > 0.0:
        logits = _filter_min_p(logits, params.min_p)
    probs = torch.softmax(logits, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return int(torch.argmax(raw))  # nothing left to draw from in floating point: the argmax
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(step_seed(params.seed, step))
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           histories: Sequence[TokenHistory | None] | None = None, eos_token_ids: Collection[int] = ()) -> list[int]:
    """logits: [B, V] on any device; one SamplingParams and output position per row -> B token ids.
    Rows with penalties, biases or min_tokens need their `histories` (see apply_penalties)."""
    if any(p.penalized for p in params):
        if histories is None:
            raise ValueError("penalized rows need their token histories")
        logits = apply_penalties(logits, params, histories, eos_token_ids)
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
