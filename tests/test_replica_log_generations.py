"""A replica's log switching generations (services/queue/replica_log.py): a flush is reported durable only
once what it covered will be found after a crash, that is, once CURRENT names the generation it wrote."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from services.queue.durability import Position
from services.queue.group_commit import GroupCommitter
from services.queue.message_log import FileMessageLog
from services.queue.ops import Message
from services.queue.replica_core import AppendToLog, DiscardLog, FlushLog, WatchDisk, WriteLog
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


def _write_a_first_generation(replica_log: ReplicaLog) -> None:
    """A fresh WriteLog holding b"first" (id 1), and flush 1 asked for: it becomes generation 1."""
    replica_log.apply(WriteLog((Message(1, b"first", persistent=True),), Position(1, 1), fresh=True))
    replica_log.apply(FlushLog(1))


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
        _write_a_first_generation(replica_log)
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
        _write_a_first_generation(replica_log)
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


def _hold_flushes_of(replica_log: ReplicaLog, *, before_writing: bool) -> threading.Event:
    """Make the flushes of the replica's current log wait for the returned event, before they write
    (`before_writing`) or after they wrote and synced."""
    held_log = replica_log.log
    assert held_log is not None
    release = threading.Event()
    flush = held_log.flush

    def held_flush() -> None:
        if not before_writing:
            flush()
        release.wait(10)
        if before_writing:
            flush()

    held_log.flush = held_flush  # type: ignore[method-assign]
    return release


async def _a_first_generation(replica_log: ReplicaLog, flushed: list[int]) -> None:
    _write_a_first_generation(replica_log)
    await _until(lambda: flushed == [1], "the first generation's flush reported")


def _recovered_bodies(directory: Path) -> list[bytes]:
    """What a restart would recover from the directory as it is now (opened from a copy: opening tidies)."""
    copy = directory.parent / f"{directory.name}-copy{len(list(directory.parent.iterdir()))}"
    shutil.copytree(directory, copy)
    reopened = ReplicaLog(str(copy), lambda flush_id: None, lambda reason: None, lambda: None)
    recovery = reopened.open()
    reopened.close()
    assert recovery is not None, "no log found after the restart"
    return [message.body for message in recovery.messages]


async def _a_fresh_write_while_the_old_generation_flushes(
    replica_log: ReplicaLog, flushed: list[int], bodies: list[bytes], *, before_writing: bool
) -> tuple[threading.Event, GroupCommitter]:
    """A first generation holding b"first"; then b"second" appended and flush 2 asked for, held (see
    `_hold_flushes_of`) while a fresh WriteLog of `bodies` (ids 1, 2, ...) makes a second generation.
    Returns the event that releases flush 2, and the first generation's committer."""
    await _a_first_generation(replica_log, flushed)
    release = _hold_flushes_of(replica_log, before_writing=before_writing)
    replica_log.apply(AppendToLog((Message(2, b"second", persistent=True),), (), Position(1, 2)))
    replica_log.apply(FlushLog(2))
    old_committer = replica_log.committer
    assert old_committer is not None
    await _until(lambda: old_committer._runner is not None, "the old generation's flush never started")
    messages = tuple(Message(i, body, persistent=True) for i, body in enumerate(bodies, start=1))
    replica_log.apply(WriteLog(messages, Position(2, len(messages)), fresh=True))
    await _until(lambda: replica_log.committer is not old_committer, "the new generation was never written")
    return release, old_committer


def test_a_flush_of_the_replaced_generation_does_not_make_the_new_one_current(tmp_path: Path) -> None:
    """Seen while fixing the tests above: a flush of the old generation that completed after a fresh WriteLog
    made the new generation CURRENT (and deleted the old one) before anything of the new one was flushed, so a
    crash then would have found a log missing messages that had been confirmed."""
    flushed: list[int] = []
    failures: list[str] = []

    async def scenario() -> None:
        replica_log = ReplicaLog(str(tmp_path), flushed.append, failures.append, lambda: None)
        release, _ = await _a_fresh_write_while_the_old_generation_flushes(
            replica_log, flushed, [b"m1", b"m2", b"m3"], before_writing=False
        )
        release.set()
        await _until(lambda: not replica_log._tasks, "the old generation's flush never ended")
        assert (tmp_path / CURRENT).read_text().strip() == "g000001", "CURRENT names a generation never flushed"
        assert _recovered_bodies(tmp_path) == [b"first", b"second"]
        replica_log.apply(FlushLog(3))
        await _until(lambda: flushed == [1, 3], f"the new generation's flush reported (got {flushed})")
        assert (tmp_path / CURRENT).read_text().strip() == "g000002"
        replica_log.close()
        assert failures == []
        assert _recovered_bodies(tmp_path) == [b"m1", b"m2", b"m3"]

    asyncio.run(scenario())


