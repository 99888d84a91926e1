"""Loads a local Hugging Face decoder-only model with pdserve's paged attention plugged in.

Supported families are those whose modules follow the Llama layout (`model.embed_tokens`,
`model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`) with full causal attention.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from pdserve.engine import attention
from pdserve.engine.kv_cache import KVCacheShape

log = logging.getLogger(__name__)

_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
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
    fingerprint: str  # identifies weights, tokenizer and dtype: K/V from another fingerprint is refused
    eos_token_ids: frozenset[int]
    max_model_len: int

    @property
    def config(self) -> Any:
        return self.model.config

    def kv_shape(self, block_size: int) -> KVCacheShape:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return KVCacheShape(
            num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=self.model.dtype,
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


#: What the fingerprint covers in a model folder: weights, tokenizer, configs, chat template.
FINGERPRINT_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.gguf",
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "*.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "config.json",
    "generation_config.json",
)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.gguf")
_FINGERPRINT_VERSION = b"pdserve.model_fingerprint.v2"


def fingerprint_files(path: Path) -> list[Path]:
    """The files of a model folder the fingerprint covers, sorted by name."""
    found = {f for pattern in FINGERPRINT_PATTERNS for f in path.glob(pattern) if f.is_file()}
    return sorted(found, key=lambda f: f.name)


def fingerprint(path: Path, dtype: torch.dtype, model: Any = None) -> str:
    """Identifies the weights, tokenizer and dtype a worker computes K/V with: sha256 over the dtype
    and the sha256 of every weight, tokenizer and config file of the folder (each cached by file
    size and mtime, so a restart does not read the weights twice). A folder without weight files
    (a model built in memory) hashes the bytes of every tensor of `model`'s state dict instead.
    Two workers exchange K/V only when their fingerprints are equal."""
    h = hashlib.sha256(_FINGERPRINT_VERSION)
    h.update(str(dtype).encode())
    files = fingerprint_files(path)
    for f in files:
        h.update(f"{f.name}\0{cached_file_sha256(f)}\n".encode())
    if not any(f.match(p) for f in files for p in WEIGHT_PATTERNS):
        if model is None:
            raise ValueError(f"{path}: no weight files to fingerprint and no model given")
        h.update(state_dict_digest(model).encode())
    return h.hexdigest()[:32]


def state_dict_digest(model: Any) -> str:
    """sha256 over every tensor of the state dict: name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (real path, size, mtime_ns) -> sha256, this process
_DIGESTS_LOCK = threading.Lock()


def _digest_cache_file() -> Path:
    from pdserve.model_cache import cache_root

    return cache_root() / "file-sha256.json"


def cached_file_sha256(path: Path) -> str:
    """sha256 of a file, remembered (in this process and in pdserve's cache folder) under its real
    path, size and mtime: a changed file is hashed again."""
    from pdserve.engine.model_fetch import file_sha256

    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    disk = _read_digest_cache()
    entry = disk.get(key[0])
    if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        digest = str(entry["sha256"])
    else:
        digest = file_sha256(path)
        disk[key[0]] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        _write_digest_cache(disk)
    with _DIGESTS_LOCK:
        _DIGESTS[key] = digest
    return digest


def _read_digest_cache() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(_digest_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_digest_cache(data: dict[str, dict[str, Any]]) -> None:
    """Best effort, atomic (concurrent workers at worst lose each other's entry)."""
    target = _digest_cache_file()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, target)
    except OSError:
        pass


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


#: Served bf16 over fp32 on a CPU with neither a oneDNN bf16 kernel nor pdserve's native kernels
#: (AVX2 AMD EPYC, 2 cores, benchmarks/peer_vllm.py with PDSERVE_NATIVE=0; docs/performance.md):
#: what the warning below quotes.
AVX2_BF16_SERVED_RATIO = "0.17x"


def warn_if_slow_bf16(dtype: torch.dtype, device: str) -> bool:
    """Log a warning (and return True) when bf16 is asked for on a CPU that has neither a oneDNN bf16
    kernel (no AVX-512 BW/VL/DQ, AVX-512 BF16, AMX or AVX-NE-CONVERT) nor pdserve's native kernels
    (engine/native.py: bf16 weights widened in cache, on any AVX2 CPU): every bf16 GEMM then runs
    converted in plain AVX2 code, slower than fp32."""
    from pdserve.engine.fast_forward import mkldnn_linear_available
    from pdserve.engine.native import native_unavailable

    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or mkldnn_linear_available(torch.bfloat16):
        return False
    why_not_native = native_unavailable(dtype, torch.device(device))
    if why_not_native is None:
        return False
    log.warning(
        "bfloat16 on this CPU (%s, no native bf16 kernel; pdserve's own kernels: %s) is slower than "
        "float32: served output tok/s measured %s of float32 on an AVX2 CPU. Use --dtype float32 (or "
        "auto) here; bf16 pays on CPUs with AVX-512 BF16 or AMX, or with pdserve's native kernels.",
        torch.backends.cpu.get_cpu_capability(),
        why_not_native,
        AVX2_BF16_SERVED_RATIO,
    )
    return True


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """Load weights and tokenizer from a local folder; attention runs over pdserve's paged cache."""
    path = Path(path)
    config = check_supported(path)
    warn_if_slow_bf16(dtype, device)
    attention.register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION)
    model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]  # transformers types .to oddly
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        fingerprint=fingerprint(path, dtype, model),
        eos_token_ids=_eos_ids(path, config, tokenizer),
        max_model_len=int(getattr(config, "max_position_embeddings", 2048)),
    )
