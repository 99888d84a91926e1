"""Request send times: Poisson or gamma arrivals at a rate, or all at once (vLLM's `get_request`).

Inter-arrival gaps are gamma(shape=burstiness, scale=1 / (rate * burstiness)): mean 1 / rate and
coefficient of variation 1 / sqrt(burstiness). burstiness 1 is a Poisson process; < 1 is burstier,
> 1 more regular. rate = inf sends everything at t = 0.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds (non-decreasing, the first one after one gap) for ``num`` requests."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    return [float(t) for t in np.cumsum(gaps)]


def parse_rate(text: str) -> float:
    """``"2.5"`` -> 2.5, ``"inf"`` -> inf; ValueError for anything not > 0."""
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"rate must be > 0 or inf, got {text!r}")
    return rate
