"""Synthetic workloads: prompt/output length distributions and prompts cut from the built-in corpus.

A length spec is ``"128"`` (fixed), ``"64:512"`` (uniform integers, both ends included) or a
histogram file (JSON ``[[length, weight], ...]`` or ``{"length": weight}``; CSV ``length,weight``
lines, an optional header). Prompts are token ids cut from the corpus at a random offset (wrapping
around), so every prompt has exactly the requested number of tokens.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.capacity.corpus import CORPUS


@dataclass(frozen=True)
class LengthDist:
    """A distribution over positive token counts: ``values`` with probabilities ``weights``,
    or uniform on [low, high] when ``values`` is empty."""

    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    low: int = 0
    high: int = 0

    def __post_init__(self) -> None:
        if self.values:
            if len(self.values) != len(self.weights) or any(v < 1 for v in self.values):
                raise ValueError("histogram needs lengths >= 1, one weight each")
            if any(w < 0 for w in self.weights) or not sum(self.weights) > 0:
                raise ValueError("histogram weights must be >= 0 with a positive sum")
        elif not 1 <= self.low <= self.high:
            raise ValueError(f"uniform lengths need 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """``"128"`` or ``"64:512"``."""
        low, sep, high = spec.partition(":")
        try:
            lo, hi = int(low), int(high if sep else low)
        except ValueError:
            raise ValueError(f"length must look like 128 or 64:512, got {spec!r}") from None
        return cls(low=lo, high=hi) if sep else cls(values=(lo,), weights=(1.0,))

    @classmethod
    def from_file(cls, path: str | Path) -> LengthDist:
        """A histogram from a JSON or CSV file of (length, weight)."""
        text = Path(path).read_text()
        if str(path).endswith(".json"):
            doc = json.loads(text)
            pairs = list(doc.items()) if isinstance(doc, dict) else [tuple(p) for p in doc]
        else:
            rows = [r for r in csv.reader(text.splitlines()) if r and r[0].strip()]
            pairs = [tuple(r[:2]) for r in rows if r[0].strip().isdigit()]
        return cls(values=tuple(int(a) for a, _ in pairs), weights=tuple(float(b) for _, b in pairs))

    @property
    def mean(self) -> float:
        if not self.values:
            return (self.low + self.high) / 2
        return float(np.dot(self.values, self.weights) / sum(self.weights))

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if not self.values:
            return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]
        p = np.asarray(self.weights, dtype=float) / sum(self.weights)
        return [int(x) for x in rng.choice(np.asarray(self.values), size=n, p=p)]

    def to_json(self) -> dict[str, Any]:
        if self.values:
            return {"histogram": [[v, w] for v, w in zip(self.values, self.weights, strict=True)]}
        return {"uniform": [self.low, self.high]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> LengthDist:
        if "histogram" in doc:
            pairs = doc["histogram"]
            return cls(values=tuple(int(a) for a, _ in pairs), weights=tuple(float(b) for _, b in pairs))
        low, high = doc["uniform"]
        return cls(low=int(low), high=int(high))


def length_dist(spec: str | None, hist_file: str | None, default: str) -> LengthDist:
    """The distribution named by a CLI pair (``--input-len`` / ``--input-hist``); the file wins."""
    if hist_file:
        return LengthDist.from_file(hist_file)
    return LengthDist.parse(spec or default)


def corpus_token_ids(tokenizer: Any) -> list[int]:
    """The corpus as token ids (no special tokens)."""
    return list(tokenizer(CORPUS, add_special_tokens=False)["input_ids"])


def cut_prompts(corpus_ids: Sequence[int], lengths: Sequence[int], rng: np.random.Generator) -> list[list[int]]:
    """One prompt per length: consecutive corpus tokens from a random offset, wrapping around."""
    if not corpus_ids:
        raise ValueError("corpus is empty")
    n = len(corpus_ids)
    prompts = []
    for length in lengths:
        start = int(rng.integers(n))
        prompts.append([corpus_ids[(start + i) % n] for i in range(length)])
    return prompts
