"""Arrival processes checked statistically (fixed seeds) and workload length distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.capacity.arrivals import arrival_times, parse_rate
from pdserve.capacity.workload import LengthDist, cut_prompts, length_dist


def gaps(times: list[float]) -> np.ndarray:
    return np.diff([0.0, *times])


def test_poisson_mean_and_cv() -> None:
    g = gaps(arrival_times(20000, rate=4.0, burstiness=1.0, seed=7))
    assert g.mean() == pytest.approx(0.25, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_cv(burstiness: float) -> None:
    g = gaps(arrival_times(20000, rate=2.0, burstiness=burstiness, seed=11))
    assert g.mean() == pytest.approx(0.5, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_seed_and_validation() -> None:
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(5, 1.0, seed=3) == arrival_times(5, 1.0, seed=3)
    assert arrival_times(5, 1.0, seed=3) != arrival_times(5, 1.0, seed=4)
    assert parse_rate("inf") == math.inf
    for bad in ("0", "-1"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0)


def test_length_specs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    assert LengthDist.parse("128").sample(rng, 3) == [128, 128, 128]
    uniform = LengthDist.parse("64:66").sample(rng, 300)
    assert set(uniform) == {64, 65, 66}
    (tmp_path / "h.json").write_text("[[1024, 1], [32, 3]]")
    (tmp_path / "h.csv").write_text("length,weight\n1024,1\n32,3\n")
    for name in ("h.json", "h.csv"):
        dist = length_dist("7", str(tmp_path / name), "1")
        assert dist.mean == pytest.approx(280)
        draws = dist.sample(rng, 4000)
        assert set(draws) == {1024, 32} and draws.count(32) / 4000 == pytest.approx(0.75, abs=0.03)
        assert LengthDist.from_json(dist.to_json()) == dist
    for bad in ("0", "5:3", "x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_cut_prompts_exact_lengths_wrapping() -> None:
    prompts = cut_prompts([1, 2, 3], [2, 7], np.random.default_rng(0))
    assert [len(p) for p in prompts] == [2, 7]
    assert all(t in (1, 2, 3) for p in prompts for t in p)
