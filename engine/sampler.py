"""Token sampling: penalties and biases, then greedy or temperature, top-k, top-p and min-p, with
per-request seeds.

Penalties (`apply_penalties`) run on the whole batch at once, as tensors, before anything else: a
[R, V] table of which tokens each penalized row has seen (prompt and output) and how often each
appeared in its output, built from the row's tokens alone (`TokenHistory`). Nothing else is
kept between steps, so a prefill worker sampling the first token and the decode worker sampling
the rest apply the same rule, and a failover or a migration rebuilds it exactly.

Drawing (`sample`) is batched too: the rows that draw are divided by their temperatures, sorted
once as one [R, V] tensor when any row filters (top-k, top-p, min-p, each row its own values; only
the k best are sorted when every row has a top-k), and each row's token is found by inverse CDF:
one uniform number u per row, the first token whose cumulative probability reaches u. Only u is
per row: a seeded request's u comes from a generator seeded by (seed, i) alone for its i-th output
token, so the draw never depends on the batch it ran in, nor on where an interrupted request is
resumed. Unseeded rows take u from the process's generator. Every other step works on each row
alone.

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


@dataclass(frozen=True)
class TokenHistory:
    """What a row's penalties read: its tokens (prompt, then output so far) and how many of the
    last ones are output."""

    ids: Sequence[int]
    num_output: int


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
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
        counts.index_put_(
            (index(row_of_output), index(output_ids)), torch.ones(len(output_ids), device=device), accumulate=True
        )
        presence = torch.tensor([params[i].presence_penalty for i in rows], device=device).unsqueeze(1)
        frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=device).unsqueeze(1)
        sub = sub - frequency * counts - presence * (counts > 0)
    if bias_ids:
        sub.index_put_((index(bias_rows), index(bias_ids)), torch.tensor(bias_values, device=device), accumulate=True)
    if banned_ids:
        sub[index(banned_rows), index(banned_ids)] = float("-inf")
    allowed = [
        (r, [t for t in params[i].allowed_token_ids if t < vocab])
        for r, i in enumerate(rows)
        if params[i].allowed_token_ids
    ]
    if allowed:
        keep = torch.zeros_like(sub, dtype=torch.bool)
        keep[index([r for r, ids in allowed for _ in ids]), index([t for _, ids in allowed for t in ids])] = True
        keep[index([r for r in range(len(rows)) if not params[rows[r]].allowed_token_ids])] = True
        sub = sub.masked_fill(~keep, float("-inf"))
    out[rows] = sub
    return out


def _uniforms(params: Sequence[SamplingParams], steps: Sequence[int]) -> torch.Tensor:
    """One U[0, 1) number per drawing row: from (seed, step) for a seeded row, else the process's."""
    values = torch.rand(len(params), dtype=torch.float64)
    for r, (p, step) in enumerate(zip(params, steps, strict=True)):
        if p.seed is not None:
            generator = torch.Generator().manual_seed(step_seed(p.seed, step))
            values[r] = torch.rand(1, generator=generator, dtype=torch.float64)[0]
    return values


def _draw(raw: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> list[int]:
    """raw [R, V] float32 CPU logits (penalties applied) of rows that draw -> R token ids."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)
    logits = raw / temperature
    vocab = logits.shape[-1]
    filtered = any(0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
    if filtered:  # most likely first: top-k, top-p and min-p are masks over sorted positions
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if max(ks) < vocab:  # every row keeps at most k: only the k best are sorted
            logits, order = torch.topk(logits, max(ks), dim=-1)
        else:
            logits, order = torch.sort(logits, dim=-1, descending=True)
        drop = torch.arange(logits.shape[-1]).unsqueeze(0) >= torch.tensor(ks).unsqueeze(1)
        if any(p.top_p < 1.0 for p in params):
            probs = torch.softmax(logits.masked_fill(drop, float("-inf")), dim=-1)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).unsqueeze(1)
            # drop a token when the mass before it already reaches top_p
            drop |= (torch.cumsum(probs, dim=-1) - probs) >= top_p
        if any(p.min_p > 0.0 for p in params):
            # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p), whatever else is dropped
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).unsqueeze(1)
            drop |= (logits - logits[:, :1]) < torch.log(min_p)
        drop[:, 0] = False  # the most likely token always stays (a top_p of 1e-300 rounds to 0)
        logits = logits.masked_fill(drop, float("-inf"))
    cdf = torch.cumsum(torch.softmax(logits, dim=-1, dtype=torch.float64), dim=-1)
    total = cdf[:, -1]
    u = _uniforms(params, steps) * total
    picks = torch.searchsorted(cdf, u.unsqueeze(1)).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    tokens = order.gather(1, picks.unsqueeze(1)).squeeze(1) if filtered else picks
    broken = ~torch.isfinite(total) | (total <= 0)  # nothing to draw from in floating point: the argmax
    if bool(broken.any()):
        tokens = torch.where(broken, torch.argmax(raw, dim=-1), tokens)
    return tokens.tolist()


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    steps: list[int],
    histories: Sequence[TokenHistory | None] | None = None,
    eos_token_ids: Collection[int] = (),
) -> list[int]:
    """logits: [B, V] on any device; one SamplingParams and output position per row -> B token ids.
    Rows with penalties, biases or min_tokens need their `histories` (see apply_penalties)."""
    if any(p.penalized for p in params):
        if histories is None:
            raise ValueError("penalized rows need their token histories")
        logits = apply_penalties(logits, params, histories, eos_token_ids)
    tokens = torch.argmax(logits, dim=-1).tolist()
    drawing = [i for i, p in enumerate(params) if not p.greedy]
    if drawing:
        raw = logits[drawing].float().cpu() if len(drawing) < len(params) else logits.float().cpu()
        for i, token in zip(
            drawing, _draw(raw, [params[i] for i in drawing], [steps[i] for i in drawing]), strict=True
        ):
            tokens[i] = token
    return tokens


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
