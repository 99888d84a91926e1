"""Loads a local Hugging Face decoder-only model with pdserve's paged attention plugged in.

Supported families are those whose modules follow the Llama layout (`model.embed_tokens`,
`model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`) with full causal attention.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from engine import attention
from engine.kv_cache import KVCacheShape

_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
SUPPORTED_ARCHITECTURES = frozenset(_ARCH_BY_MODEL_TYPE.values())


class UnsupportedModelError(ValueError):
    """The folder holds a model pdserve cannot run."""


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # a transformers *ForCausalLM in eval mode
    tokenizer: Any
    path: Path
    fingerprint: str  # identifies weights + dtype: K/V from another fingerprint is refused
    eos_token_ids: frozenset[int]
    max_model_len: int

    @property
    def config(self) -> Any:
        return self.model.config

    def kv_shape(self, block_size: int) -> KVCacheShape:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return KVCacheShape(
            num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=head_dim,
            block_size=block_size, dtype=self.model.dtype,
        )


def check_supported(path: Path) -> Any:
    """Read config.json and raise a clear error for anything we cannot serve."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: pass a local Hugging Face model folder")
    config = AutoConfig.from_pretrained(path)
    archs = set(getattr(config, "architectures", None) or [])
    if not archs and config.model_type in _ARCH_BY_MODEL_TYPE:  # configs written without the field
        archs = {_ARCH_BY_MODEL_TYPE[config.model_type]}
    if not archs & SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {sorted(archs) or 'unknown'} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError(f"{path}: sliding-window attention is not supported")
    return config


def fingerprint(model: Any) -> str:
    """sha256 over the config, the dtype and a sample of the weights (norms and some embeddings)."""
    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(model.dtype).encode())
    for name, tensor in model.state_dict().items():
        if "norm" in name or name.endswith("embed_tokens.weight"):
            h.update(name.encode())
            h.update(tensor.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def _eos_ids(path: Path, config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    sources: list[Any] = [config.eos_token_id, tokenizer.eos_token_id]
    if (path / "generation_config.json").is_file():
        sources.append(GenerationConfig.from_pretrained(path).eos_token_id)
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """Load weights and tokenizer from a local folder; attention runs over pdserve's paged cache."""
    path = Path(path)
    config = check_supported(path)
    attention.register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION)
    model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]  # transformers types .to oddly
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(
        model=model, tokenizer=tokenizer, path=path, fingerprint=fingerprint(model),
        eos_token_ids=_eos_ids(path, config, tokenizer),
        max_model_len=int(getattr(config, "max_position_embeddings", 2048)),
    )
