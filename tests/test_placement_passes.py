"""Placement passes (services/coordinator/placement_passes.py): one at a time on their own thread,
policy changes coalesced into the next pass, failures shared, a departed caller's pass still run."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.coordinator.placement_passes import PlacementPasses


def test_policy_changes_arriving_during_a_pass_share_the_next_one() -> None:
    async def scenario() -> None:
        passes = PlacementPasses[int]()
        release, started = threading.Event(), threading.Event()
        runs: list[str] = []

        def first() -> int:
            runs.append("first")
            started.set()
            release.wait(5)
            return 1

        def later() -> int:
            runs.append(threading.current_thread().name)
            return 7

        running = asyncio.ensure_future(passes.apply_policies(first))
        await asyncio.to_thread(started.wait, 5)
        waiting = [asyncio.ensure_future(passes.apply_policies(later)) for _ in range(5)]
        await asyncio.sleep(0)
        release.set()
        assert await running == 1
        assert await asyncio.gather(*waiting) == [7] * 5
        assert len(runs) == 2 and runs[1].startswith("placement"), "five changes, one more pass, on its thread"
        passes.close()

    asyncio.run(scenario())


def test_passes_never_overlap() -> None:
    async def scenario() -> None:
        passes = PlacementPasses[int]()
        inside, most = 0, 0
        lock = threading.Lock()

        def work() -> int:
            nonlocal inside, most
            with lock:
                inside += 1
                most = max(most, inside)
            threading.Event().wait(0.01)
            with lock:
                inside -= 1
            return 0

        await asyncio.gather(*(passes.run(work) for _ in range(5)), *(passes.apply_policies(work) for _ in range(5)))
        assert most == 1
        passes.close()

    asyncio.run(scenario())


def test_a_failed_pass_fails_every_change_sharing_it_and_the_next_change_runs_a_new_pass() -> None:
    async def scenario() -> None:
        passes = PlacementPasses[int]()
        gate = threading.Event()

        def blocked() -> int:
            gate.wait(5)
            return 0

        def failing() -> int:
            raise ValueError("store gone")

        first = asyncio.ensure_future(passes.apply_policies(blocked))
        await asyncio.sleep(0.05)
        sharing = [asyncio.ensure_future(passes.apply_policies(failing)) for _ in range(3)]
        await asyncio.sleep(0)
        gate.set()
        await first
        for call in sharing:
            with pytest.raises(ValueError, match="store gone"):
                await call
        assert await passes.apply_policies(lambda: 3) == 3
        passes.close()

    asyncio.run(scenario())


def test_a_caller_that_goes_away_does_not_stop_the_pass() -> None:
    async def scenario() -> None:
        passes = PlacementPasses[int]()
        done = threading.Event()

        def work() -> int:
            threading.Event().wait(0.05)
            done.set()
            return 1

        call = asyncio.ensure_future(passes.apply_policies(work))
        await asyncio.sleep(0.01)
        call.cancel()
        assert await asyncio.to_thread(done.wait, 5)
        passes.close()

    asyncio.run(scenario())
