"""Starting a local Ray (pdserve.cluster.ray_cluster.start_with_retry, used by `pdserve serve --ray`
and by the test modules' own Ray): one more try after Ray's start-up time-out, nothing else retried."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from pdserve.cluster.ray_cluster import start_with_retry  # noqa: E402

TIMED_OUT = "The current node timed out during startup. This could happen because ..."


def test_a_start_up_time_out_is_cleaned_up_and_tried_once_more(caplog: pytest.LogCaptureFixture) -> None:
    events: list[str] = []

    def start() -> str:
        events.append("start")
        if events.count("start") == 1:
            raise Exception(TIMED_OUT)  # noqa: TRY002 - what Ray raises
        return "started"

    assert start_with_retry(start, pause_s=0, cleanup=lambda: events.append("cleanup")) == "started"
    assert events == ["start", "cleanup", "start"]
    assert "starting Ray timed out (try 1 of 2)" in caplog.text


def test_a_second_time_out_and_any_other_failure_are_raised() -> None:
    calls: list[str] = []

    def always_times_out() -> None:
        calls.append("timed out")
        raise Exception(TIMED_OUT)  # noqa: TRY002

    with pytest.raises(Exception, match="timed out during startup"):
        start_with_retry(always_times_out, pause_s=0)
    assert len(calls) == 2

    def broken() -> None:
        calls.append("broken")
        raise ValueError("bad address")

    with pytest.raises(ValueError, match="bad address"):
        start_with_retry(broken, pause_s=0)
    assert calls.count("broken") == 1  # not retried
