"""services/event_waits.py: a wait for an event with a timeout that never loses a cancellation."""

from __future__ import annotations

import asyncio

from services.event_waits import event_or_timeout


def test_a_loop_cancelled_as_its_event_is_set_stops() -> None:
    """With asyncio.wait_for on Python 3.11 this loop swallowed the cancellation and ran on: the
    coordinator's upkeep loops did, and asyncio.run's teardown then waited on them for good."""

    async def scenario() -> None:
        woken, waiting = asyncio.Event(), asyncio.Event()
        rounds = 0

        async def upkeep() -> None:
            nonlocal rounds
            while True:
                waiting.set()  # no await before the wait below: this task is in it when the test goes on
                await event_or_timeout(woken, 10)
                woken.clear()
                rounds += 1

        task = asyncio.ensure_future(upkeep())
        await asyncio.wait_for(waiting.wait(), 5)
        woken.set()
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        assert task.cancelled(), f"the loop ran on after its cancellation ({rounds} rounds)"

    asyncio.run(scenario())


def test_it_says_whether_the_event_was_set() -> None:
    async def scenario() -> None:
        event = asyncio.Event()
        assert await event_or_timeout(event, 0.01) is False
        asyncio.get_running_loop().call_soon(event.set)
        assert await event_or_timeout(event, 10) is True

    asyncio.run(scenario())
