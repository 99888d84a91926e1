"""The exceptions that mean "a wait ran out of time", as one tuple every package can catch.

On Python 3.10 (which pdserve supports) `concurrent.futures.TimeoutError` (raised by
`Future.result(timeout=...)`) and `asyncio.TimeoutError` (raised by `asyncio.wait_for`) are classes
of their own, not the builtin `TimeoutError`; from 3.11 on all three are the same class. A bare
`except TimeoutError` around `Future.result(timeout=...)` therefore lets the timeout escape on 3.10.
Catch `TIMEOUT_ERRORS` instead.

Hand-written (not generated); imports only the standard library.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

#: Every exception class a timed wait raises (duplicates removed: on 3.11+ this is one class).
TIMEOUT_ERRORS: tuple[type[Exception], ...] = tuple(
    dict.fromkeys((TimeoutError, concurrent.futures.TimeoutError, asyncio.TimeoutError))
)
