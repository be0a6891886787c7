"""Waiting for an asyncio.Event with a timeout: in the loops that keep a service's state up to date
(woken, or a tick), and in a request that waits for a replica to serve.

Responsible for one wait: until an asyncio.Event is set or some seconds pass. Guarantees that a
cancellation is never lost. asyncio.wait_for on Python 3.11 returns normally when the event is set
in the same turn of the event loop as the cancellation arrives (cpython gh-86296); a `while True`
loop built on it then runs on for good, and the coordinator's upkeep loops did: asyncio.run's
teardown waited on them forever (a test hung once in about 60 runs).
"""

from __future__ import annotations

import asyncio
import contextlib


async def event_or_timeout(event: asyncio.Event, seconds: float) -> bool:
    """Return when `event` is set or after `seconds`, whichever comes first: whether it is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()
