"""The MessageLog contract (services/queue/message_log.py), run against MemoryMessageLog and FileMessageLog.

Then FileMessageLog on disk: reopening, the COMMIT record that ends every flush, torn tails cut at every byte of
the last flush, garbage and uncommitted records after the last COMMIT, damage (a bad record a COMMIT follows, or
one in an older segment, in a snapshot) salvaged past and reported while the log turns read-only, logs written
before COMMIT records existed, random single-byte damage against a model of the format, segment rotation,
garbage collection that never brings a removed message back, compaction with a crash between each of its steps,
the directory lock, and a real crash test: a writing process SIGKILLed at random moments.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal, NamedTuple

import pytest

from services.queue import message_log
from services.queue.message_log import (
    HEADER_BYTES,
    MAX_MARK_BYTES,
    Damage,
    FileMessageLog,
    LogClosedError,
    LogDamagedError,
    LogFailedError,
    LogLockedError,
    MemoryMessageLog,
    MessageLog,
    Truncation,
)

REPO = Path(__file__).resolve().parents[1]
SMALL_SEGMENT = 4096  # contract tests on disk rotate, collect and compact


def payload_for(message_id: int, size: int | None = None) -> bytes:
    """A payload that tells which message it belongs to (so a mix-up or a damaged byte shows)."""
    length = message_id * 2654435761 % 300 if size is None else size
    seed = hashlib.blake2b(message_id.to_bytes(8, "little"), digest_size=32).digest()
    return (seed * (length // 32 + 1))[:length]


def record_bytes(payload_length: int) -> int:
    return HEADER_BYTES + 8 + payload_length


COMMIT_BYTES = HEADER_BYTES + 8  # the record that ends every flush
ENQUEUE, REMOVE, SNAPSHOT, MARK, COMMIT = 1, 2, 3, 4, 5  # record types, as the module docstring lists them


def log_record(record_type: int, body: bytes) -> bytes:
    """A valid record, built here from the documented format rather than by the module."""
    fields = struct.pack("<BBHI", record_type, 1, 0, len(body))
    return b"RQML" + fields + struct.pack("<I", zlib.crc32(body, zlib.crc32(fields))) + body


class Record(NamedTuple):
    path: Path
    offset: int
    length: int
    record_type: int
    body: bytes


def records_in(segment: Path) -> list[Record]:
    """Every record of an intact segment file, read with the documented format."""
    data = segment.read_bytes()
    found: list[Record] = []
    offset = 0
    while offset < len(data):
        magic, record_type, _, _, length, _ = struct.unpack_from("<4sBBHII", data, offset)
        assert magic == b"RQML", f"{segment} at {offset}: not a record"
        body = data[offset + HEADER_BYTES : offset + HEADER_BYTES + length]
        found.append(Record(segment, offset, HEADER_BYTES + length, record_type, body))
        offset += HEADER_BYTES + length
    return found


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def is_snapshot(segment: Path) -> bool:
    with segment.open("rb") as file:
        return file.read(5)[4:5] == b"\x03"


# ---------------------------------------------------------------------------------------------- openers


class Opener:
    """Opens the log under test, and restarts it as a crash would (what was not flushed is gone)."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind = kind
        self.directory = directory
        self.opened: list[MessageLog] = []

    def open(self) -> MessageLog:
        log: MessageLog = MemoryMessageLog() if self.kind == "memory" else self._open_file()
        self.opened.append(log)
        return log

    def restart(self, log: MessageLog) -> MessageLog:
        if isinstance(log, MemoryMessageLog):
            reopened: MessageLog = log.reopened()
            log.close()
        else:
            log.close()
            reopened = self._open_file()
        self.opened.append(reopened)
        return reopened

    def _open_file(self) -> FileMessageLog:
        return FileMessageLog(str(self.directory), segment_bytes=SMALL_SEGMENT)


