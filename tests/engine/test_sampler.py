from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import _filter_top_k_top_p, sample, sample_one
from pdserve.engine.sampling_params import SamplingParams


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams()] * 2, [0, 0]) == [1, 0]


def test_top_k_keeps_k_best() -> None:
    out = _filter_top_k_top_p(torch.tensor([1.0, 4.0, 3.0, 2.0]), top_k=2, top_p=1.0)
    assert torch.isfinite(out).tolist() == [False, True, True, False]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = _filter_top_k_top_p(probs.log(), top_k=0, top_p=0.75)
    assert torch.isfinite(out).tolist() == [True, True, False, False]
    out = _filter_top_k_top_p(probs.log(), top_k=0, top_p=0.1)
    assert torch.isfinite(out).tolist() == [True, False, False, False]


def test_seeded_draw_independent_of_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = sample_one(logits[3], p, step=5)
    others = [SamplingParams(temperature=0.7, seed=i) for i in range(8)]
    others[3] = p
    batched = sample(logits, others, [5] * 8)
    assert batched[3] == alone
    # and a different step or seed gives a different stream
    draws = {sample_one(logits[3], p, step=s) for s in range(30)}
    assert len(draws) > 3


def test_seeded_sampling_follows_distribution() -> None:
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    p = SamplingParams(temperature=1.0, seed=99)
    counts = torch.bincount(torch.tensor([sample_one(logits, p, s) for s in range(3000)]), minlength=3)
    assert abs(counts[0].item() / 3000 - 0.7) < 0.04 and abs(counts[2].item() / 3000 - 0.1) < 0.03


@pytest.mark.parametrize(
    "kwargs,field",
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
     ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed"), ({"stop": ("",)}, "stop"),
     ({"stop": tuple("abcdefghijklmnopq")}, "stop"), ({"stop_token_ids": (-1,)}, "stop_token_ids")],
)
def test_bad_params_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
