"""Where pdserve keeps the default model (torch-free, so the router finds its tokenizer too)."""

from __future__ import annotations

import os
from pathlib import Path

#: The default model: SmolLM2-135M-Instruct, converted once from its GGUF file (engine/model_fetch.py).
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """Root of pdserve's cache: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def default_model_dir() -> Path:
    """Folder where the converted default model lives."""
    return cache_root() / "models" / MODEL_NAME
