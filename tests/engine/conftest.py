"""Fixtures of the engine tests (on top of tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.model_loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir: Path) -> LoadedModel:
    """One tiny random Llama (for tests whose subject is scheduling, not the model family)."""
    return load_model(tiny_llama_dir)
