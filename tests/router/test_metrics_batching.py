"""The router records inter-token gaps in batches: the Prometheus histogram and the in-memory series
must end up exactly as if every gap had been observed one by one."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from pdserve.router.metrics import ITL_BATCH, RequestClock, RouterMetrics, observe_many

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 1.0)


def _histogram() -> Histogram:
    return Histogram("gap_seconds", "test", buckets=BUCKETS, registry=CollectorRegistry())


def _samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    """Bucket counts, count and sum by (name, le); not the creation time."""
    return {
        (s.name, s.labels.get("le", "")): s.value
        for s in histogram.collect()[0].samples
        if not s.name.endswith("_created")
    }


def test_observe_many_matches_observe_one_by_one() -> None:
    values = [0.0, 0.001, 0.0011, 0.005, 0.03, 0.05, 0.05, 0.2, 1.0, 7.5, 0.0004, 0.1]
    one, many = _histogram(), _histogram()
    for value in values:
        one.observe(value)
    observe_many(many, values[:5])
    observe_many(many, values[5:])
    expected, got = _samples(one), _samples(many)
    total = ("gap_seconds_sum", "")
    assert got.pop(total) == pytest.approx(expected.pop(total))  # summed in another order
    assert got == expected
    assert expected[("gap_seconds_bucket", "0.001")] == 3 and expected[("gap_seconds_count", "")] == len(values)


def test_request_clock_records_every_gap_by_the_end() -> None:
    metrics = RouterMetrics()
    clock = RequestClock(metrics)
    tokens = ITL_BATCH + 5  # one full batch, then a remainder recorded at the end
    for _ in range(tokens):
        clock.on_tokens()
    assert metrics.summaries()["itl"].count == ITL_BATCH  # the first batch went out mid-request
    clock.count_tokens(3, tokens)
    clock.finish()
    assert metrics.summaries()["itl"].count == tokens - 1
    assert metrics.summaries()["ttft"].count == 1
    sample = metrics.prom.itl.collect()[0].samples
    count = next(s.value for s in sample if s.name.endswith("_count"))
    assert count == tokens - 1


def test_a_request_that_ends_without_finishing_still_records_its_gaps() -> None:
    metrics = RouterMetrics()
    clock = RequestClock(metrics)
    for _ in range(4):
        clock.on_tokens()
    clock.sample(ok=False)  # what RouterCore.generate does for a failed or cancelled request
    assert metrics.summaries()["itl"].count == 3
