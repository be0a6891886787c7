"""The memory alarm's rule and monitor (services/memory_monitor.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.memory_monitor import MemoryMonitor, memory_alarm, resident_bytes


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


def test_a_negative_watermark_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        MemoryMonitor("node1", -1)
