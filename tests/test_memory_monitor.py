"""The memory alarm's rule and monitor (services/memory_monitor.py)."""

from __future__ import annotations

import asyncio
import gc
import sys
import tracemalloc

import pytest

from services import memory_monitor
from services.memory_monitor import (
    BLOCKS_EVERY_SECONDS,
    CHECK_INTERVAL_SECONDS,
    FAR_CHECK_INTERVAL_SECONDS,
    FAR_HEADROOM_BYTES,
    QUIET_BLOCKS_EVERY_SECONDS,
    RELEASE_MIN_BLOCKS,
    SETTLED_RELEASE_MIN_BLOCKS,
    MemoryMonitor,
    blocks_count_due,
    check_interval,
    memory_alarm,
    release_due,
    resident_bytes,
)


@pytest.mark.parametrize(
    ("used", "watermark", "alarm"),
    [(0, 0, False), (10**12, 0, False), (99, 100, False), (100, 100, True), (101, 100, True)],
)
def test_the_alarm_is_on_at_or_above_a_nonzero_watermark(used: int, watermark: int, alarm: bool) -> None:
    assert memory_alarm(used, watermark) is alarm


def test_the_monitor_blocks_waiters_while_on_and_releases_them_when_off() -> None:
    async def scenario() -> None:
        monitor = MemoryMonitor("node1", watermark_bytes=1)  # any process is past one byte
        monitor.measure()
        assert monitor.alarm and "at or above the high watermark" in monitor.reason()
        waiting = asyncio.ensure_future(monitor.wait_clear())
        await asyncio.sleep(0.01)
        assert not waiting.done(), "a publisher waits while the alarm is on"
        monitor.watermark_bytes = resident_bytes() * 100
        monitor.measure()
        await asyncio.wait_for(waiting, 1)
        assert not monitor.alarm and monitor.reason() == ""

    asyncio.run(scenario())


def test_measuring_leaves_no_allocator_blocks_behind() -> None:
    """Regression (issue 13): a text-mode open() of /proc/self/statm left small blocks that later calls
    replaced; measured ten times a second through a drain, they landed in the pools being emptied and
    kept the master's arenas from going back to the system: 84 % of its growth returned after a
    1,000,000-message drain with them, 91-92 % without."""
    resident_bytes()  # anything it caches on a first call is allowed
    gc.collect()
    tracemalloc.start(1)
    try:
        for _ in range(5000):
            resident_bytes()
        gc.collect()
        here = tracemalloc.Filter(True, sys.modules[resident_bytes.__module__].__file__ or "")
        left = tracemalloc.take_snapshot().filter_traces([here]).statistics("lineno")
    finally:
        tracemalloc.stop()
    assert left == [], [str(stat) for stat in left]


def test_a_negative_watermark_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        MemoryMonitor("node1", -1)


@pytest.mark.parametrize(
    ("blocks", "previous", "peak", "due"),
    [
        (0, 0, 0, False),
        (RELEASE_MIN_BLOCKS, 3 * RELEASE_MIN_BLOCKS, 2 * RELEASE_MIN_BLOCKS, True),  # half gone, a lot, falling
        (RELEASE_MIN_BLOCKS + 1, 3 * RELEASE_MIN_BLOCKS, 2 * RELEASE_MIN_BLOCKS, False),  # not yet half
        (10, 500, 1_000, False),  # nine tenths gone, still falling, but too little to be worth a collection
        (1_000_000, 1_005_000, 1_000_000 + SETTLED_RELEASE_MIN_BLOCKS, True),  # enough gone, settled
        (1_000_000, 1_050_000, 1_000_000 + SETTLED_RELEASE_MIN_BLOCKS, False),  # still falling
        (1_000_000, 1_000_000, 1_000_000 + SETTLED_RELEASE_MIN_BLOCKS - 1, False),  # settled, not enough gone
    ],
)
def test_memory_is_released_after_a_large_fall_or_once_a_fall_is_over(
    blocks: int, previous: int, peak: int, due: bool
) -> None:
    assert release_due(blocks, previous, peak) is due


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def measure_for(self, monitor: MemoryMonitor, seconds: float, step: float = CHECK_INTERVAL_SECONDS) -> None:
        """Measure every `step` for `seconds` of this clock."""
        for _ in range(round(seconds / step)):
            self.now += step
            monitor.measure()


