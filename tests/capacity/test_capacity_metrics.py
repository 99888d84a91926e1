"""Metric math against hand-computed values (vLLM `bench serve` definitions)."""

from __future__ import annotations

import math

import pytest

from pdserve.capacity.metrics import RequestRecord, parse_slo, stats_ms, summarize


def records() -> list[RequestRecord]:
    # r0: ttft 0.1, chunks at +0.1 and +0.3 -> itl [0.1, 0.2], e2e 0.4, 3 tokens -> tpot (0.4-0.1)/2 = 0.15
    # r1: ttft 0.5, one token, e2e 0.5 -> no tpot
    # r2: failed
    # r3: ttft 0.2, itl [0.4], e2e 0.6, 2 tokens -> tpot 0.4
    return [
        RequestRecord(0, 0.0, 10, 3, 0.1, [0.1, 0.2], 0.4),
        RequestRecord(1, 0.5, 20, 1, 0.5, [], 0.5),
        RequestRecord(2, 1.0, 30, 0, None, [], None, error="UNAVAILABLE: x"),
        RequestRecord(3, 1.5, 40, 2, 0.2, [0.4], 0.6),
    ]


def test_tpot_definition() -> None:
    r = records()
    assert r[0].tpot == pytest.approx(0.15)
    assert r[1].tpot is None and r[2].tpot is None
    assert r[3].tpot == pytest.approx(0.4)


def test_summary_counts_throughputs_and_latencies() -> None:
    s = summarize(records(), duration_s=2.0)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 70 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(38.0)
    assert s["goodput"] is None
    ttft = s["ttft_ms"]
    assert ttft["mean"] == pytest.approx(800 / 3)
    assert ttft["median"] == pytest.approx(200)
    mean = 800 / 3
    assert ttft["std"] == pytest.approx(math.sqrt(((100 - mean) ** 2 + (500 - mean) ** 2 + (200 - mean) ** 2) / 3))
    # p90 of [100, 200, 500] with linear interpolation: 200 + 0.8 * 300
    assert ttft["p90"] == pytest.approx(440)
    assert s["tpot_ms"]["mean"] == pytest.approx(275)  # (150 + 400) / 2, r1 excluded
    itl = s["itl_ms"]  # pooled [100, 200, 400]
    assert itl["mean"] == pytest.approx(700 / 3) and itl["median"] == pytest.approx(200)
    assert itl["p99"] == pytest.approx(200 + 0.98 * 200)
    assert s["e2e_ms"]["mean"] == pytest.approx(500)


def test_goodput_and_attainment() -> None:
    slos = parse_slo(["ttft_ms=300", "tpot_ms=200"])
    assert slos == {"ttft": pytest.approx(0.3), "tpot": pytest.approx(0.2)}
    s = summarize(records(), duration_s=2.0, slos=slos)
    # ttft: r0 (0.1) and r3 (0.2) meet; tpot: r0 (0.15) and r1 (no tpot) meet, r3 (0.4) misses
    assert s["slo_attainment"]["ttft"] == pytest.approx(2 / 3)
    assert s["slo_attainment"]["tpot"] == pytest.approx(2 / 3)
    assert s["slo_attainment_all"] == pytest.approx(1 / 3)  # only r0 meets both
    assert s["goodput"] == pytest.approx(0.5)
    e2e = summarize(records(), 2.0, parse_slo(["e2e_ms=500"]))
    assert e2e["goodput"] == pytest.approx(1.0)  # r0 (0.4) and r1 (0.5)


def test_empty_stats_and_bad_input() -> None:
    assert stats_ms([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p99": 0.0}
    with pytest.raises(ValueError):
        summarize([], 0.0)
    for bad in ("ttft=5", "itl_ms=5", "ttft_ms=-1", "ttft_ms"):
        with pytest.raises(ValueError):
            parse_slo([bad])


def test_record_json_round_trip() -> None:
    r = records()[0]
    doc = r.to_json()
    assert doc["tpot"] == pytest.approx(0.15)
    assert RequestRecord.from_json(doc) == r