def test_a_flush_of_the_replaced_generation_that_finds_its_log_closed_fails_nothing(tmp_path: Path) -> None:
    """Seen while fixing the tests above: a fresh WriteLog closes the old generation's log, and a flush of it
    still to run then raised LogClosedError, which failed the whole replica log (a mirror leaving the
    synchronised ones, a master stopping its confirms) though the new generation held everything."""
    flushed: list[int] = []
    failures: list[str] = []

    async def scenario() -> None:
        replica_log = ReplicaLog(str(tmp_path), flushed.append, failures.append, lambda: None)
        release, old_committer = await _a_fresh_write_while_the_old_generation_flushes(
            replica_log, flushed, [b"first", b"second"], before_writing=True
        )
        release.set()
        await _until(
            lambda: old_committer.flushes >= 2 and not replica_log._tasks, "the old generation's flush never ended"
        )
        replica_log.apply(FlushLog(3))
        await _until(
            lambda: flushed == [1, 3] or failures != [], f"the new generation's flush reported (got {flushed})"
        )
        assert failures == []
        assert (tmp_path / CURRENT).read_text().strip() == "g000002"
        replica_log.close()
        assert _recovered_bodies(tmp_path) == [b"first", b"second"]

    asyncio.run(scenario())


@pytest.mark.parametrize("replacing", ["fresh WriteLog", "DiscardLog"])
def test_closing_the_replaced_log_does_not_hold_the_event_loop(tmp_path: Path, replacing: str) -> None:
    """Closing a log waits for a flush of it under way. A fresh WriteLog (and a DiscardLog) closed the
    replaced log on the event loop, which then stood still for that flush's fsync (a queue's sync,
    recovery or loss of synchronisation, with every other queue of the node behind it)."""
    flushed: list[int] = []
    failures: list[str] = []

    async def scenario() -> None:
        replica_log = ReplicaLog(str(tmp_path), flushed.append, failures.append, lambda: None)
        await _a_first_generation(replica_log, flushed)
        held_log = replica_log.log
        assert isinstance(held_log, FileMessageLog)
        writing, release = threading.Event(), threading.Event()
        write = held_log._write

        def held_write(pending: Any) -> None:  # runs under the log's flush lock
            writing.set()
            release.wait(10)
            write(pending)

        held_log._write = held_write  # type: ignore[method-assign]
        releaser = threading.Timer(2.0, release.set)  # so that a loop held in close() comes free
        releaser.start()
        try:
            replica_log.apply(AppendToLog((Message(2, b"second", persistent=True),), (), Position(1, 2)))
            replica_log.apply(FlushLog(2))
            await _until(writing.is_set, "the old generation's flush never started writing")
            old_committer = replica_log.committer
            if replacing == "DiscardLog":
                replica_log.apply(DiscardLog())
            else:
                messages = (Message(1, b"first", persistent=True), Message(2, b"second", persistent=True))
                replica_log.apply(WriteLog(messages, Position(2, 2), fresh=True))
            await _until(lambda: replica_log.committer is not old_committer, "the log was never replaced")
            assert not release.is_set(), "the event loop stood still until the replaced log's flush ended"
        finally:
            release.set()
            releaser.cancel()
        if replacing == "DiscardLog":
            await _until(lambda: not os.listdir(tmp_path), "the discarded log's files were never removed")
        else:
            replica_log.apply(FlushLog(3))
            await _until(lambda: flushed == [1, 3], f"the new generation's flush reported (got {flushed})")
            assert _recovered_bodies(tmp_path) == [b"first", b"second"]
        replica_log.close()
        assert failures == []

    asyncio.run(scenario())


def test_a_failed_log_stays_what_a_restart_finds_until_a_fresh_one_is_flushed(tmp_path: Path) -> None:
    """The disk fault model of tests/sim (sim_disk.py) rests on this: a mirror whose disk failed stays listed
    as synchronised until the master strikes it, and its log must go on holding what it said it held. When
    the disk writes again the failed log is only closed; a restart finds it until the core's next fresh
    WriteLog has been flushed (seed 14003647 found the simulator emptying it at once instead)."""
    flushed: list[int] = []
    failures: list[str] = []
    writable: list[bool] = []

    async def scenario() -> None:
        replica_log = ReplicaLog(str(tmp_path), flushed.append, failures.append, lambda: writable.append(True))
        await _a_first_generation(replica_log, flushed)
        replica_log._fail(OSError(28, "No space left on device"))
        replica_log.apply(AppendToLog((Message(2, b"lost", persistent=True),), (), Position(1, 2)))
        replica_log.apply(FlushLog(2))
        replica_log.apply(WatchDisk())
        await _until(lambda: writable == [True], "the disk was never found writable")
        assert replica_log.log is None
        assert _recovered_bodies(tmp_path) == [b"first"], "the failed log is what a restart finds"
        replica_log.apply(AppendToLog((Message(3, b"dropped", persistent=True),), (), Position(1, 3)))
        assert _recovered_bodies(tmp_path) == [b"first"]
        messages = (Message(1, b"first", persistent=True), Message(3, b"held", persistent=True))
        replica_log.apply(WriteLog(messages, Position(1, 3), fresh=False))
        await _until(lambda: replica_log.log is not None, "the fresh log was never written")
        assert _recovered_bodies(tmp_path) == [b"first"], "still the old log: the new one is not flushed yet"
        replica_log.apply(FlushLog(3))
        await _until(lambda: flushed == [1, 3], f"the fresh log's flush reported (got {flushed})")
        replica_log.close()
        assert failures == ["OSError: [Errno 28] No space left on device"]
        assert _recovered_bodies(tmp_path) == [b"first", b"held"]

    asyncio.run(scenario())
