"""The servers' event loop kind (PDSERVE_EVENT_LOOP): uvloop by default, the standard loop on request."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from pdserve.serving import EVENT_LOOP_ENV, LoopThread, new_event_loop


def test_default_is_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_asyncio_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    loop = new_event_loop()
    try:
        assert not isinstance(loop, uvloop.Loop)
        assert isinstance(loop, asyncio.AbstractEventLoop)
    finally:
        loop.close()


def test_unknown_kind_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(ValueError, match="PDSERVE_EVENT_LOOP='trio'"):
        new_event_loop()


def test_loop_thread_runs_coroutines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    thread = LoopThread("test-loop")
    try:

        async def which() -> str:
            await asyncio.sleep(0)
            return type(asyncio.get_running_loop()).__module__

        assert thread.run(which(), timeout=10).startswith("uvloop")
    finally:
        thread.close()
