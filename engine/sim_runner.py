"""The simulated engine: a ModelRunner look-alike that waits a profile's predicted pass time.

Everything around it stays real (worker processes, scheduler, block pool, prefix cache, admission,
preemption, KV hand-off, router, streaming); only the forward pass is replaced. `SimRunner.forward`
takes the same packed batch as `ModelRunner.forward`, sleeps until ``start + profile.pass_s(...) /
speedup`` and returns logits that make the sampler pick a deterministic pseudo token (an ordinary
word token chosen from the last input token and the position), whatever the sampling parameters.

No weights are loaded: a sim worker reads the model folder's config.json and tokenizer only (so
prompts are cut and text rendered as with the real model). Its KV cache is a placeholder of one
layer, one head, head_dim 1 in float16 (4 bytes per token): the blocks, the pool, the prefix cache
and every KV frame are real, and those placeholder bytes really move on the hand-off, while the
hand-off takes the profile's modelled time for ``kv_bytes_per_token`` bytes per token
(`kv_transfer.modelled`). The block count comes from the profile's KV capacity, as do the engine
limits (max_num_seqs, max_batched_tokens).

Invariants: CPU use per pass is a few small tensors (logits are [N, W] with W the largest pseudo
token id + 1, far below the vocabulary); the same inputs always give the same tokens; the wait is
measured from the start of `forward`, so the runner's own Python time is inside the modelled time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.model_runner import StepInput
from pdserve.engine.sim_profile import Profile, load_profile, split_pass
from pdserve.settings import ModelSection

PLACEHOLDER_DTYPE = torch.float16
MAX_PSEUDO_TOKENS = 512
_MIX = 1_000_003


@dataclass(frozen=True)
class SimModel:
    """Stands where the transformers model would: the config, the profile and the speedup."""

    config: Any  # the model folder's transformers config (vocab size, context length)
    profile: Profile
    speedup: float
    pseudo_tokens: tuple[int, ...]  # ordinary word tokens the runner emits

    dtype = PLACEHOLDER_DTYPE


@dataclass(frozen=True)
class SimLoadedModel(LoadedModel):
    """A LoadedModel without weights whose KV geometry is the 4-byte-per-token placeholder."""

    def kv_shape(self, block_size: int) -> KVCacheShape:
        return KVCacheShape(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size, dtype=PLACEHOLDER_DTYPE)


def pseudo_token_ids(tokenizer: Any, eos_ids: frozenset[int], vocab_size: int) -> tuple[int, ...]:
    """Word tokens (a leading-space marker then 3+ letters) among the first ids of the vocabulary,
    lowest ids first, so the logits stay narrow. Falls back to any non-special id."""
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(eos_ids)
    limit = min(vocab_size, 8192)
    pieces = tokenizer.convert_ids_to_tokens(list(range(limit)))
    words = [
        i
        for i, p in enumerate(pieces)
        if i not in special and isinstance(p, str) and p[:1] in ("Ġ", "▁") and p[1:].isalpha() and len(p) >= 4
    ]
    if not words:
        words = [i for i in range(limit) if i not in special]
    return tuple(words[:MAX_PSEUDO_TOKENS])


def _eos_ids(config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for value in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def load_sim_model(path: str | Path, profile: Profile, speedup: float = 1.0) -> SimLoadedModel:
    """Config and tokenizer of the model folder `path`, timed by `profile` (no weights)."""
    from transformers import AutoConfig, AutoTokenizer

    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: the sim engine needs the model's config and tokenizer")
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = _eos_ids(config, tokenizer)
    model = SimModel(config, profile, speedup, pseudo_token_ids(tokenizer, eos, config.vocab_size))
    digest = hashlib.sha256(f"sim|{profile.name}|{profile.model_name}|{config.vocab_size}".encode()).hexdigest()
    max_len = min(profile.max_model_len, int(getattr(config, "max_position_embeddings", profile.max_model_len)))
    return SimLoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        fingerprint=f"sim-{digest[:28]}",
        eos_token_ids=eos,
        max_model_len=max_len,
    )


class SimRunner:
    """Same interface as `engine.model_runner.ModelRunner`; waits instead of computing."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache: KVCache,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(loaded.model, SimModel):
            raise TypeError("SimRunner needs a model loaded by load_sim_model")
        self.full_logits: dict[int, torch.Tensor] = {}  # never filled: no prompt log-probabilities here
        self.loaded = loaded
        self.sim: SimModel = loaded.model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape.block_size
        self.num_forward_passes = 0
        self.num_prefill_tokens = 0
        self.modelled_seconds = 0.0  # profile time of every pass so far
        self._sleep, self._clock = sleep, clock
        self._width = max(self.sim.pseudo_tokens) + 1

    def pass_seconds(self, items: list[StepInput]) -> float:
        """Profile time of one pass over `items` (decode items: one new token on a cached prefix)."""
        return self.sim.profile.pass_s(*split_pass((len(i.token_ids), i.num_cached) for i in items))

    def next_token(self, item: StepInput) -> int:
        """The pseudo token after `item`'s last new token (a function of that token and its position)."""
        position = item.num_cached + len(item.token_ids)
        words = self.sim.pseudo_tokens
        return words[(item.token_ids[-1] * _MIX + position) % len(words)]

    def forward(self, items: list[StepInput], on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Wait the pass's modelled time / speedup; return float32 logits [len(items), W] whose
        argmax (and only finite entry) is each item's pseudo token."""
        start = self._clock()
        if not items or any(not i.token_ids for i in items):
            raise ValueError("every sequence in a forward pass needs at least one new token")
        for item in items:
            if len(item.block_table) * self.block_size < item.num_cached + len(item.token_ids):
                raise ValueError("block table too short for the tokens of this pass")
        seconds = self.pass_seconds(items)
        logits = torch.full((len(items), self._width), float("-inf"))
        logits[torch.arange(len(items)), torch.tensor([self.next_token(i) for i in items])] = 0.0
        self.modelled_seconds += seconds
        self.num_forward_passes += 1
        self.num_prefill_tokens += sum(len(i.token_ids) for i in items if not (len(i.token_ids) == 1 and i.num_cached))
        remaining = start + seconds / self.sim.speedup - self._clock()
        if remaining > 0:
            self._sleep(remaining)
        if on_layer_done is not None:
            for layer in range(self.kv_cache.shape.num_layers):
                on_layer_done(layer)
        return logits


# ----- worker wiring: the flags both worker roles take, and the load step ------------------------
def load_sim_worker(model: ModelSection, config: EngineConfig) -> tuple[EngineConfig, LoadedModel]:
    """For `--engine sim`: the profile's engine limits applied to `config`, and the sim model.
    One torch thread: a sim worker only waits."""
    from pdserve.engine.model_fetch import resolve_model

    if not model.profile:
        raise ValueError("--engine sim needs --profile FILE")
    torch.set_num_threads(1)
    profile = load_profile(model.profile)
    limits = profile.engine
    config = replace(
        config,
        block_size=limits.block_size,
        num_blocks=limits.num_blocks,
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_batched_tokens,
    )
    return config, load_sim_model(resolve_model(model.path), profile, model.speedup)