def test_the_monitor_releases_memory_after_a_large_drop_and_then_counts_from_there() -> None:
    clock = FakeClock()
    monitor = MemoryMonitor("node1", watermark_bytes=0, clock=clock)
    # enough that their release halves the process's blocks, whatever the tests before left allocated
    held = [object() for _ in range(max(2 * RELEASE_MIN_BLOCKS, 2 * sys.getallocatedblocks()))]
    clock.measure_for(monitor, BLOCKS_EVERY_SECONDS)
    assert monitor.releases == 0, "nothing fell yet"
    del held
    clock.measure_for(monitor, BLOCKS_EVERY_SECONDS)
    assert monitor.releases == 1, "the drop was released"
    clock.measure_for(monitor, QUIET_BLOCKS_EVERY_SECONDS)
    assert monitor.releases == 1, "the peak starts again from the released level"


MIB = 1024 * 1024
GIB = 1024 * MIB


@pytest.mark.parametrize(
    ("used", "watermark", "interval"),
    [
        (100 * MIB, 0, FAR_CHECK_INTERVAL_SECONDS),  # no alarm to raise
        (100 * MIB, 10 * GIB, FAR_CHECK_INTERVAL_SECONDS),  # far below
        (10 * GIB - FAR_HEADROOM_BYTES, 10 * GIB, FAR_CHECK_INTERVAL_SECONDS),
        (10 * GIB - FAR_HEADROOM_BYTES + 1, 10 * GIB, CHECK_INTERVAL_SECONDS),  # near: ten times a second
        (11 * GIB, 10 * GIB, CHECK_INTERVAL_SECONDS),  # past it: its end is noticed within a tenth of a second
        (100 * MIB, 200 * MIB, CHECK_INTERVAL_SECONDS),  # a small watermark is always near
    ],
)
def test_memory_is_measured_often_only_near_the_watermark(used: int, watermark: int, interval: float) -> None:
    assert check_interval(used, watermark) == interval


@pytest.mark.parametrize(
    ("since", "moving", "resident", "at_count", "due"),
    [
        (BLOCKS_EVERY_SECONDS - 0.1, True, 100 * MIB, 100 * MIB, False),  # not a second yet
        (BLOCKS_EVERY_SECONDS, True, 100 * MIB, 100 * MIB, True),  # moving: every second
        (BLOCKS_EVERY_SECONDS, False, 100 * MIB, 100 * MIB, False),  # quiet
        (BLOCKS_EVERY_SECONDS, False, 102 * MIB, 100 * MIB, True),  # quiet blocks, but resident memory grew
        (BLOCKS_EVERY_SECONDS, False, 98 * MIB, 100 * MIB, False),  # it fell: a release's doing, or the system's
        (QUIET_BLOCKS_EVERY_SECONDS - 0.1, False, 100 * MIB, 100 * MIB, False),
        (QUIET_BLOCKS_EVERY_SECONDS, False, 100 * MIB, 100 * MIB, True),  # a drain shows by then at the latest
    ],
)
def test_blocks_are_counted_every_second_while_moving_and_seldom_while_quiet(
    since: float, moving: bool, resident: int, at_count: int, due: bool
) -> None:
    assert blocks_count_due(since, moving, resident, at_count) is due


def test_a_quiet_monitor_counts_blocks_seldom_and_a_drain_brings_its_release_as_soon_as_it_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (issue 13, idle CPU): a count a second was 8 % of an idle node's CPU with 1,000 queues."""
    blocks = [5_000_000]
    counts: list[int] = []

    def count() -> int:
        counts.append(blocks[0])
        return blocks[0]

    monkeypatch.setattr(sys, "getallocatedblocks", count)
    monkeypatch.setattr(memory_monitor, "resident_bytes", lambda: 500 * MIB)
    monkeypatch.setattr(gc, "collect", lambda: 0)
    clock = FakeClock()
    monitor = MemoryMonitor("node1", watermark_bytes=0, clock=clock)
    monitor.measure()
    clock.measure_for(monitor, BLOCKS_EVERY_SECONDS)
    assert len(counts) == 2, "the first counts find the blocks moving (from nothing)"
    clock.measure_for(monitor, 3 * QUIET_BLOCKS_EVERY_SECONDS, step=FAR_CHECK_INTERVAL_SECONDS)
    assert len(counts) == 2 + 3, "quiet: a count every QUIET_BLOCKS_EVERY_SECONDS"
    blocks[0] = 3_000_000  # a drain, halfway (the resident memory stays)
    clock.measure_for(monitor, QUIET_BLOCKS_EVERY_SECONDS, step=FAR_CHECK_INTERVAL_SECONDS)
    assert len(counts) == 6 and monitor.releases == 0, "the next quiet count sees the fall"
    blocks[0] = 1_000_000  # the drain is over
    clock.measure_for(monitor, BLOCKS_EVERY_SECONDS, step=FAR_CHECK_INTERVAL_SECONDS)
    assert monitor.releases == 1, "released at the next count, a second later"
