"""Placement defaults and the restart wait, as settings: `auto` resolves to spread on a multi-node
cluster and pack on one node; `pdserve status` warns when a pool sits on one node of several; the
router waits for restarting workers only where something restarts them (Ray actors with restarts)."""

from __future__ import annotations

import pytest

from pdserve.cluster.client import placement_warnings
from pdserve.cluster.deploy_config import DeploymentConfig, router_document
from pdserve.router.process import config_from_args
from pdserve.router.process import parse_args as router_parse


def _row(role: str, worker_id: str, node: str) -> dict[str, object]:
    return {"role": role, "worker_id": worker_id, "node_id": node}


def test_auto_placement_spreads_on_several_nodes_and_packs_on_one() -> None:
    pytest.importorskip("ray")
    from pdserve.cluster.ray_cluster import resolve_placement

    assert DeploymentConfig.from_dict({"mode": "ray"}).ray.placement == "auto"  # the default
    assert resolve_placement("auto", 3) == "spread"
    assert resolve_placement("auto", 2) == "spread"
    assert resolve_placement("auto", 1) == "pack"
    for chosen in ("pack", "spread", "strict_spread"):  # an explicit choice is kept
        assert resolve_placement(chosen, 3) == chosen and resolve_placement(chosen, 1) == chosen


def test_status_warns_when_a_pool_shares_one_node_of_several() -> None:
    packed = [_row("prefill", "prefill-0", "aaa"), _row("decode", "decode-0", "bbb"), _row("decode", "decode-1", "bbb")]
    (warning,) = placement_warnings(packed)
    assert warning.startswith("all 2 decode workers run on node bbb") and "--placement spread" in warning
    spread = [_row("prefill", "prefill-0", "aaa"), _row("decode", "decode-0", "aaa"), _row("decode", "decode-1", "bbb")]
    assert placement_warnings(spread) == []
    # every worker on one node: a warning only when the cluster is known to have more nodes
    together = [
        _row("prefill", "prefill-0", "aaa"),
        _row("decode", "decode-0", "aaa"),
        _row("decode", "decode-1", "aaa"),
    ]
    assert placement_warnings(together) == []
    assert [w.split(":")[0] for w in placement_warnings(together, cluster_nodes=3)] == [
        "all 2 decode workers run on node aaa"
    ]
    # outside Ray (no node ids) and single workers: nothing to say
    assert placement_warnings([_row("decode", "d0", ""), _row("decode", "d1", "")], cluster_nodes=2) == []


@pytest.mark.parametrize(
    ("doc", "wait"),
    [
        ({"mode": "ray"}, 60.0),  # Ray restarts dead worker actors: requests wait for them
        ({"mode": "ray", "ray": {"restart_wait_s": 5}}, 5.0),
        ({"mode": "ray", "ray": {"max_restarts": 0}}, 0.0),  # nothing to wait for
        ({"mode": "local"}, 0.0),  # local workers that die stay dead: fail at once, as before
    ],
)
def test_router_waits_only_where_workers_restart(doc: dict[str, object], wait: float) -> None:
    config = DeploymentConfig.from_dict(doc)
    document = router_document(config, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    router = config_from_args(router_parse([], document=document))
    assert router.worker_restart_wait_s == wait


def test_restart_wait_is_a_ray_setting() -> None:
    with pytest.raises(ValueError, match="ray.restart_wait_s .* not supported without --ray"):
        DeploymentConfig.from_dict({"mode": "local", "ray": {"restart_wait_s": 5}})
    with pytest.raises(ValueError, match="ray.restart_wait_s"):
        DeploymentConfig.from_dict({"mode": "ray", "ray": {"restart_wait_s": -1}})
