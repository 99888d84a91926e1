"""The autoscaler's planner, built in capacity and handed to cluster's autoscaler by the CLI."""

from __future__ import annotations

import pickle
from pathlib import Path

from sim_profiles import make_profile

from pdserve.capacity.splits import PlannerSplits, planner_factory
from pdserve.cluster.autoscaler import autoscaler_config
from pdserve.cluster.elastic_cli import AutoscaleOptions


def _profile(tmp_path: Path) -> str:
    profile = make_profile(
        prefill=(0.005, 2e-5, 0.0),
        decode=(0.01, 0.004, 0.0),
        transfer_s=0.001,
        max_num_seqs=8,
        kv_capacity_tokens=16 * 1024,
    )
    profile.save(tmp_path / "profile.json")
    return str(tmp_path / "profile.json")


def test_no_profile_no_planner() -> None:
    assert planner_factory(None) is None and planner_factory("") is None


def test_the_factory_survives_pickling_and_plans_every_split(tmp_path: Path) -> None:
    """Ray ships the factory to the controller's node: it pickles by reference and builds there."""
    factory = planner_factory(_profile(tmp_path), speedup=1.0)
    assert factory is not None
    shipped = pickle.loads(pickle.dumps(factory))
    options = AutoscaleOptions({"ttft_ms": 2000.0, "tpot_ms": 100.0})
    planner = shipped(autoscaler_config(options))
    assert isinstance(planner, PlannerSplits)
    from pdserve.cluster.autoscaler import Mix

    rates = planner(Mix(32, 40, 6.0), 3)
    assert sorted(rates) == [1, 2] and min(rates.values()) >= 0 and max(rates.values()) > 0
    # decode-heavy output on this profile: the planner prefers fewer prefill workers
    assert rates[1] >= rates[2]


def test_a_sped_up_sim_cluster_plans_in_profile_time(tmp_path: Path) -> None:
    """With --speedup 4 the loop's SLOs are a quarter on the wall clock; the planner's are back in
    profile time (the profile's pass times are), and its rates are on the wall clock again."""
    options = AutoscaleOptions({"ttft_ms": 500.0, "tpot_ms": 40.0})
    factory = planner_factory(_profile(tmp_path), speedup=4.0)
    assert factory is not None
    planner = factory(autoscaler_config(options, speedup=4.0))
    assert dict(planner._slos.per_request) == {"ttft": 0.5, "tpot": 0.04}
