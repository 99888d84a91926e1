"""`--engine {model,sim} --profile FILE --speedup K`: the launcher flags that choose what a worker's
forward pass is (the model, or the simulated engine of `engine.sim_runner`), shared by `pdserve
serve`, `serve --ray`, `bench` and `sweep`. Pure argparse and paths: no torch import here."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.settings import ENGINE_SETTINGS, ModelSection, add_section_flags


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """--engine, --profile, --speedup, as every worker takes them (`model` section's settings); bench
    and sweep also scale their rates and times by --speedup, so results read in profile time."""
    group = parser.add_argument_group(
        "simulated engine (docs/capacity.md)",
        "bench and sweep divide their rates and times by --speedup too, so results read in profile time",
    )
    add_section_flags(group, ModelSection, ENGINE_SETTINGS)


def sim_worker_args(profile: str | None, speedup: float = 1.0) -> tuple[str, ...]:
    """Worker flags that make a worker run the simulated engine; ValueError for a bad profile path
    or speedup."""
    if not profile:
        raise ValueError("--engine sim needs --profile FILE")
    if not Path(profile).is_file():
        raise ValueError(f"--profile {profile}: no such file")
    if not speedup > 0:
        raise ValueError(f"--speedup must be > 0, got {speedup}")
    return ("--engine", "sim", "--profile", str(Path(profile).resolve()), "--speedup", repr(float(speedup)))


def engine_worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The worker flags for parsed launcher flags (empty for the model engine)."""
    if args.engine == "model":
        if args.profile or args.speedup != 1.0:
            raise ValueError("--profile and --speedup need --engine sim")
        return ()
    return sim_worker_args(args.profile, args.speedup)
