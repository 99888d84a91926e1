"""`pdserve.timeouts.TIMEOUT_ERRORS` catches what every kind of timed wait raises, on every Python
pdserve supports (on 3.10 the three classes differ; a bare `except TimeoutError` misses two)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from pdserve.timeouts import TIMEOUT_ERRORS


def test_a_future_result_timeout_is_caught() -> None:
    with pytest.raises(TIMEOUT_ERRORS):
        concurrent.futures.Future().result(timeout=0.01)
    assert concurrent.futures.TimeoutError in TIMEOUT_ERRORS


def test_an_asyncio_wait_for_timeout_is_caught() -> None:
    async def wait() -> None:
        await asyncio.wait_for(asyncio.sleep(10), timeout=0.01)

    with pytest.raises(TIMEOUT_ERRORS):
        asyncio.run(wait())
    assert asyncio.TimeoutError in TIMEOUT_ERRORS


def test_the_builtin_timeout_error_is_caught() -> None:
    assert TimeoutError in TIMEOUT_ERRORS
    assert len(set(TIMEOUT_ERRORS)) == len(TIMEOUT_ERRORS)
