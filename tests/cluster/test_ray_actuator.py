"""RayActuator (cluster.ray_elastic) against an in-memory worker set: it carries out the autoscaler's
add/remove decisions only within [min_workers, max_workers], counts live (not draining) workers,
picks the newest worker of a role when the decision names none, and records every outcome. The
same actuator against a real Ray deployment: tests/ray/test_ray_elastic.py."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.cluster.autoscaler import Decision
from pdserve.cluster.ray_elastic import RayActuator


class FakeWorkers:
    """The controller's worker set as the actuator sees it (`workers`, `add_worker`, `remove_worker`)."""

    def __init__(self, roles: list[str]) -> None:
        self.rows = [{"name": f"{r}-{i}", "role": r, "draining": False} for i, r in enumerate(roles)]
        self.fail_next = False

    def workers(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.rows]

    def add_worker(self, role: str) -> str:
        if self.fail_next:
            raise RuntimeError("placement group not placed")
        name = f"{role}-{len(self.rows)}"
        self.rows.append({"name": name, "role": role, "draining": False})
        return name

    def remove_worker(self, name: str) -> bool:
        before = len(self.rows)
        self.rows = [r for r in self.rows if r["name"] != name]
        return len(self.rows) < before


def test_adds_up_to_max_and_removes_down_to_min() -> None:
    workers = FakeWorkers(["prefill", "decode", "decode"])
    act = RayActuator(workers, min_workers=2, max_workers=4)
    assert act(Decision("add", "prefill", "ttft missed")) == "added prefill-3"
    assert act(Decision("add", "decode", "tpot missed")) == "refused: 4 workers, max_workers 4"
    assert act(Decision("remove", "decode", "quiet", "decode-1")) == "removed decode-1"
    assert act(Decision("remove", "prefill", "quiet")) == "removed prefill-3"  # the newest prefill worker
    assert act(Decision("remove", "decode", "quiet", "decode-2")) == "refused: 2 workers, min_workers 2"
    assert [w["name"] for w in workers.rows] == ["prefill-0", "decode-2"]
    assert [a["outcome"] for a in act.actions] == [
        "added prefill-3",
        "refused: 4 workers, max_workers 4",
        "removed decode-1",
        "removed prefill-3",
        "refused: 2 workers, min_workers 2",
    ]
    assert act.actions[0]["reason"] == "ttft missed"


def test_draining_workers_do_not_count_and_the_last_of_a_role_stays() -> None:
    workers = FakeWorkers(["prefill", "decode", "decode", "decode"])
    workers.rows[3]["draining"] = True  # leaving already: not one of the live workers
    act = RayActuator(workers, min_workers=2, max_workers=4)
    assert act(Decision("add", "decode", "")) == "added decode-4"  # 3 live workers < 4
    assert act(Decision("remove", "prefill", "")) == "refused: no prefill worker to remove"  # its last one
    assert act(Decision("remove", "decode", "", "decode-9")) == "refused: no live worker decode-9"
    assert act(Decision("switch", "decode", "", "prefill-0")) == "refused: 'switch' is not a resize"


def test_a_failed_resize_is_recorded_not_raised() -> None:
    workers = FakeWorkers(["prefill", "decode"])
    workers.fail_next = True
    act = RayActuator(workers, min_workers=2, max_workers=3)
    assert act(Decision("add", "decode", "")) == "failed: RuntimeError: placement group not placed"
    assert len(workers.rows) == 2 and act.actions[-1]["kind"] == "add"
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        RayActuator(workers, min_workers=4, max_workers=3)
