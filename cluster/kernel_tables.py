"""The launchers' side of one linear-kernel table per deployment (engine/kernel_table.py).

`with_kernel_table` gives a deployment config whose `model.kernel_table` holds the table every
worker then follows, timed once per machine, model shape, dtype and thread count (cached), so that
prefill and decode workers, and a restarted or migrated-to worker, choose the same kernel for the
same row count and compute the same sums. Where no table applies (the sim engine, a CUDA device,
deterministic mode, which runs the native kernels at every row count, or one kernel pinned by
PDSERVE_LINEAR) the config comes back unchanged. Timing that fails is logged and each worker times
its own (`pdserve status` says which).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from pathlib import Path

from pdserve.cluster.deploy_config import DeploymentConfig
from pdserve.engine.kernel_table import deployment_table
from pdserve.model_cache import default_model_dir

log = logging.getLogger(__name__)

_PINNED = ("native", "plain", "packed")


def _needs_table(config: DeploymentConfig) -> bool:
    model = config.model
    return (
        model.kernel_table is None
        and model.engine == "model"
        and not model.deterministic
        and not model.device.startswith("cuda")
        and os.environ.get("PDSERVE_LINEAR", "auto").lower() not in _PINNED
    )


def with_kernel_table(config: DeploymentConfig, threads: int, env: dict[str, str] | None = None) -> DeploymentConfig:
    """`config` with the deployment's kernel table (JSON) in `model.kernel_table`, timed at `threads`
    (the decode workers' torch threads), or unchanged where none applies or timing failed."""
    if not _needs_table(config):
        return config
    model_dir = Path(config.model.path) if config.model.path else default_model_dir()
    dtype = config.model.dtype if config.model.dtype != "auto" else "float32"  # "auto" is float32 on a CPU
    if not (model_dir / "config.json").is_file():
        return config  # the worker reports the missing model itself
    try:
        table = deployment_table(model_dir, dtype, threads, env=env)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, subprocess.TimeoutExpired) as exc:
        # KeyError/TypeError: a config.json without the Llama-family fields (that model runs transformers' modules)
        log.warning("no deployment kernel table (%s): each worker times its own", exc)
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model, kernel_table=table.to_json()))