@pytest.fixture(params=["memory", "file"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    made = Opener(request.param, tmp_path / "log")
    yield made
    for log in made.opened:
        log.close()


@pytest.fixture
def log(opener: Opener) -> MessageLog:
    return opener.open()


# ---------------------------------------------------------------------------------------------- contract


def test_a_new_log_is_empty(log: MessageLog) -> None:
    assert log.recover() == []
    assert log.live_count() == 0
    log.flush()  # nothing to write: harmless
    assert log.recover() == []


def test_round_trip(opener: Opener, log: MessageLog) -> None:
    messages = [(1, b"hello"), (2, b""), (3, bytes(range(256)) * 3)]
    for message_id, payload in messages:
        log.append_enqueue(message_id, payload)
    assert log.live_count() == 3
    log.flush()
    assert log.recover() == messages
    restarted = opener.restart(log)
    assert restarted.recover() == messages
    assert restarted.live_count() == 3


def test_recover_returns_what_was_flushed_and_a_restart_loses_the_rest(opener: Opener, log: MessageLog) -> None:
    log.append_enqueue(1, b"one")
    log.flush()
    log.append_enqueue(2, b"two")
    log.append_remove([1])
    assert log.live_count() == 1  # counts appended operations, flushed or not
    assert log.recover() == [(1, b"one")]  # as of the last completed flush
    restarted = opener.restart(log)  # a crash: the unflushed enqueue and remove are gone
    assert restarted.recover() == [(1, b"one")]
    assert restarted.live_count() == 1


def test_the_mark_is_the_newest_flushed_one(opener: Opener, log: MessageLog) -> None:
    assert log.mark() == b""
    log.append_enqueue(1, b"one")
    log.append_mark(b"position 1")
    assert log.mark() == b""  # not flushed yet
    log.flush()
    assert log.mark() == b"position 1"
    log.append_remove([1])
    log.append_mark(b"position 2")
    restarted = opener.restart(log)  # the crash takes the unflushed mark with the remove
    assert restarted.mark() == b"position 1"
    assert restarted.recover() == [(1, b"one")]
    restarted.append_mark(b"position 3")
    restarted.flush()
    assert opener.restart(restarted).mark() == b"position 3"


def test_a_mark_is_short(log: MessageLog) -> None:
    with pytest.raises(ValueError, match="exceeds"):
        log.append_mark(b"x" * (MAX_MARK_BYTES + 1))
    log.append_mark(b"x" * MAX_MARK_BYTES)
    log.flush()
    assert log.mark() == b"x" * MAX_MARK_BYTES


def test_a_remove_says_how_many_were_live(log: MessageLog) -> None:
    log.append_enqueue(1, b"one")
    log.append_enqueue(2, b"two")
    assert log.append_remove([1, 3]) == 1  # 3 was never enqueued
    assert log.append_remove([1]) == 0  # already removed
    assert log.append_remove([2]) == 1


def test_removes(opener: Opener, log: MessageLog) -> None:
    for message_id in range(1, 7):
        log.append_enqueue(message_id, payload_for(message_id))
    log.flush()
    log.append_remove([2, 4, 99])  # 99 was never enqueued: ignored
    log.append_remove([4, 4])  # already removed: ignored
    log.append_remove(iter([6]))  # any iterable
    log.append_remove([])
    assert log.live_count() == 3
    log.flush()
    expected = [(i, payload_for(i)) for i in (1, 3, 5)]
    assert log.recover() == expected
    assert opener.restart(log).recover() == expected


def test_enqueue_and_remove_in_one_flush(opener: Opener, log: MessageLog) -> None:
    log.append_enqueue(1, b"a")
    log.append_enqueue(2, b"b")
    log.append_remove([1])
    log.flush()
    assert log.recover() == [(2, b"b")]
    assert opener.restart(log).recover() == [(2, b"b")]


def test_recover_order_with_id_gaps(opener: Opener, log: MessageLog) -> None:
    ids = [3, 10, 11, 1000, 1001, 70_000, 2**40, 2**63 + 5, 2**64 - 1]
    for index, message_id in enumerate(ids):
        log.append_enqueue(message_id, payload_for(index))
        if index % 3 == 0:
            log.flush()
    log.append_remove([11, 2**40])
    log.flush()
    expected = [(m, payload_for(i)) for i, m in enumerate(ids) if m not in (11, 2**40)]
    assert log.recover() == expected
    assert opener.restart(log).recover() == expected


def test_ids_must_be_positive_and_increase(opener: Opener, log: MessageLog) -> None:
    log.append_enqueue(5, b"")
    for bad in (5, 4, 0, -1, 2**64):
        with pytest.raises(ValueError):
            log.append_enqueue(bad, b"")
    with pytest.raises(TypeError):
        log.append_enqueue(True, b"")
    log.append_enqueue(7, b"")
    log.append_remove([7])
    with pytest.raises(ValueError):  # within one open log, even a removed id is not reused
        log.append_enqueue(7, b"")
    log.flush()
    restarted = opener.restart(log)
    assert restarted.recover() == [(5, b"")]
    with pytest.raises(ValueError):  # after a restart, ids continue above every recovered one
        restarted.append_enqueue(5, b"")
    restarted.append_enqueue(6, b"six")
    restarted.flush()
    assert restarted.recover() == [(5, b""), (6, b"six")]


def test_a_closed_log_refuses_everything(log: MessageLog) -> None:
    log.append_enqueue(1, b"x")
    log.close()
    log.close()  # twice is fine
    with pytest.raises(LogClosedError):
        log.append_enqueue(2, b"y")
    with pytest.raises(LogClosedError):
        log.append_remove([1])
    with pytest.raises(LogClosedError):
        log.flush()
    with pytest.raises(LogClosedError):
        log.recover()


def test_random_workload_matches_a_model(opener: Opener, log: MessageLog) -> None:
    """Random enqueues, removes, flushes and restarts; on disk this rotates, collects and compacts many times."""
    rng = random.Random(7)
    flushed: dict[int, bytes] = {}
    appended: dict[int, bytes] = {}
    next_id = 1
    for round_number in range(600):
        for _ in range(rng.randint(0, 8)):
            next_id += rng.choice((1, 1, 2, 9))
            appended[next_id] = payload_for(next_id)
            log.append_enqueue(next_id, appended[next_id])
        if appended and rng.random() < 0.7:
            keep_old = [i for i in appended if i % 13 == 0]  # a few messages stay for a long time
            candidates = [i for i in appended if i % 13 != 0]
            chosen = candidates[: rng.randint(0, len(candidates))]
            if rng.random() < 0.2 and candidates:
                chosen.append(rng.choice(candidates))  # out of order, or twice
            if rng.random() < 0.05 and keep_old:
                chosen.append(keep_old[0])
            log.append_remove(chosen)
            for message_id in chosen:
                appended.pop(message_id, None)
        assert log.live_count() == len(appended)
        if rng.random() < 0.6:
            log.flush()
            flushed = dict(appended)
        if round_number % 97 == 96:
            log = opener.restart(log)
            appended = dict(flushed)
        if round_number % 50 == 0:
            assert log.recover() == list(flushed.items())
    log.flush()
    assert log.recover() == list(appended.items())
    assert opener.restart(log).recover() == list(appended.items())
    if opener.kind == "file":  # reclaimed as it went: compaction keeps closed segments under 4x their live data
        on_disk = sum(segment.stat().st_size for segment in segment_files(opener.directory))
        live = sum(record_bytes(len(payload)) for payload in appended.values())
        assert on_disk <= 4 * live + 2 * SMALL_SEGMENT


def test_appends_from_one_thread_while_another_flushes(opener: Opener, log: MessageLog) -> None:
    total = 3000
    done = threading.Event()

    def produce() -> None:
        for message_id in range(1, total + 1):
            log.append_enqueue(message_id, payload_for(message_id, 40))
            if message_id % 3 == 0:
                log.append_remove([message_id - 1])
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    while not done.is_set():
        log.flush()
    producer.join()
    log.flush()
    expected = [(i, payload_for(i, 40)) for i in range(1, total + 1) if i % 3 != 2]
    assert log.recover() == expected
    assert opener.restart(log).recover() == expected


def test_live_ids_and_last_id_count_what_was_appended(opener: Opener, log: MessageLog) -> None:
    assert (log.live_ids(), log.last_id()) == ([], 0)
    for message_id in (3, 5, 9, 12):
        log.append_enqueue(message_id, payload_for(message_id))
    log.append_remove([5, 12])
    assert (log.live_ids(), log.last_id()) == ([3, 9], 12)  # not flushed yet; a removed id still bounds the next
    log.flush()
    log.append_enqueue(20, b"not flushed")
    assert (log.live_ids(), log.last_id()) == ([3, 9, 20], 20)
    restarted = opener.restart(log)  # the unflushed 20 is gone; the bound is now the highest recovered id
    assert (restarted.live_ids(), restarted.last_id()) == ([3, 9], 9)
    # Bringing the log up to what an owner holds, {3, 10, 11}: remove what it lacks, enqueue above last_id().
    held = {3: payload_for(3), 10: b"ten", 11: b"eleven"}
    assert restarted.append_remove(set(restarted.live_ids()) - set(held)) == 1
    for message_id in sorted(held):
        if message_id > restarted.last_id():
            restarted.append_enqueue(message_id, held[message_id])
    restarted.flush()
    assert opener.restart(restarted).recover() == list(held.items())


def test_intact_mark_is_the_mark_when_nothing_is_damaged(opener: Opener, log: MessageLog) -> None:
    assert log.intact_mark() == b""
    log.append_enqueue(1, b"one")
    log.append_mark(b"position 1")
    log.flush()
    assert log.intact_mark() == log.mark() == b"position 1"
    log.append_mark(b"position 2")
    restarted = opener.restart(log)
    assert restarted.intact_mark() == restarted.mark() == b"position 1"


# ---------------------------------------------------------------------------------------------- on disk


def open_file_log(
    directory: Path, segment_bytes: int = SMALL_SEGMENT, *, fault_hook: Callable[[str], None] | None = None
) -> FileMessageLog:
    return FileMessageLog(str(directory), segment_bytes=segment_bytes, fault_hook=fault_hook)


def write_messages(directory: Path, ids: Iterable[int], segment_bytes: int = SMALL_SEGMENT, size: int = 40) -> None:
    with open_file_log(directory, segment_bytes) as log:
        for message_id in ids:
            log.append_enqueue(message_id, payload_for(message_id, size))
            log.flush()


def test_reopening_recovers_every_flush(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    for start in range(1, 50, 7):
        with open_file_log(directory) as log:
            assert [m for m, _ in log.recover()] == list(range(1, start))
            for message_id in range(start, start + 7):
                log.append_enqueue(message_id, payload_for(message_id, 100))
            log.flush()
    with open_file_log(directory) as log:
        assert log.recover() == [(i, payload_for(i, 100)) for i in range(1, 50)]
        assert log.truncations == []


def test_every_flush_that_writes_ends_with_a_numbered_commit(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    with open_file_log(directory, 1 << 20) as log:
        log.append_enqueue(1, b"one")
        log.append_mark(b"m")
        log.flush()
        log.flush()  # nothing to write: no COMMIT either
        log.append_remove([1])
        log.flush()
    with open_file_log(directory, 1 << 20) as log:  # the count goes on after a reopening
        log.append_enqueue(2, b"two")
        log.flush()
    (segment,) = segment_files(directory)
    assert [(record.record_type, record.body) for record in records_in(segment)] == [
        (ENQUEUE, struct.pack("<Q", 1) + b"one"),
        (MARK, b"m"),
        (COMMIT, struct.pack("<Q", 1)),
        (REMOVE, struct.pack("<Q", 1)),
        (COMMIT, struct.pack("<Q", 2)),
        (ENQUEUE, struct.pack("<Q", 2) + b"two"),
        (COMMIT, struct.pack("<Q", 3)),
    ]


@pytest.mark.parametrize("last", ["enqueue", "remove"])
def test_a_torn_last_flush_is_dropped_at_every_offset(tmp_path: Path, last: str) -> None:
    base = tmp_path / "base"
    write_messages(base, range(1, 6), segment_bytes=1 << 20)
    with open_file_log(base, 1 << 20) as log:
        if last == "enqueue":
            log.append_enqueue(6, payload_for(6, 40))
        else:
            log.append_remove([3])
        log.flush()
    (segment,) = segment_files(base)
    full = segment.stat().st_size
    last_record = record_bytes(40) if last == "enqueue" else HEADER_BYTES + 8
    start = full - last_record - COMMIT_BYTES  # where the last flush begins
    before_last = [(i, payload_for(i, 40)) for i in range(1, 6)]
    for cut in range(start, full + 1):
        trial = tmp_path / f"cut-{cut}"
        shutil.copytree(base, trial)
        os.truncate(trial / segment.name, cut)
        with open_file_log(trial, 1 << 20) as log:
            recovered = log.recover()
            assert log.damage == []
            if cut == full:
                assert log.truncations == []
                assert recovered != before_last  # the whole last flush is there
                continue
            assert recovered == before_last, cut
            if cut == start:
                assert log.truncations == []
            else:
                (truncation,) = log.truncations
                assert (truncation.offset, truncation.dropped_bytes) == (start, cut - start)
                if cut == start + last_record:  # the record is whole, its COMMIT missing: uncommitted
                    assert truncation.reason == "no COMMIT after it"
            assert (trial / segment.name).stat().st_size == start  # cut away on disk too
            log.append_enqueue(100, b"after the crash")
            log.flush()
        with open_file_log(trial, 1 << 20) as log:
            assert log.recover() == [*before_last, (100, b"after the crash")]
            assert log.truncations == []
        shutil.rmtree(trial)


def bad_crc_record() -> bytes:
    body = struct.pack("<Q", 99) + b"payload"
    fields = struct.pack("<BBHI", 1, 1, 0, len(body))
    return b"RQML" + fields + struct.pack("<I", zlib.crc32(body) ^ 1) + body


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00" * 100,  # zeroed blocks, as a power loss can leave
        random.Random(3).randbytes(100),
        bad_crc_record(),
        b"RQML" + struct.pack("<BBHII", 1, 1, 0, 1 << 30, 0),  # a header promising more than there is
        b"RQM",
    ],
    ids=["zeros", "random", "bad-crc", "huge-length", "short"],
)
def test_garbage_after_the_last_commit_is_dropped(tmp_path: Path, garbage: bytes) -> None:
    directory = tmp_path / "log"
    write_messages(directory, range(1, 4))
    segment = segment_files(directory)[-1]
    size = segment.stat().st_size
    with segment.open("ab") as file:
        file.write(garbage)
    with open_file_log(directory) as log:
        assert log.recover() == [(i, payload_for(i, 40)) for i in range(1, 4)]
        assert [(t.offset, t.dropped_bytes) for t in log.truncations] == [(size, len(garbage))]
        assert log.damage == []
    assert segment.stat().st_size == size


def test_a_valid_record_after_the_last_commit_is_dropped(tmp_path: Path) -> None:
    """Records written whole whose flush never wrote its COMMIT: nobody was told they were durable."""
    directory = tmp_path / "log"
    write_messages(directory, range(1, 4))
    segment = segment_files(directory)[-1]
    size = segment.stat().st_size
    uncommitted = log_record(ENQUEUE, struct.pack("<Q", 4) + b"never confirmed") + log_record(MARK, b"never reached")
    with segment.open("ab") as file:
        file.write(uncommitted)
    with open_file_log(directory) as log:
        assert log.recover() == [(i, payload_for(i, 40)) for i in range(1, 4)]
        assert log.mark() == b""
        assert log.truncations == [Truncation(str(segment), size, len(uncommitted), "no COMMIT after it")]
        assert log.damage == []
        log.append_enqueue(4, b"confirmed this time")
        log.flush()
    assert segment.stat().st_size == size + record_bytes(len(b"confirmed this time")) + COMMIT_BYTES
    with open_file_log(directory) as log:
        assert log.recover()[-1] == (4, b"confirmed this time")


@pytest.mark.parametrize("first_part", ["intact", "damaged"])
def test_a_flush_cut_short_over_two_segments_is_dropped_whole(tmp_path: Path, first_part: str) -> None:
    """A flush filled a segment (fsynced and closed) and died in the next one before its COMMIT: both parts go.
    A bad byte in the first part cannot be a torn write, though: that is damage, and the log is left as found."""
    directory = tmp_path / "log"
    limit = 4 * record_bytes(40)
    write_messages(directory, [1], limit)
    with open_file_log(directory, limit) as log:
        for message_id in range(2, 6):
            log.append_enqueue(message_id, payload_for(message_id, 40))
        log.flush()
    first, second = segment_files(directory)  # 1: enqueue 1, COMMIT 1, enqueue 2, 3; 2: enqueue 4, 5, COMMIT 2
    assert [record.record_type for record in records_in(first)] == [ENQUEUE, COMMIT, ENQUEUE, ENQUEUE]
    assert [record.record_type for record in records_in(second)] == [ENQUEUE, ENQUEUE, COMMIT]
    committed = record_bytes(40) + COMMIT_BYTES
    os.truncate(second, second.stat().st_size - 5)  # the crash tore the COMMIT
    if first_part == "damaged":
        flip_byte(first, committed + HEADER_BYTES + 8)
    torn_size = second.stat().st_size
    with open_file_log(directory, limit) as log:
        assert log.recover() == [(1, payload_for(1, 40))]
        if first_part == "damaged":
            assert log.damage == [Damage(str(first), committed, record_bytes(40), "CRC mismatch")]
            assert second.stat().st_size == torn_size  # nothing cut: evidence
            with pytest.raises(LogDamagedError):
                log.append_enqueue(2, b"")
            return
        assert log.damage == []
        assert log.truncations == [
            Truncation(str(first), committed, 2 * record_bytes(40), "no COMMIT after it"),
            Truncation(str(second), 0, torn_size, "no COMMIT after it"),
        ]
        assert segment_files(directory) == [first]
        assert first.stat().st_size == committed
        for message_id in range(2, 8):  # the log carries on from its last COMMIT, into new segments
            log.append_enqueue(message_id, payload_for(message_id, 40))
            log.flush()
    with open_file_log(directory, limit) as log:
        assert log.recover() == [(i, payload_for(i, 40)) for i in range(1, 8)]
        assert (log.truncations, log.damage) == ([], [])


def test_a_bad_byte_with_flushes_after_it_is_damage_and_the_rest_is_salvaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "log"
    with open_file_log(directory, 1 << 20) as log:
        for message_id in range(1, 11):
            log.append_enqueue(message_id, payload_for(message_id, 40))
            log.append_mark(f"after {message_id}".encode())
            log.flush()
    (segment,) = segment_files(directory)
    fifth = next(r for r in records_in(segment) if r.record_type == ENQUEUE and r.body[:8] == struct.pack("<Q", 5))
    flip_byte(segment, fifth.offset + HEADER_BYTES + 8 + 10)  # a payload byte of message 5
    damaged = segment.read_bytes()
    expected_damage = [Damage(str(segment), fifth.offset, fifth.length, "CRC mismatch")]
    expected = [(i, payload_for(i, 40)) for i in range(1, 11) if i != 5]
    with caplog.at_level(logging.ERROR, logger=message_log.__name__), open_file_log(directory, 1 << 20) as log:
        assert log.recover() == expected
        assert log.damage == expected_damage
        assert log.truncations == []
        assert log.mark() == b"after 10"
        assert log.intact_mark() == b"after 4"  # the position of the intact prefix
        assert (log.live_ids(), log.last_id(), log.live_count()) == ([i for i, _ in expected], 10, 9)
        refused: list[Callable[[], object]] = [
            lambda: log.append_enqueue(11, b"x"),
            lambda: log.append_remove([1]),
            lambda: log.append_mark(b"x"),
            log.flush,
        ]
        for attempt in refused:
            with pytest.raises(LogDamagedError, match=re.escape(f"message log {directory} is damaged")):
                attempt()
    errors = [record.getMessage() for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1 and str(expected_damage[0]) in errors[0]
    assert segment.read_bytes() == damaged  # left as found: evidence
    with open_file_log(directory, 1 << 20) as log:  # and found again at the next opening
        assert (log.recover(), log.damage) == (expected, expected_damage)


def test_a_damaged_remove_brings_its_messages_back(tmp_path: Path) -> None:
    """What salvage does not promise: acknowledgements lost with the damage return their messages."""
    directory = tmp_path / "log"
    with open_file_log(directory, 1 << 20) as log:
        for message_id in range(1, 7):
            log.append_enqueue(message_id, payload_for(message_id, 40))
        log.flush()
        log.append_remove([2, 3])
        log.flush()
        log.append_remove([4])
        log.append_enqueue(7, payload_for(7, 40))
        log.flush()
    (segment,) = segment_files(directory)
    first_remove = next(record for record in records_in(segment) if record.record_type == REMOVE)
    flip_byte(segment, first_remove.offset + HEADER_BYTES)
    with open_file_log(directory, 1 << 20) as log:
        assert [message_id for message_id, _ in log.recover()] == [1, 2, 3, 5, 6, 7]
        assert log.damage == [Damage(str(segment), first_remove.offset, first_remove.length, "CRC mismatch")]


def test_damage_in_an_older_segment_is_salvaged_past(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    limit = 3 * (record_bytes(40) + COMMIT_BYTES)  # three flushes per segment
    write_messages(directory, range(1, 13), segment_bytes=limit)
    segments = segment_files(directory)
    assert len(segments) == 4
    fifth = records_in(segments[1])[2]  # enqueue 4, COMMIT, enqueue 5
    assert fifth.body[:8] == struct.pack("<Q", 5)
    flip_byte(segments[1], fifth.offset + 5, 0x01)  # its header: the format version
    with open_file_log(directory, limit) as log:
        assert [m for m, _ in log.recover()] == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
        assert log.damage == [Damage(str(segments[1]), fifth.offset, fifth.length, "unknown format version")]
        assert log.truncations == []


@pytest.mark.parametrize("target", ["snapshot record", "message"])
def test_damage_inside_a_snapshot_segment_is_salvaged_past(tmp_path: Path, target: str) -> None:
    directory = tmp_path / "log"
    with open_file_log(directory, 1024) as log:
        expected = compaction_workload(log)
    snapshot = segment_files(directory)[0]
    assert is_snapshot(snapshot)
    records = records_in(snapshot)
    hit = records[0] if target == "snapshot record" else records[len(records) // 2]
    assert hit.record_type == (SNAPSHOT if target == "snapshot record" else ENQUEUE)
    flip_byte(snapshot, hit.offset + hit.length - 1)
    lost = {struct.unpack_from("<Q", hit.body)[0]} if hit.record_type == ENQUEUE else set()
    with open_file_log(directory, 1024) as log:
        assert log.recover() == [(i, payload) for i, payload in expected if i not in lost]
        assert log.damage == [Damage(str(snapshot), hit.offset, hit.length, "CRC mismatch")]


def test_damage_to_the_last_commit_cannot_be_told_from_a_torn_tail(tmp_path: Path) -> None:
    """The documented limit: it costs the last flush, and only that."""
    directory = tmp_path / "log"
    write_messages(directory, range(1, 6), segment_bytes=1 << 20)
    (segment,) = segment_files(directory)
    last_commit = records_in(segment)[-1]
    assert last_commit.record_type == COMMIT
    flip_byte(segment, last_commit.offset + HEADER_BYTES)
    with open_file_log(directory, 1 << 20) as log:
        assert [message_id for message_id, _ in log.recover()] == [1, 2, 3, 4]
        assert log.damage == []
        assert [(t.offset, t.reason) for t in log.truncations] == [
            (last_commit.offset - record_bytes(40), "no COMMIT after it")
        ]


def test_a_log_without_commit_records_keeps_the_old_policy(tmp_path: Path) -> None:
    """Written before COMMIT records existed: a bad record in the newest segment still cuts it there. Once a
    flush has added a COMMIT after the old records, a bad byte among them is damage."""
    directory = tmp_path / "log"
    directory.mkdir()
    segment = directory / f"{1:020d}.seg"
    segment.write_bytes(b"".join(log_record(ENQUEUE, struct.pack("<Q", i) + payload_for(i, 40)) for i in range(1, 11)))
    fifth = 4 * record_bytes(40)
    flip_byte(segment, fifth + HEADER_BYTES + 8 + 10)
    with open_file_log(directory, 1 << 20) as log:
        assert log.recover() == [(i, payload_for(i, 40)) for i in range(1, 5)]
        assert [(t.offset, t.dropped_bytes, t.reason) for t in log.truncations] == [
            (fifth, 6 * record_bytes(40), "CRC mismatch")
        ]
        assert log.damage == []
        log.append_enqueue(5, payload_for(5, 40))
        log.flush()
    assert segment.stat().st_size == fifth + record_bytes(40) + COMMIT_BYTES
    flip_byte(segment, record_bytes(40) + HEADER_BYTES + 8 + 10)  # message 2, an old record a COMMIT now follows
    with open_file_log(directory, 1 << 20) as log:
        assert [message_id for message_id, _ in log.recover()] == [1, 3, 4, 5]
        assert [(d.offset, d.length) for d in log.damage] == [(record_bytes(40), record_bytes(40))]
        assert log.truncations == []


def random_log(directory: Path, seed: int) -> tuple[dict[int, bytes], list[str]]:
    """A log of random flushes (enqueues, removes mostly from the head, marks) over small segments, so that it
    rotates, collects and compacts. Returns every message ever enqueued, and the compaction steps taken."""
    rng = random.Random(seed)
    enqueued: dict[int, bytes] = {}
    live: list[int] = []
    steps: list[str] = []
    next_id = 0
    with open_file_log(directory, 1024, fault_hook=steps.append) as log:
        for step in range(rng.randint(60, 160)):
            for _ in range(rng.randint(0, 4)):
                next_id += rng.choice((1, 1, 3))
                enqueued[next_id] = payload_for(next_id, rng.randint(0, 60))
                log.append_enqueue(next_id, enqueued[next_id])
                live.append(next_id)
            if live and rng.random() < 0.6:
                gone = [i for i in live[: rng.randint(1, 6)] if i % 7]  # every 7th lives long
                log.append_remove(gone)
                live = [i for i in live if i not in gone]
            if rng.random() < 0.3:
                log.append_mark(f"step {step}".encode())
            if rng.random() < 0.5:
                log.flush()
        log.append_mark(b"end")
        log.flush()
    return enqueued, steps


def replay_records(records: list[Record], skip: Record | None = None) -> tuple[dict[int, bytes], bytes, bytes]:
    """What the records describe without `skip`: the live messages, the newest mark and the mark before `skip`."""
    live: dict[int, bytes] = {}
    mark = mark_before = b""
    for record in records:
        if record == skip:
            mark_before = mark
        elif record.record_type == ENQUEUE:
            live[struct.unpack_from("<Q", record.body)[0]] = record.body[8:]
        elif record.record_type == REMOVE:
            for (message_id,) in struct.iter_unpack("<Q", record.body):
                live.pop(message_id, None)
        elif record.record_type == MARK:
            mark = record.body
    return live, mark, mark_before if skip is not None else mark


def test_any_single_bad_byte_before_the_last_commit_loses_at_most_its_record(tmp_path: Path) -> None:
    """Random logs, one random byte changed in a committed record: recovery never raises, returns only messages
    that were enqueued, and returns exactly what the records describe without the damaged one."""
    compactions = 0
    for seed in range(4):
        base = tmp_path / f"log-{seed}"
        enqueued, steps = random_log(base, seed)
        compactions += steps.count("compaction.renamed")
        segments = segment_files(base)
        assert not any(is_snapshot(segment) for segment in segments[1:])
        records = [record for segment in segments for record in records_in(segment)]
        live, mark, _ = replay_records(records)
        intact = tmp_path / f"intact-{seed}"
        shutil.copytree(base, intact)
        with open_file_log(intact, 1024) as log:  # the model reads the format as recovery does
            assert (log.recover(), log.mark(), log.damage) == (list(live.items()), mark, [])
        last_commit = max(index for index, record in enumerate(records) if record.record_type == COMMIT)
        rng = random.Random(seed)
        for trial in range(30):
            hit = records[rng.randrange(last_commit)]
            offset = hit.offset + rng.randrange(hit.length)
            where = f"seed {seed} trial {trial}: byte {offset} of {hit.path.name}, in a type {hit.record_type} record"
            damaged = tmp_path / f"damaged-{seed}-{trial}"
            shutil.copytree(base, damaged)
            flip_byte(damaged / hit.path.name, offset, rng.randint(1, 255))
            expected, expected_mark, mark_before = replay_records(records, skip=hit)
            with open_file_log(damaged, 1024) as log:
                recovered = log.recover()
                assert all(enqueued.get(message_id) == payload for message_id, payload in recovered), where
                assert recovered == list(expected.items()), where
                assert (log.mark(), log.intact_mark()) == (expected_mark, mark_before), where
                assert [(Path(d.path).name, d.offset, d.length) for d in log.damage] == [
                    (hit.path.name, hit.offset, hit.length)
                ], where
                assert log.truncations == [], where
                with pytest.raises(LogDamagedError):
                    log.flush()
            shutil.rmtree(damaged)
    assert compactions > 0  # damage landed in snapshots too, not only in segments as written


def test_segments_rotate_at_segment_bytes(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    limit = 1024
    with open_file_log(directory, limit) as log:
        for message_id in range(1, 61):
            log.append_enqueue(message_id, payload_for(message_id, 100))
            if message_id % 7 == 0:
                log.flush()
        log.append_enqueue(61, payload_for(61, 3000))  # bigger than a segment: one of its own
        log.append_enqueue(62, payload_for(62, 100))
        log.flush()
    segments = segment_files(directory)
    assert len(segments) >= 60 * record_bytes(100) // limit
    sizes = [segment.stat().st_size for segment in segments]
    assert sizes.count(record_bytes(3000)) == 1
    assert all(size <= limit for size in sizes if size != record_bytes(3000))
    assert [int(segment.stem) for segment in segments] == list(range(1, len(segments) + 1))
    with open_file_log(directory, limit) as log:
        expected = [(i, payload_for(i, 100)) for i in range(1, 61)]
        assert log.recover() == [*expected, (61, payload_for(61, 3000)), (62, payload_for(62, 100))]


def test_dead_segments_are_deleted(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    with open_file_log(directory, 1024) as log:
        for message_id in range(1, 101):
            log.append_enqueue(message_id, payload_for(message_id, 100))
            log.flush()
        assert len(segment_files(directory)) > 10
        log.append_remove(range(1, 96))
        log.flush()
        assert len(segment_files(directory)) <= 3  # 89..96, 97..100, the remove
        assert [m for m, _ in log.recover()] == [96, 97, 98, 99, 100]
    with open_file_log(directory, 1024) as log:
        assert [m for m, _ in log.recover()] == [96, 97, 98, 99, 100]


def test_a_segment_whose_removes_protect_an_older_one_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Segment 2 holds only dead messages but also the remove of message 2, stored in segment 1 next to a
    long-lived message: deleting segment 2 before segment 1 would bring message 2 back."""
    monkeypatch.setattr(message_log, "COMPACT_LIVE_FRACTION", 0.0)  # garbage collection alone
    directory = tmp_path / "log"
    limit = 2 * record_bytes(20) + COMMIT_BYTES + 8  # the first flush and one more remove fill a segment
    with open_file_log(directory, limit) as log:
        log.append_enqueue(1, payload_for(1, 20))  # long-lived
        log.append_enqueue(2, payload_for(2, 20))
        log.flush()  # segment 1: enqueue 1, enqueue 2, COMMIT
        log.append_remove([2])
        log.append_enqueue(3, payload_for(3, 20))
        log.flush()  # segment 2: remove 2, enqueue 3, COMMIT
        log.append_remove([3])
        log.append_enqueue(4, payload_for(4, 20))
        log.flush()  # segment 2: remove 3; segment 3: enqueue 4, COMMIT
        assert [int(s.stem) for s in segment_files(directory)] == [1, 2, 3]  # 2 is dead but must stay
    with open_file_log(directory, limit) as log:
        assert [m for m, _ in log.recover()] == [1, 4]
        assert [int(s.stem) for s in segment_files(directory)] == [1, 2, 3]
        log.append_remove([1])
        log.flush()  # segment 3: remove 1, COMMIT
        assert [int(s.stem) for s in segment_files(directory)] == [3]  # 1 and then 2 went
    with open_file_log(directory, limit) as log:
        assert [m for m, _ in log.recover()] == [4]


def compaction_workload(log: FileMessageLog) -> list[tuple[int, bytes]]:
    """Fill 15 segments, keep every 17th message: live data drops under a quarter and the log compacts."""
    for message_id in range(1, 201):
        log.append_enqueue(message_id, payload_for(message_id, 50))
        if message_id % 10 == 0:
            log.flush()
    log.append_remove(i for i in range(1, 181) if i % 17)
    log.flush()  # this flush compacts
    return [(i, payload_for(i, 50)) for i in range(1, 201) if i % 17 == 0 or i > 180]


def test_the_newest_mark_survives_compaction_and_collection(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    steps: list[str] = []
    with open_file_log(directory, 1024, fault_hook=steps.append) as log:
        for message_id in range(1, 201):
            log.append_enqueue(message_id, payload_for(message_id, 50))
            if message_id % 10 == 0:
                log.append_mark(f"after {message_id}".encode())
                log.flush()
        for message_id in range(201, 401):  # later flushes without a mark fill later segments
            log.append_enqueue(message_id, payload_for(message_id, 50))
            if message_id % 10 == 0:
                log.flush()
        log.append_remove(i for i in range(1, 381) if i % 17)
        log.flush()  # compacts the segments the marks were written in
        assert "compaction.renamed" in steps
        assert log.mark() == b"after 200"
    with open_file_log(directory, 1024) as log:
        assert log.mark() == b"after 200"


def test_the_segment_holding_the_newest_mark_is_not_collected(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    with open_file_log(directory, 1024) as log:
        for message_id in range(1, 31):
            log.append_enqueue(message_id, payload_for(message_id, 50))
            if message_id % 10 == 0:
                log.flush()
        log.append_mark(b"after 30")
        log.flush()
        for message_id in range(31, 121):  # later segments, no mark; every message up to 90 removed
            log.append_enqueue(message_id, payload_for(message_id, 50))
            log.append_remove([message_id - 30])
            log.flush()
        assert log.mark() == b"after 30"
    with open_file_log(directory, 1024) as log:
        assert log.mark() == b"after 30"
        assert [i for i, _ in log.recover()] == list(range(91, 121))


def test_compaction_keeps_exactly_the_live_messages_in_order(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    steps: list[str] = []
    with open_file_log(directory, 1024, fault_hook=steps.append) as log:
        expected = compaction_workload(log)
        assert "compaction.renamed" in steps
        assert log.recover() == expected
        segments = segment_files(directory)
        assert len(segments) <= 3
        assert is_snapshot(segments[0])
        assert not list(directory.glob("*.compacting"))
        # Keep going: the snapshot itself is compacted again later.
        for message_id in range(201, 401):
            log.append_enqueue(message_id, payload_for(message_id, 50))
            log.append_remove([message_id - 10])
            log.flush()
        expected = [(i, p) for i, p in expected if i <= 190] + [(i, payload_for(i, 50)) for i in range(391, 401)]
        assert steps.count("compaction.renamed") >= 2
        assert log.recover() == expected
    with open_file_log(directory, 1024) as log:
        assert log.recover() == expected
        assert log.truncations == []


class SimulatedCrash(Exception):
    pass


COMPACTION_STEPS = [
    "compaction.start",
    "compaction.written",
    "compaction.synced",
    "compaction.renamed",
    "compaction.dir_synced",
    "compaction.deleted",
]


@pytest.mark.parametrize("step", [*COMPACTION_STEPS, "compaction.written+torn", "gc.deleted"])
def test_a_crash_at_any_step_of_compaction_loses_nothing(tmp_path: Path, step: str) -> None:
    directory = tmp_path / "log"
    target = step.removesuffix("+torn")

    def crash(name: str) -> None:
        if name == target:
            raise SimulatedCrash(name)

    log = open_file_log(directory, 1024, fault_hook=crash)
    if target == "gc.deleted":
        with pytest.raises(SimulatedCrash):
            for message_id in range(1, 100):
                log.append_enqueue(message_id, payload_for(message_id, 50))
                log.append_remove([message_id - 1])
                log.flush()
        expected = [(message_id, payload_for(message_id, 50))]
    else:
        with pytest.raises(SimulatedCrash):
            compaction_workload(log)
        expected = [(i, payload_for(i, 50)) for i in range(1, 201) if i % 17 == 0 or i > 180]
    with pytest.raises(LogFailedError):  # a log that failed mid-flush refuses to go on
        log.flush()
    log.close()

    leftovers = list(directory.glob("*.compacting"))
    assert len(leftovers) == (1 if target in ("compaction.written", "compaction.synced") else 0)
    if step.endswith("+torn"):
        os.truncate(leftovers[0], leftovers[0].stat().st_size // 2)
    if target in ("compaction.renamed", "compaction.dir_synced", "compaction.deleted"):
        segments = segment_files(directory)
        snapshots = [s for s in segments if is_snapshot(s)]
        assert len(snapshots) == 1 and segments.index(snapshots[0]) > 0  # replaced segments still there

    with open_file_log(directory, 1024) as log:
        assert log.recover() == expected
        assert not list(directory.glob("*.compacting"))
        assert not any(is_snapshot(s) for s in segment_files(directory)[1:])  # superseded segments deleted
        next_id = expected[-1][0] + 1
        for message_id in range(next_id, next_id + 200):  # and the log carries on, compacting again
            log.append_enqueue(message_id, payload_for(message_id, 50))
            log.append_remove([message_id - 1] if message_id > next_id else [])
            log.flush()
        expected = [*expected, (next_id + 199, payload_for(next_id + 199, 50))]
        assert log.recover() == expected
    with open_file_log(directory, 1024) as log:
        assert log.recover() == expected


def test_one_writer_per_directory(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    first = open_file_log(directory)
    with pytest.raises(LogLockedError, match=f"pid {os.getpid()}"):
        open_file_log(directory)
    probe = (
        "import sys\n"
        "from services.queue.message_log import FileMessageLog, LogLockedError\n"
        "try:\n"
        "    FileMessageLog(sys.argv[1])\n"
        "except LogLockedError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    other = subprocess.run(
        [sys.executable, "-c", probe, str(directory)], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert other.returncode == 3, other.stderr
    assert "already open" in other.stdout
    first.close()
    with open_file_log(directory) as second:
        assert second.recover() == []


# ---------------------------------------------------------------------------------------------- a real crash

CRASH_SEGMENT_BYTES = 16 * 1024
Op = tuple[Literal["enqueue", "remove"], tuple[int, ...]]


def crash_workload(seed: int, live_ids: list[int]) -> Iterator[list[Op]]:
    """Deterministic steps (each flushed as one) from a starting state: publishes, acks mostly from the head,
    a few long-lived messages (so compaction, not only collection, reclaims space), duplicate and unknown ids."""
    rng = random.Random(seed)
    live = list(live_ids)
    next_id = max(live_ids, default=0) + 1
    while True:
        step: list[Op] = []
        for _ in range(rng.randint(1, 30)):
            step.append(("enqueue", (next_id,)))
            live.append(next_id)
            next_id += rng.choice((1, 1, 1, 2, 7))
        removable = [i for i in live if i % 41]
        if removable and rng.random() < 0.85:
            chosen = removable[: rng.randint(0, min(len(removable), 45))]
            if rng.random() < 0.3:
                chosen.append(rng.choice(removable))
            if rng.random() < 0.1:
                chosen.append(next_id + 5000)  # not enqueued (yet): a no-op
            step.append(("remove", tuple(chosen)))
            gone = set(chosen)
            live = [i for i in live if i not in gone]
        yield step


def crash_child(directory: str, seed: int) -> None:
    """Runs in a subprocess: apply crash_workload, printing each step's index once its flush returned."""
    log = FileMessageLog(directory, segment_bytes=CRASH_SEGMENT_BYTES)
    recovered = log.recover()
    print("ready", flush=True)
    for index, step in enumerate(crash_workload(seed, [message_id for message_id, _ in recovered])):
        for kind, ids in step:
            if kind == "enqueue":
                log.append_enqueue(ids[0], payload_for(ids[0]))
            else:
                log.append_remove(ids)
        log.flush()
        print(index, flush=True)


def assert_recovered_a_prefix(
    seed: int, before: list[tuple[int, bytes]], flushed_steps: int, recovered: list[tuple[int, bytes]]
) -> None:
    """`recovered` must be the state after some prefix of the operations containing every flushed step."""
    workload = crash_workload(seed, [message_id for message_id, _ in before])
    steps = [next(workload) for _ in range(flushed_steps + 1)]  # on disk: at most one step beyond the printed
    ops = [op for step in steps for op in step]
    flushed_ops = sum(len(step) for step in steps[:flushed_steps])
    state = dict(before)

    def apply(op: Op) -> None:
        kind, ids = op
        if kind == "enqueue":
            state[ids[0]] = payload_for(ids[0])
        else:
            for message_id in ids:
                state.pop(message_id, None)

    for op in ops[:flushed_ops]:
        apply(op)
    for op in ops[flushed_ops:]:
        if list(state.items()) == recovered:
            return
        apply(op)
    assert list(state.items()) == recovered, (
        f"seed {seed}: recovered {len(recovered)} messages, not the state after any prefix "
        f"that contains the {flushed_steps} flushed steps"
    )


def test_sigkill_while_writing_loses_no_flushed_message(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    timing = random.Random(2024)
    state: list[tuple[int, bytes]] = []
    total_flushed = 0
    for round_number in range(7):
        seed = 1000 + round_number
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from tests.test_message_log import crash_child as c; c(sys.argv[1], int(sys.argv[2]))",
                str(directory),
                str(seed),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        time.sleep(timing.uniform(0.02, 0.5))
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        output = child.stdout.read()  # what it printed (the pipe outlives it), buffered part included
        child.stdout.close()
        lines = output.splitlines(keepends=True)
        printed = [int(line) for line in lines if line.endswith("\n")]
        assert printed == list(range(len(printed)))
        total_flushed += len(printed)
        with FileMessageLog(str(directory), segment_bytes=CRASH_SEGMENT_BYTES) as log:
            recovered = log.recover()
        assert_recovered_a_prefix(seed, state, len(printed), recovered)
        state = recovered
    assert total_flushed > 50  # the writer got well under way
