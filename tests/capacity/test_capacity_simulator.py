"""The discrete-event simulator: an M/D/1 queue, hand-checkable single requests, the planner."""

from __future__ import annotations

import numpy as np
import pytest

from capacity.arrivals import arrival_times
from capacity.planner import Models, Workload, candidates, plan
from capacity.simulator import Deployment, LatencyModel, simulate
from capacity.workload import LengthDist


def test_md1_mean_wait() -> None:
    service, rate, n = 0.1, 5.0, 100_000  # rho = 0.5
    rho, mu = rate * service, 1 / service
    model = LatencyModel((service, 0.0, 0.0), (0.0, 0.0, 0.0))
    # one prefill worker, a budget of one prompt per pass, no transfer, one output token
    records = simulate(Deployment(1, 1, prefill_token_budget=8), arrival_times(n, rate, 1.0, 3), [8] * n, [1] * n,
                       model)
    wq = float(np.mean([r.ttft for r in records])) - service
    assert wq == pytest.approx(rho / (2 * mu * (1 - rho)), rel=0.05)


def test_single_request_timeline() -> None:
    # prefill 0.5 s, transfer 0.1 s, decode steps 0.05 s; 4 output tokens
    model = LatencyModel((0.5, 0.0, 0.0), (0.05, 0.0, 0.0), (0.1, 0.0), 1.0)
    (r,) = simulate(Deployment(1, 1), [1.0], [100], [4], model)
    assert r.ttft == pytest.approx(0.6) and r.itl == pytest.approx([0.05] * 3)
    assert r.e2e == pytest.approx(0.75) and r.tpot == pytest.approx(0.05) and r.output_tokens == 4
    (c,) = simulate(Deployment(colocated=1), [1.0], [100], [4], model)
    assert c.ttft == pytest.approx(0.5) and c.e2e == pytest.approx(0.65)


def test_colocated_prefill_stalls_decode() -> None:
    # request 0 decodes; request 1's long prefill (1 s) lands in the middle: one ITL of about 1 s
    model = LatencyModel((0.0, 0.001, 0.0), (0.01, 0.0, 0.0))
    r0, _ = simulate(Deployment(colocated=1), [0.0, 0.1], [10, 1000], [20, 2], model)
    assert max(r0.itl) == pytest.approx(1.0 + 0.01, abs=0.011)
    d0, _ = simulate(Deployment(1, 1), [0.0, 0.1], [10, 1000], [20, 2], model)
    assert max(d0.itl) == pytest.approx(0.01)


def test_kv_capacity_queues_admission() -> None:
    model = LatencyModel((0.0, 0.0, 0.0), (0.1, 0.0, 0.0))
    dep = Deployment(colocated=1, kv_capacity_tokens=32, block_size=16)  # one request (16 + 16 tokens) at a time
    a, b = simulate(dep, [0.0, 0.0], [16, 16], [16, 16], model)
    assert b.ttft == pytest.approx(a.e2e)


def test_planner_recommends_and_validates_input() -> None:
    model = LatencyModel((0.05, 0.001, 0.0), (0.02, 0.005, 0.0), (0.001, 0.0), 1.0)
    models = Models(model, model, dict(max_batched_tokens=4096, max_num_seqs=64,
                                       decode_kv_capacity_tokens=10**6, block_size=16))
    workload = Workload(LengthDist.parse("256"), LengthDist.parse("16"))
    result = plan(models, workload, rate=8.0, slos={"ttft": 1.0, "tpot": 0.1}, max_workers=8, num_requests=150)
    rec = result["recommended"]
    assert rec["attainment"] >= 0.9 and rec["max_rate_at_target"] >= 8.0 * 0.9
    assert result["best_disaggregated"]["workers"] >= 2
    assert candidates(3) == [(1, 2, 0), (2, 1, 0), (0, 0, 3)]
    with pytest.raises(ValueError):
        plan(models, workload, rate=1.0, slos={})
