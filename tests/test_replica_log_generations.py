"""A replica's log switching generations (services/queue/replica_log.py): a flush is reported durable only
once what it covered will be found after a crash, that is, once CURRENT names the generation it wrote."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from services.queue.durability import Position
from services.queue.ops import Message
from services.queue.replica_core import FlushLog, WriteLog
from services.queue.replica_log import CURRENT, ReplicaLog


async def _until(condition: object, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


def _hold_switches(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make every switch of CURRENT wait, once started (the first event), for the second event."""
    switch_started, release_switch = threading.Event(), threading.Event()
    make_current = ReplicaLog._make_current

    def slow_make_current(self: ReplicaLog, generation: int) -> None:
        switch_started.set()
        release_switch.wait(10)
        make_current(self, generation)

    monkeypatch.setattr(ReplicaLog, "_make_current", slow_make_current)
    return switch_started, release_switch


def test_a_later_flush_is_not_reported_before_an_earlier_one_makes_its_generation_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a clean-clone CI run (issue 13's session): a durable queue's 20 confirmed persistent
    messages were gone after a SIGKILL of every node. Its first flush was switching CURRENT to the new
    generation in a worker thread when a second flush completed; the second saw no switch pending and
    reported itself durable at once, so the confirms went out while CURRENT did not exist yet, and the
    restarted node found no log."""
    switch_started, release_switch = _hold_switches(monkeypatch)
    flushed: list[int] = []

    async def scenario() -> None:
        replica_log = ReplicaLog(str(tmp_path), flushed.append, lambda reason: None, lambda: None)
        replica_log.apply(WriteLog((Message(1, b"first", persistent=True),), Position(1, 1), fresh=True))
        replica_log.apply(FlushLog(1))
        replica_log.apply(FlushLog(2))
        try:
            await _until(switch_started.is_set, "the first flush never switched generations")
            committer = replica_log.committer
            assert committer is not None
            await _until(lambda: committer.flushes >= 1, "the flush never ran")
            for _ in range(10):
                await asyncio.sleep(0)  # whatever the second flush's completion does next
            assert flushed == [], "a flush was reported durable while CURRENT did not name its generation"
            assert not os.path.exists(tmp_path / CURRENT)
        finally:
            release_switch.set()
        await _until(lambda: flushed == [1, 2], f"both flushes reported, in order (got {flushed})")
        assert (tmp_path / CURRENT).read_text().strip() == "g000001"
        replica_log.close()

    asyncio.run(scenario())


def test_a_new_generation_waits_for_the_switch_under_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen while fixing the test above: a fresh WriteLog while CURRENT was being switched to generation 1
    numbered its own generation 1 too (CURRENT did not name it yet) and deleted that directory, the one
    holding the flushed, confirmed messages, before the switch had even named it."""
    switch_started, release_switch = _hold_switches(monkeypatch)
    flushed: list[int] = []

    async def scenario() -> None:
        replica_log = ReplicaLog(str(tmp_path), flushed.append, lambda reason: None, lambda: None)
        replica_log.apply(WriteLog((Message(1, b"first", persistent=True),), Position(1, 1), fresh=True))
        replica_log.apply(FlushLog(1))
        try:
            await _until(switch_started.is_set, "the first flush never switched generations")
            segments = list((tmp_path / "g000001").glob("*.seg"))
            assert segments
            replica_log.apply(WriteLog((Message(2, b"second", persistent=True),), Position(2, 1), fresh=True))
            for _ in range(10):
                await asyncio.sleep(0)
            assert all(segment.exists() for segment in segments), "the generation being switched to was deleted"
        finally:
            release_switch.set()
        await _until(lambda: flushed == [1], "the first flush reported")
        replica_log.apply(FlushLog(2))
        await _until(lambda: flushed == [1, 2], "the second generation's flush reported")
        assert (tmp_path / CURRENT).read_text().strip() == "g000002"
        replica_log.close()
        reopened = ReplicaLog(str(tmp_path), flushed.append, lambda reason: None, lambda: None)
        recovery = reopened.open()
        assert recovery is not None and [m.body for m in recovery.messages] == [b"second"]
        reopened.close()

    asyncio.run(scenario())
