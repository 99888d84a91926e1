from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams()] * 2, [0, 0]) == [1, 0]


def _support(logits: torch.Tensor, params: SamplingParams, draws: int = 400) -> set[int]:
    """Tokens drawn for logits [V] over `draws` seeded steps, each drawn in a batch of one."""
    return {sample(logits.unsqueeze(0), [params], [s])[0] for s in range(draws)}


def test_top_k_keeps_k_best() -> None:
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert _support(logits, SamplingParams(temperature=1.0, top_k=2, seed=1)) == {1, 2}
    assert _support(logits, SamplingParams(temperature=1.0, seed=1)) == {0, 1, 2, 3}


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert _support(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=2)) == {0, 1}
    assert _support(logits, SamplingParams(temperature=1.0, top_p=0.1, seed=2)) == {0}


def test_min_p_drops_tokens_below_a_share_of_the_most_likely() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # 0.15 / 0.5 = 0.3 >= 0.25 stays; 0.05 / 0.5 = 0.1 goes
    assert _support(logits, SamplingParams(temperature=1.0, min_p=0.25, seed=3)) == {0, 1, 2}


def test_each_row_filters_with_its_own_values() -> None:
    """One batch, one sort: rows with different top-k, top-p, min-p and temperature keep to their own."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().repeat(4, 1)
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.65),
        SamplingParams(temperature=1.0, min_p=0.4),
        SamplingParams(temperature=1.0),
    ]
    seen: list[set[int]] = [set() for _ in params]
    for step in range(400):
        for row, token in enumerate(sample(logits, params, [step] * 4)):
            seen[row].add(token)
    assert seen == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]


def test_seeded_draw_independent_of_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    p = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)
    alone = sample(logits[3:4], [p], [5])[0]
    others = [SamplingParams(temperature=0.7, seed=i, top_k=i) for i in range(8)]
    others[3], others[5] = p, SamplingParams()  # and a greedy row beside it
    batched = sample(logits, others, [5] * 8)
    assert batched[3] == alone and batched[5] == int(logits[5].argmax())
    # and a different step or seed gives a different stream
    draws = {sample(logits[3:4], [p], [s])[0] for s in range(30)}
    assert len(draws) > 3


def test_seeded_sampling_follows_distribution() -> None:
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    p = SamplingParams(temperature=1.0, seed=99)
    drawn = sample(logits.repeat(3000, 1), [p] * 3000, list(range(3000)))
    counts = torch.bincount(torch.tensor(drawn), minlength=3)
    assert abs(counts[0].item() / 3000 - 0.7) < 0.04 and abs(counts[2].item() / 3000 - 0.1) < 0.03
    unseeded = torch.bincount(
        torch.tensor(sample(logits.repeat(3000, 1), [SamplingParams(temperature=1.0)] * 3000, [0] * 3000)), minlength=3
    )
    assert abs(unseeded[0].item() / 3000 - 0.7) < 0.04


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": tuple("abcdefghijklmnopq")}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_bad_params_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
