"""GroupCommitter (services/queue/group_commit.py): concurrent commit() callers share few flushes, each returns
only after a flush that started after its call, a flush's error reaches exactly that flush's waiters, and the
whole path works over a real FileMessageLog."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from services.queue.group_commit import Flushable, GroupCommitter
from services.queue.message_log import FileMessageLog, MemoryMessageLog


class CountingLog:
    """A fake log: appends are numbered; a flush makes durable what was appended when it started."""

    def __init__(self, delay: float = 0.005) -> None:
        self._lock = threading.Lock()
        self.delay = delay
        self.appended = 0
        self.durable = 0
        self.flush_calls = 0
        self.running = 0
        self.most_running = 0
        self.fail: set[int] = set()  # flush numbers (from 1) that raise
        self.gates: dict[int, threading.Event] = {}  # flush numbers that wait for their event

    def append(self) -> int:
        with self._lock:
            self.appended += 1
            return self.appended

    def flush(self) -> None:
        with self._lock:
            self.flush_calls += 1
            number = self.flush_calls
            covered = self.appended
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            gate = self.gates.get(number)
            if gate is not None:
                assert gate.wait(10)
            time.sleep(self.delay)
            if number in self.fail:
                raise OSError(f"flush {number} failed")
            with self._lock:
                self.durable = max(self.durable, covered)
        finally:
            with self._lock:
                self.running -= 1


async def append_and_commit(log: CountingLog, committer: GroupCommitter) -> int:
    """What a queue does before confirming: append, commit, then the append must be durable."""
    mine = log.append()
    await committer.commit()
    assert log.durable >= mine  # covered by a flush that started after the append
    return mine


async def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


def run(main: Callable[[], Awaitable[None]]) -> None:
    async def wrapped() -> None:
        await asyncio.wait_for(main(), 30)

    asyncio.run(wrapped())


def test_a_burst_of_callers_shares_one_flush() -> None:
    async def main() -> None:
        log = CountingLog()
        committer = GroupCommitter(log)
        await asyncio.gather(*(append_and_commit(log, committer) for _ in range(500)))
        assert log.flush_calls == committer.flushes
        assert log.flush_calls <= 2
        assert log.durable == 500

    run(main)


def test_callers_arriving_during_a_flush_wait_for_the_next_one() -> None:
    async def main() -> None:
        log = CountingLog()
        first_gate, second_gate = threading.Event(), threading.Event()
        log.gates = {1: first_gate, 2: second_gate}
        committer = GroupCommitter(log)
        early = asyncio.ensure_future(append_and_commit(log, committer))
        await eventually(lambda: log.flush_calls == 1)  # the first flush is under way...
        late = [asyncio.ensure_future(append_and_commit(log, committer)) for _ in range(100)]
        await asyncio.sleep(0.02)
        assert log.flush_calls == 1  # ...and the late callers do not start another alongside it
        first_gate.set()
        await early
        await eventually(lambda: log.flush_calls == 2)
        await asyncio.sleep(0.02)
        assert not any(task.done() for task in late)  # the first flush, started before them, did not satisfy them
        second_gate.set()
        await asyncio.gather(*late)
        assert log.flush_calls == 2  # 101 callers, two flushes
        assert log.most_running == 1

    run(main)


def test_steady_load_batches_and_every_caller_is_covered() -> None:
    async def main() -> None:
        log = CountingLog(delay=0.002)
        committer = GroupCommitter(log)
        rng = random.Random(5)

        async def publisher() -> None:
            for _ in range(40):
                await append_and_commit(log, committer)
                if rng.random() < 0.5:
                    await asyncio.sleep(rng.random() * 0.002)

        await asyncio.gather(*(publisher() for _ in range(25)))
        assert log.durable == 1000
        assert log.most_running == 1
        assert log.flush_calls <= 1000 // 5, log.flush_calls  # each flush served many callers

    run(main)


def test_a_flush_error_reaches_the_waiters_of_that_flush_only() -> None:
    async def main() -> None:
        log = CountingLog()
        gate = threading.Event()
        log.gates = {1: gate}
        log.fail = {1}
        committer = GroupCommitter(log)
        failing = [asyncio.ensure_future(append_and_commit(log, committer)) for _ in range(10)]
        await eventually(lambda: log.flush_calls == 1)
        later = [asyncio.ensure_future(append_and_commit(log, committer)) for _ in range(10)]
        gate.set()
        failed = await asyncio.gather(*failing, return_exceptions=True)
        assert all(isinstance(outcome, OSError) and str(outcome) == "flush 1 failed" for outcome in failed)
        assert len(await asyncio.gather(*later)) == 10  # the next flush succeeded: they are durable
        assert log.flush_calls == 2
        await append_and_commit(log, committer)  # and the committer carries on

    run(main)


def test_max_delay_gathers_callers_that_arrive_a_little_apart() -> None:
    async def main() -> None:
        log = CountingLog(delay=0.0)
        committer = GroupCommitter(log, max_delay=0.3)
        started = time.monotonic()
        tasks = []
        for _ in range(5):
            tasks.append(asyncio.ensure_future(append_and_commit(log, committer)))
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
        assert log.flush_calls == 1
        assert time.monotonic() - started >= 0.29  # the first caller waited out the delay

    run(main)


def test_a_cancelled_caller_does_not_cancel_the_shared_flush() -> None:
    async def main() -> None:
        log = CountingLog()
        gate = threading.Event()
        log.gates = {1: gate}
        committer = GroupCommitter(log)
        impatient = asyncio.ensure_future(append_and_commit(log, committer))
        patient = asyncio.ensure_future(append_and_commit(log, committer))
        await eventually(lambda: log.flush_calls == 1)
        impatient.cancel()
        gate.set()
        assert await patient == 2
        with pytest.raises(asyncio.CancelledError):
            await impatient
        assert log.flush_calls == 1

    run(main)


def test_an_idle_committer_starts_again() -> None:
    async def main() -> None:
        log = CountingLog(delay=0.0)
        committer = GroupCommitter(log)
        for _ in range(3):
            await append_and_commit(log, committer)
            await asyncio.sleep(0.01)
        assert log.flush_calls == 3
        await committer.commit()  # nothing new appended: still a flush that starts after the call
        assert log.flush_calls == 4

    run(main)


def test_negative_max_delay_is_refused() -> None:
    with pytest.raises(ValueError):
        GroupCommitter(MemoryMessageLog(), max_delay=-1)


def test_publishers_over_a_file_log_are_confirmed_only_when_on_disk(tmp_path: Path) -> None:
    directory = str(tmp_path / "log")
    ids = itertools.count(1)
    confirmed: list[int] = []

    async def main() -> None:
        log = FileMessageLog(directory)
        counter = FlushCounter(log)
        committer = GroupCommitter(counter)

        async def publish() -> None:
            message_id = next(ids)
            log.append_enqueue(message_id, message_id.to_bytes(8, "little") * 32)
            await committer.commit()
            confirmed.append(message_id)

        await asyncio.gather(*(publish() for _ in range(300)))
        assert counter.calls <= 2
        for _ in range(5):  # a second wave, arriving in smaller groups
            await asyncio.gather(*(publish() for _ in range(20)))
        log.close()  # without flushing: only what was flushed counts

    run(main)
    with FileMessageLog(directory) as reopened:
        recovered = reopened.recover()
    assert sorted(confirmed) == list(range(1, 401))
    assert [(m, len(p)) for m, p in recovered] == [(m, 256) for m in range(1, 401)]


class FlushCounter:
    """Passes flush() on to a log, counting the calls."""

    def __init__(self, log: Flushable) -> None:
        self.log = log
        self.calls = 0

    def flush(self) -> None:
        self.calls += 1
        self.log.flush()
