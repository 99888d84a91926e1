"""Which runner does a worker's forward passes: the model (`ModelRunner`) or the profile's timing
model (`SimRunner`, for a model loaded by `engine.sim_runner.load_sim_model`). The one place that
chooses; engines and workers call `build_runner` instead of naming a runner class."""

from __future__ import annotations

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sim_runner import SimModel, SimRunner

Runner = ModelRunner | SimRunner


def build_runner(
    loaded: LoadedModel,
    kv_cache: KVCache,
    compile: bool = False,  # noqa: A002
    deterministic: bool = False,
    kernel_table: str | None = None,
) -> Runner:
    """A SimRunner for a sim model, else a ModelRunner (`compile`: its compiled decode layer;
    `deterministic` and `kernel_table`: see EngineConfig)."""
    if isinstance(loaded.model, SimModel):
        return SimRunner(loaded, kv_cache)
    return ModelRunner(loaded, kv_cache, compile=compile, deterministic=deterministic, kernel_table=kernel_table)
