"""Where a durable queue keeps its persistent messages: an append-only message log.

Responsible for: keeping the persistent messages of one durable queue so that
a restart of every node (a crash, kill -9, power loss) loses no message whose
enqueue was flushed. The queue's logic stays a pure state machine: it calls
`append_enqueue` / `append_remove` as it decides, `flush` (usually through
services/queue/group_commit.py) before it confirms, and `recover` once at
start. Two implementations meet one contract (tests/test_message_log.py):
`MemoryMessageLog` (nothing durable; for tests and transient queues) and
`FileMessageLog` (segment files in one directory).

The contract (`MessageLog`):
- `append_enqueue` and `append_remove` only buffer; nothing is durable until
  a `flush` that started after them returns.
- When `flush` returns, every operation appended before it was called is
  durable: it survives kill -9 and power loss. If `flush` raises, nothing is
  promised about those operations and the log refuses further use (reopen it).
- `recover` returns the live messages (enqueued, not removed) as of the last
  completed flush, in enqueue order. After a crash, a reopened log recovers the
  state after some *prefix* of the appended operations that contains at least
  everything flushed (an operation whose flush was under way may or may not be
  there; never a later operation without all earlier ones). That holds for an
  intact log: a damaged `FileMessageLog` (see below) recovers what it could
  salvage, which need not be such a prefix, and refuses to be written.
- Message ids are positive. Within one open log each enqueued id is greater
  than every id enqueued before it (even removed ones); after reopening, the
  first id must be greater than every recovered id. Enqueue order is therefore
  id order. `last_id()` is that bound: the highest id enqueued in this open
  log, recovered ones included (0 if none); the next enqueue must be above it.
  Removing an id that is not live (unknown, already removed) is a no-op
  (`append_remove` returns how many were live). `live_count` and `live_ids`
  (ascending) count every appended operation, flushed or not. With them an
  owner brings an existing log up to what it holds by appending the
  difference: removes for the ids it no longer holds, enqueues above
  `last_id()`.
- `close` does not flush: anything appended since the last flush is dropped,
  exactly as in a crash.
- A *mark* is a short opaque value the owner appends with its operations
  (`append_mark`; ringq stores the replica's position in its master's report
  stream). `mark()` is the last mark of the state `recover` returns: a
  recovered log knows how far its owner had got. Marks are ordered with the
  operations like everything else; a mark whose flush was cut short by a
  crash is not recovered, the one before it is. `intact_mark()` is the last
  mark before the first damaged region (`mark()` when there is no damage).

`FileMessageLog` on disk (one writer per directory, enforced with an
exclusive `flock` on `LOCK`; a second opener gets `LogLockedError`):
- Segment files `<seq:020d>.seg`, appended to in order; a new one is started
  when the current one would exceed `segment_bytes`. A record is a 16-byte
  header (magic, type, format version, reserved, body length, CRC32) and a
  body; the CRC covers the header fields after the magic and the body.
  Records: ENQUEUE (id, payload), REMOVE (ids), SNAPSHOT (first record of a
  compacted segment), MARK (the owner's value, at most 256 bytes), COMMIT
  (the flush number, a u64 counting up from 1 within the log and continuing
  after a reopening; recovery does not need the numbers, they make each COMMIT
  distinct so that a reader of a damaged log can tell which flushes a region
  spans). A snapshot carries the newest mark after its messages,
  and garbage collection keeps the segment holding the newest mark, so it
  survives both.
- Write order: a flush writes its records followed by one COMMIT record, in
  the same write, then fsyncs the segment; a flush that has nothing to write
  writes nothing. A segment is fsynced before the next one is created (a flush
  may spread over several; its COMMIT is in the last), and the directory is
  fsynced after every file is created, renamed or deleted. So on disk, every
  segment but the newest is complete, and the newest is intact up to its last
  fsync; beyond it a crash may leave a torn or garbled tail. A valid COMMIT
  on disk proves that the write of the flush it ends reached the disk whole,
  and every flush reported durable to its caller (its fsync returned) ends
  with one. Opening fsyncs the newest segment, so what `recover` returns is
  durable even if the previous writer died between a write and its fsync.
- Recovery replays the segments in order and classifies every *invalid
  region* (bytes that are not a valid record: short, bad magic, unknown
  version, bad CRC, malformed body, a misplaced snapshot, or an enqueue whose
  id is not above every id live before it; that last bound, not "every id
  ever enqueued", because a reopened log may reuse the ids of messages removed
  before it was reopened). Only the records up to the last valid COMMIT count;
  the ones after it belong to a flush that never completed, nobody was told
  they were durable, and they are dropped. An invalid region is:
  - a *torn tail* when it is in the newest segment and no valid COMMIT follows
    it. A crash leaves exactly this. It is dropped with every record after the
    last COMMIT: the segment holding that COMMIT is truncated just after it
    and every later segment deleted (listed in `FileMessageLog.truncations`,
    logged as a warning). A log with no COMMIT at all (written before COMMIT
    records existed) is truncated at the first invalid region of its newest
    segment instead, its valid records before it kept, as it always was.
  - *damage* when it lies in an older segment (fsynced before the next one
    existed, so no crash can tear it) or when a valid COMMIT follows it (that
    flush, and so every byte before it, was written whole: something changed
    the bytes afterwards). Recovery neither truncates nor stops there: it scans
    forward for the next valid record (magic, valid header, CRC) and replays
    every valid record after it (*salvage*). Each region is listed in
    `FileMessageLog.damage` as a `Damage(path, offset, length, reason)` and
    logged once at ERROR. A damaged log is left exactly as found on disk
    (evidence: no truncation, no deletion, no garbage collection, torn tail
    included) and is read-only: `append_*` and `flush` raise `LogDamagedError`;
    `recover`, `mark`, `intact_mark`, `live_ids`, `last_id` work. Its owner
    rewrites what it holds into a fresh log or discards it.
  Without COMMIT records the two could not be told apart: a bad record in the
  middle of the newest segment followed by good ones looks the same whether a
  crash tore it or a disk flipped a byte, and truncating there (what this log
  did before) silently dropped every later flush, confirmed enqueues and
  acknowledgements alike. The COMMIT after it decides: a crash cannot tear a
  byte and then complete a later flush.
- What salvage promises: every valid record outside the damaged regions is
  replayed, in order, so nothing is lost but what the damaged bytes carried.
  What it does not: an enqueue inside a damaged region is lost; a remove inside
  one is lost too, so a message acknowledged (and removed) there comes back; a
  mark inside one is lost, and `mark()` may describe a state the salvage no
  longer matches. `intact_mark()` is the last mark before the first damaged
  region: the position of the intact prefix, which is what a replica may claim
  (`mark()` when the log is intact). The forward scan trusts the first valid
  record it meets, so bytes inside a payload that happen to form a valid
  record can be replayed as one. And damage that hits the last COMMIT, or the
  bytes after it, cannot be told from a torn tail: at most the last flush is
  lost then. The classification also assumes the file system does not make a
  later part of one write durable without the earlier parts (ext4 and xfs
  appends in their default modes); where it does, a crash can look like
  damage, which errs the safe way (the log is refused, not silently cut).
- Garbage collection, after a flush: a closed segment is deleted when none of
  its enqueues is live and none of its removes refers to a message in a
  segment that still exists (otherwise deleting it would bring those removed
  messages back). Deletions go oldest first, each followed by a directory
  fsync.
- Compaction, after a flush: when the live bytes of the closed segments are
  less than a quarter of their size and that size exceeds one segment, the
  live messages of all closed segments (seq <= k) are copied, in order, after
  a SNAPSHOT record into `<k>.seg.compacting`, which is fsynced and renamed
  over segment k; the directory is fsynced; then segments < k are deleted.
  Invariant that makes a crash at any point safe: *recovery starts from the
  newest segment that begins with a SNAPSHOT record, ignoring (and, in an
  intact log, deleting) every lower segment, and ignores `*.compacting`
  files.* Before the rename the
  old segments are the log (the temporary file is ignored); the rename
  replaces segment k atomically with a complete, fsynced snapshot of every
  message live in segments <= k, so from then on the lower segments are
  ignored whether or not they are deleted yet. The snapshot keeps the
  messages in id order and every later segment holds greater ids, so replay
  still sees enqueues in enqueue order. A snapshot holds no COMMIT: only
  closed segments are compacted, so it is never the newest segment, and the
  COMMITs of the flushes after it vouch for it (damage in it is damage).
- Thread safety: appends may come from one thread (the event loop) while
  `flush` runs in another (asyncio.to_thread): appends take a short lock and
  never wait for a flush; flushes are serialized, and a flush that finds
  nothing to write still waits for one already under way.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "MAX_MARK_BYTES",
    "Damage",
    "FileMessageLog",
    "LogClosedError",
    "LogDamagedError",
    "LogFailedError",
    "LogLockedError",
    "MemoryMessageLog",
    "MessageLog",
    "MessageLogError",
    "Truncation",
]

_log = logging.getLogger(__name__)

MiB: Final = 1024 * 1024
DEFAULT_SEGMENT_BYTES: Final = 64 * MiB
# Compact when live data is below this fraction of the closed segments' size.
COMPACT_LIVE_FRACTION: Final = 0.25

# ------------------------------------------------------------------ records

# magic, type, format version, reserved (0), body length, CRC32(header[4:12] + body)
_HEADER: Final = struct.Struct("<4sBBHII")
HEADER_BYTES: Final = _HEADER.size
_MAGIC: Final = b"RQML"
_VERSION: Final = 1
_ENQUEUE: Final = 1
_REMOVE: Final = 2
_SNAPSHOT: Final = 3
_MARK: Final = 4
_COMMIT: Final = 5
_FIELDS: Final = struct.Struct("<BBHI")  # the header after the magic, before the CRC
_CRC: Final = struct.Struct("<I")
_ID: Final = struct.Struct("<Q")
_MAX_BODY: Final = 0xFFFF_FFFF
MAX_PAYLOAD_BYTES: Final = _MAX_BODY - _ID.size
_MAX_IDS_PER_RECORD: Final = 1 << 20
_MAX_ID: Final = (1 << 64) - 1
MAX_MARK_BYTES: Final = 256

_SEGMENT_SUFFIX: Final = ".seg"
_COMPACTING_SUFFIX: Final = ".seg.compacting"
_LOCK_NAME: Final = "LOCK"


def _record(rtype: int, body: bytes) -> bytes:
    fields = _FIELDS.pack(rtype, _VERSION, 0, len(body))
    return b"".join((_MAGIC, fields, _CRC.pack(zlib.crc32(body, zlib.crc32(fields))), body))


def _enqueue_record(message_id: int, payload: bytes) -> bytes:
    return _record(_ENQUEUE, _ID.pack(message_id) + payload)


def _remove_record(message_ids: list[int]) -> bytes:
    return _record(_REMOVE, struct.pack(f"<{len(message_ids)}Q", *message_ids))


def _commit_record(flush_number: int) -> bytes:
    return _record(_COMMIT, _ID.pack(flush_number))


def _parse_record(data: memoryview, offset: int, segment_seq: int = 0) -> tuple[int, int, int] | str:
    """(type, body start, end) of the record at `offset`, or why there is no valid record there.

    `data` is segment `segment_seq` from its start: a SNAPSHOT is valid only as the first record of the
    segment it names (with the default 0, which names none, never)."""
    if len(data) - offset < HEADER_BYTES:
        return "incomplete header"
    magic, rtype, version, reserved, length, crc = _HEADER.unpack_from(data, offset)
    if magic != _MAGIC:
        return "bad magic"
    if version != _VERSION or reserved != 0:
        return "unknown format version"
    body = offset + HEADER_BYTES
    end = body + length
    if end > len(data):
        return "incomplete body"
    if zlib.crc32(data[body:end], zlib.crc32(data[offset + 4 : offset + 12])) != crc:
        return "CRC mismatch"
    if rtype == _ENQUEUE:
        if length < _ID.size or _ID.unpack_from(data, body)[0] == 0:
            return "malformed enqueue"
    elif rtype == _REMOVE:
        if length == 0 or length % _ID.size:
            return "malformed remove"
    elif rtype == _COMMIT:
        if length != _ID.size:
            return "malformed commit"
    elif rtype == _SNAPSHOT:
        if length != _ID.size:
            return "malformed snapshot"
        if offset or _ID.unpack_from(data, body)[0] != segment_seq:
            return "misplaced snapshot"
    elif rtype == _MARK:
        if length > MAX_MARK_BYTES:
            return "malformed mark"
    else:
        return f"unknown record type {rtype}"
    return rtype, body, end


# ------------------------------------------------------------------ contract


class MessageLogError(Exception):
    """A message log cannot do what was asked."""


class LogLockedError(MessageLogError):
    """Another writer (process or open log) holds the directory's lock."""


class LogFailedError(MessageLogError):
    """An earlier flush failed: the log's state on disk is unknown; close it and reopen the directory."""


class LogClosedError(MessageLogError):
    """The log was closed."""


class LogDamagedError(MessageLogError):
    """Recovery found damage (see `FileMessageLog.damage`): the log is read-only; rewrite what it holds elsewhere."""


class MessageLog(Protocol):
    """The storage of one durable queue's persistent messages (see the module docstring for the guarantees)."""

    def append_enqueue(self, message_id: int, payload: bytes) -> None:
        """Buffer the enqueue of a message; `message_id` must exceed every id enqueued before."""
        ...

    def append_remove(self, message_ids: Iterable[int]) -> int:
        """Buffer the removal of messages; ids that are not live are ignored. Returns how many were live."""
        ...

    def flush(self) -> None:
        """Write and fsync everything appended so far: once this returns it survives kill -9 and power loss."""
        ...

    def recover(self) -> list[tuple[int, bytes]]:
        """The live messages as of the last completed flush, in enqueue order (meant for once, after opening)."""
        ...

    def append_mark(self, mark: bytes) -> None:
        """Buffer a mark (at most MAX_MARK_BYTES), ordered with the operations around it."""
        ...

    def mark(self) -> bytes:
        """The newest mark as of the last completed flush (or recovered at opening); b"" if none."""
        ...

    def intact_mark(self) -> bytes:
        """The last mark recovered before the first damaged region; `mark()` when the log is intact."""
        ...

    def live_count(self) -> int:
        """Messages enqueued and not removed, counting operations not flushed yet."""
        ...

    def live_ids(self) -> list[int]:
        """The ids enqueued and not removed, counting operations not flushed yet, ascending."""
        ...

    def last_id(self) -> int:
        """The highest id enqueued in this open log, recovered ones included (0 if none): the next must exceed it."""
        ...

    def close(self) -> None:
        """Release the log without flushing (what was appended since the last flush is dropped)."""
        ...


def _check_new_id(message_id: int, last_id: int) -> None:
    if type(message_id) is not int:
        raise TypeError(f"message id must be an int, not {type(message_id).__name__}")
    if not 0 < message_id <= _MAX_ID:
        raise ValueError(f"message id must be in 1..2**64-1, got {message_id}")
    if message_id <= last_id:
        raise ValueError(f"message ids must increase: {message_id} after {last_id}")


def _check_mark(mark: bytes) -> bytes:
    data = bytes(mark)
    if len(data) > MAX_MARK_BYTES:
        raise ValueError(f"a mark of {len(data)} bytes exceeds {MAX_MARK_BYTES}")
    return data


def _check_payload(payload: bytes) -> bytes:
    data = bytes(payload)
    if len(data) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return data


class _AppendedIds:
    """What both logs keep of the appended operations, under `_lock`: the live ids and the next id's bound."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[int] = set()  # enqueued and not removed, flushed or not
        self._last_id = 0  # every enqueue must exceed it

    def live_count(self) -> int:
        with self._lock:
            return len(self._live)

    def live_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._live)

    def last_id(self) -> int:
        with self._lock:
            return self._last_id


# ------------------------------------------------------------------ in memory


class MemoryMessageLog(_AppendedIds):
    """The contract with nothing durable: `recover` returns what was flushed into this instance.

    `reopened()` gives what a restart after a crash would see: a new log
    holding exactly the flushed state.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[tuple[int, bytes] | list[int] | bytes] = []
        self._flushed: dict[int, bytes] = {}
        self._mark = b""
        self._closed = False
        self.flushes = 0

    def append_enqueue(self, message_id: int, payload: bytes) -> None:
        data = _check_payload(payload)
        with self._lock:
            self._check_open()
            _check_new_id(message_id, self._last_id)
            self._last_id = message_id
            self._live.add(message_id)
            self._pending.append((message_id, data))

    def append_remove(self, message_ids: Iterable[int]) -> int:
        with self._lock:
            self._check_open()
            known: list[int] = []
            for message_id in message_ids:
                if message_id in self._live:
                    self._live.discard(message_id)
                    known.append(message_id)
            if known:
                self._pending.append(known)
            return len(known)

    def flush(self) -> None:
        with self._lock:
            self._check_open()
            for op in self._pending:
                if isinstance(op, bytes):
                    self._mark = op
                elif isinstance(op, tuple):
                    self._flushed[op[0]] = op[1]
                else:
                    for message_id in op:
                        del self._flushed[message_id]
            self._pending = []
            self.flushes += 1

    def recover(self) -> list[tuple[int, bytes]]:
        with self._lock:
            self._check_open()
            return list(self._flushed.items())

    def append_mark(self, mark: bytes) -> None:
        data = _check_mark(mark)
        with self._lock:
            self._check_open()
            self._pending.append(data)

    def mark(self) -> bytes:
        with self._lock:
            return self._mark

    def intact_mark(self) -> bytes:
        return self.mark()  # nothing here can be damaged

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._pending = []

    def reopened(self) -> MemoryMessageLog:
        """A new log holding exactly what was flushed here (this one is left as it is)."""
        with self._lock:
            other = MemoryMessageLog()
            other._flushed = dict(self._flushed)
            other._live = set(self._flushed)
            other._last_id = max(self._flushed, default=0)
            other._mark = self._mark
            return other

    def _check_open(self) -> None:
        if self._closed:
            raise LogClosedError("the message log is closed")


# ------------------------------------------------------------------ on disk


@dataclass(frozen=True)
class Truncation:
    """A torn tail dropped at recovery: from `offset` in `path`, `dropped_bytes` that no COMMIT vouched for.

    Cut away on disk (a segment after the one holding the last COMMIT is deleted), unless the log is damaged:
    a damaged log is left as found.
    """

    path: str
    offset: int
    dropped_bytes: int
    reason: str


@dataclass(frozen=True)
class Damage:
    """Bytes recovery skipped that no crash explains: from `offset` in `path`, `length` bytes of no valid record."""

    path: str
    offset: int
    length: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path} at {self.offset}, {self.length} bytes: {self.reason}"


@dataclass
class _Segment:
    seq: int
    path: str
    size: int = 0
    live: int = 0  # live enqueues stored here
    live_bytes: int = 0  # their records' size
    # Older segments holding messages that removes stored here removed: this
    # segment must outlive them.
    deps: set[int] = field(default_factory=set)
    closed: bool = False
    snapshot: bool = False


class _Location(NamedTuple):
    seq: int
    offset: int
    length: int  # of the whole record


class _Pending(NamedTuple):
    record: bytes
    enqueued: int  # the id, or 0 for a remove, a mark or a commit
    removed: list[int]
    mark: bytes | None = None


def _place(segments: dict[int, _Segment], where: dict[int, _Location], message_id: int, location: _Location) -> None:
    """Record that live message `message_id` is stored at `location` (ids must arrive ascending)."""
    where[message_id] = location
    home = segments[location.seq]
    home.live += 1
    home.live_bytes += location.length


def _forget(segments: dict[int, _Segment], where: dict[int, _Location], message_id: int, removed_in: int) -> None:
    """Record the remove of `message_id`, stored in segment `removed_in` (a no-op if it is not live)."""
    location = where.pop(message_id, None)
    if location is None:
        return
    home = segments[location.seq]
    home.live -= 1
    home.live_bytes -= location.length
    if location.seq != removed_in:
        segments[removed_in].deps.add(location.seq)


# What replay finds, held back until a COMMIT proves the flush it belongs to completed. An enqueue, by far the
# most common, is a plain (id, location) pair: a NamedTuple per record would make reopening a third slower.


class _Remove(NamedTuple):
    seq: int
    offset: int
    end: int
    message_ids: tuple[int, ...]


class _Mark(NamedTuple):
    seq: int
    offset: int
    end: int
    mark: bytes


class _Invalid(NamedTuple):
    seq: int
    offset: int
    end: int
    reason: str


_Found = tuple[int, _Location] | _Remove | _Mark | _Invalid

_UNCOMMITTED: Final = "no COMMIT after it"


class _Replay:
    """Rebuilds a log's state from the bytes of its segments, oldest first, and classifies what is not valid.

    Pure: the caller reads the files and carries out the verdict (`keep_bytes`, `doomed`). Each record is held
    back until a COMMIT follows it, then applied; an invalid region met before a COMMIT is damage. `finish`
    settles what follows the last COMMIT (see the module docstring for the policy).
    """

    def __init__(self, newest_seq: int) -> None:
        self.newest_seq = newest_seq
        self.segments: dict[int, _Segment] = {}
        self.where: dict[int, _Location] = {}  # live messages, ascending ids
        self.mark = b""
        self.mark_seq = 0
        self.intact_mark = b""  # the mark before the first damaged region
        self.flush_number = 0  # in the last valid COMMIT
        self.damage: list[Damage] = []
        self.truncations: list[Truncation] = []
        self.keep_bytes: dict[int, int] = {}  # segment -> the size it is cut to (its torn tail dropped)
        self.doomed: list[int] = []  # segments wholly after the last COMMIT: to delete
        self._last_commit: tuple[int, int] | None = None  # (segment, end) of the last valid COMMIT
        self._unproven: list[_Found] = []  # found since the last COMMIT

    def read(self, segment: _Segment, data: bytes) -> None:
        """Replay the next segment, whose whole content is `data`."""
        seq = segment.seq
        self.segments[seq] = segment
        segment.size = len(data)
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            parsed = _parse_record(view, offset, seq)
            if isinstance(parsed, str):
                end = self._next_valid(data, view, offset, seq)
                self._unproven.append(_Invalid(seq, offset, end, parsed))
                offset = end
                continue
            rtype, body, end = parsed
            if rtype == _ENQUEUE:
                self._unproven.append((_ID.unpack_from(view, body)[0], _Location(seq, offset, end - offset)))
            elif rtype == _REMOVE:
                ids = struct.unpack_from(f"<{(end - body) // _ID.size}Q", view, body)
                self._unproven.append(_Remove(seq, offset, end, ids))
            elif rtype == _MARK:
                self._unproven.append(_Mark(seq, offset, end, bytes(view[body:end])))
            elif rtype == _COMMIT:
                self._apply(self._unproven, proven=True)
                self._unproven = []
                self.flush_number = _ID.unpack_from(view, body)[0]
                self._last_commit = (seq, end)
            else:  # the snapshot replay starts from (the caller skipped the segments it replaced)
                segment.snapshot = True
            offset = end

    def finish(self) -> None:
        """Settle what follows the last COMMIT (everything, in a log without one)."""
        tail, self._unproven = self._unproven, []
        if self._last_commit is None:  # written before COMMIT records: as this log always did
            torn = self._apply(tail, proven=False)
            if torn is not None:
                self._cut(torn.seq, torn.offset, [torn])
        else:
            for found in tail:  # uncommitted records are dropped; but no crash tears an older segment
                if isinstance(found, _Invalid) and found.seq != self.newest_seq:
                    self._damaged(found)
            self._cut(*self._last_commit, tail)
        if not self.damage:
            self.intact_mark = self.mark

    def _apply(self, held_back: list[_Found], *, proven: bool) -> _Invalid | None:
        """Apply records in order. An invalid one is damage when `proven` (a COMMIT follows) or in an older
        segment; otherwise it begins a torn tail: it is returned, and nothing after it is applied."""
        where, segments = self.where, self.segments
        for found in held_back:
            if isinstance(found, _Remove):
                for message_id in found.message_ids:
                    _forget(segments, where, message_id, found.seq)
                continue
            if isinstance(found, _Mark):
                self.mark, self.mark_seq = found.mark, found.seq
                continue
            if isinstance(found, _Invalid):
                problem = found
            else:
                message_id, location = found
                if message_id > next(reversed(where), 0):
                    _place(segments, where, message_id, location)
                    continue
                end = location.offset + location.length
                problem = _Invalid(location.seq, location.offset, end, f"enqueue of id {message_id} out of order")
            if not proven and problem.seq == self.newest_seq:
                return problem
            self._damaged(problem)
        return None

    def _damaged(self, problem: _Invalid) -> None:
        if not self.damage:
            self.intact_mark = self.mark
        path = self.segments[problem.seq].path
        last = self.damage[-1] if self.damage else None
        if last is not None and last.path == path and last.offset + last.length == problem.offset:
            self.damage[-1] = Damage(path, last.offset, problem.end - last.offset, last.reason)  # one region
        else:
            self.damage.append(Damage(path, problem.offset, problem.end - problem.offset, problem.reason))

    def _cut(self, seq: int, offset: int, dropped: list[_Found]) -> None:
        """Drop everything from `offset` in segment `seq` on: the rest of it, and every later segment."""
        first_invalid: dict[int, _Invalid] = {}
        for found in dropped:
            if isinstance(found, _Invalid):
                first_invalid.setdefault(found.seq, found)
        for later, segment in self.segments.items():
            if later < seq:
                continue
            keep = offset if later == seq else 0
            if later == seq:
                if segment.size > keep:
                    self.keep_bytes[later] = keep
            else:
                self.doomed.append(later)
            if segment.size > keep:
                first = first_invalid.get(later)
                reason = first.reason if first is not None and first.offset == keep else _UNCOMMITTED
                self.truncations.append(Truncation(segment.path, keep, segment.size - keep, reason))

    @staticmethod
    def _next_valid(data: bytes, view: memoryview, offset: int, seq: int) -> int:
        """Where the first valid record after `offset` starts; the end of `data` if none does."""
        candidate = data.find(_MAGIC, offset + 1)
        while candidate >= 0 and isinstance(_parse_record(view, candidate, seq), str):
            candidate = data.find(_MAGIC, candidate + 1)
        return len(data) if candidate < 0 else candidate


def _fsync(fd: int) -> None:
    if sys.platform == "darwin":  # fsync does not reach the disk there
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    else:
        os.fsync(fd)


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class FileMessageLog(_AppendedIds):
    """The contract in segment files in one directory (see the module docstring for the format and guarantees).

    Opening replays the directory (cutting away a torn tail, listed in
    `truncations`; or finding damage, listed in `damage`, and then refusing to
    write); `recover()` then reads the live messages. `fault_hook`, for tests, is called with the name
    of each step of compaction and garbage collection ("compaction.start",
    "compaction.written", "compaction.synced", "compaction.renamed",
    "compaction.dir_synced", "compaction.deleted", "gc.deleted"); an exception
    from it stops the log there, as a crash would, and leaves it failed.
    """

    def __init__(
        self,
        directory: str,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        *,
        fault_hook: Callable[[str], None] | None = None,
    ) -> None:
        if segment_bytes <= HEADER_BYTES:
            raise ValueError(f"segment_bytes must exceed {HEADER_BYTES}")
        self.directory = os.path.abspath(directory)
        self.segment_bytes = segment_bytes
        self.truncations: list[Truncation] = []
        self.damage: list[Damage] = []  # empty when the log is intact; read-only when it is not
        self._hook = fault_hook
        super().__init__()  # the appended (not yet written) state, under `_lock`
        self._flush_lock = threading.Lock()  # the written state: segments, locations, files
        self._pending: list[_Pending] = []
        self._segments: dict[int, _Segment] = {}
        self._where: dict[int, _Location] = {}  # live on disk, ascending ids
        self._active: _Segment | None = None
        self._active_fd = -1
        self._next_seq = 1
        self._closed = False
        self._failed: BaseException | None = None
        self._compact_backoff_bytes = 0
        self._mark = b""  # the newest mark written (recovered at opening)
        self._mark_seq = 0  # the segment holding it: never collected while it does
        self._intact_mark = b""  # the last mark before the first damaged region
        self._flush_number = 0  # in the last COMMIT written
        self._lock_fd = self._take_lock()
        try:
            self._replay()
            if not self.damage:
                self._collect_garbage()
        except BaseException:
            self._release_files()
            raise

    # ---------------------------------------------------------------- contract

    def append_enqueue(self, message_id: int, payload: bytes) -> None:
        _check_new_id(message_id, 0)
        record = _enqueue_record(message_id, _check_payload(payload))  # outside the lock: may be large
        with self._lock:
            self._check_writable()
            _check_new_id(message_id, self._last_id)
            self._last_id = message_id
            self._live.add(message_id)
            self._pending.append(_Pending(record, message_id, []))

    def append_remove(self, message_ids: Iterable[int]) -> int:
        with self._lock:
            self._check_writable()
            known: list[int] = []
            for message_id in message_ids:
                if message_id in self._live:
                    self._live.discard(message_id)
                    known.append(message_id)
            for start in range(0, len(known), _MAX_IDS_PER_RECORD):
                chunk = known[start : start + _MAX_IDS_PER_RECORD]
                self._pending.append(_Pending(_remove_record(chunk), 0, chunk))
            return len(known)

    def flush(self) -> None:
        with self._flush_lock:
            self._check_writable()
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
            self._flush_number += 1
            pending.append(_Pending(_commit_record(self._flush_number), 0, []))  # last, in the same write
            try:
                self._write(pending)
                self._collect_garbage()
                self._maybe_compact()
            except BaseException as exc:
                self._failed = exc
                raise

    def recover(self) -> list[tuple[int, bytes]]:
        with self._flush_lock:
            self._check_usable()
            result: list[tuple[int, bytes]] = []
            by_segment: dict[int, list[tuple[int, _Location]]] = {}
            for message_id, where in self._where.items():
                by_segment.setdefault(where.seq, []).append((message_id, where))
            for seq in sorted(by_segment):
                segment = self._segments[seq]
                with open(segment.path, "rb") as file:
                    whole = segment.live_bytes * 2 >= segment.size
                    data = memoryview(file.read()) if whole else None
                    for message_id, where in by_segment[seq]:
                        if data is not None:
                            record = data[where.offset : where.offset + where.length]
                        else:
                            record = memoryview(os.pread(file.fileno(), where.length, where.offset))
                        result.append((message_id, self._payload(record, message_id, segment.path, where.offset)))
            return result

    def append_mark(self, mark: bytes) -> None:
        record = _record(_MARK, _check_mark(mark))
        with self._lock:
            self._check_writable()
            self._pending.append(_Pending(record, 0, [], mark=bytes(mark)))

    def mark(self) -> bytes:
        with self._flush_lock:
            return self._mark

    def intact_mark(self) -> bytes:
        with self._flush_lock:
            return self._intact_mark if self.damage else self._mark

    def close(self) -> None:
        with self._flush_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending = []
            self._release_files()

    def __enter__(self) -> FileMessageLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- opening

    def _take_lock(self) -> int:
        if not os.path.isdir(self.directory):
            os.makedirs(self.directory, exist_ok=True)
            _fsync_directory(os.path.dirname(self.directory))
        path = os.path.join(self.directory, _LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LogLockedError(
                f"message log {self.directory} is already open (lock held by pid {holder}): one writer per directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _replay(self) -> None:
        seqs: list[int] = []
        leftovers: list[str] = []
        for name in os.listdir(self.directory):
            if name.endswith(_COMPACTING_SUFFIX):
                leftovers.append(name)  # a compaction that never reached its rename: ignored
            elif name.endswith(_SEGMENT_SUFFIX) and name[: -len(_SEGMENT_SUFFIX)].isdigit():
                seqs.append(int(name[: -len(_SEGMENT_SUFFIX)]))
        seqs.sort()
        start = self._snapshot_start(seqs)
        replay = _Replay(newest_seq=seqs[-1] if seqs else 0)
        for seq in seqs[start:]:
            with open(self._path(seq), "rb") as file:
                replay.read(_Segment(seq, self._path(seq)), file.read())
        replay.finish()
        self.damage, self.truncations = replay.damage, replay.truncations
        self._segments, self._where = replay.segments, replay.where
        self._mark, self._mark_seq, self._intact_mark = replay.mark, replay.mark_seq, replay.intact_mark
        self._flush_number = replay.flush_number
        self._live = set(self._where)
        self._last_id = next(reversed(self._where), 0)
        for cut in self.truncations:
            kept = " (not cut away: the log is damaged)" if self.damage else ""
            _log.warning("message log %s: dropping a torn tail%s: %s", self.directory, kept, cut)
        if self.damage:  # evidence: nothing on disk changes, and nothing will be written
            for damage in self.damage:
                _log.error("message log %s: damaged (salvaged past it, now read-only): %s", self.directory, damage)
            if seqs:
                self._sync_newest(self._path(seqs[-1]), writable=False)
            return
        for seq, size in replay.keep_bytes.items():
            self._truncate(seq, size)
        doomed = [self._path(seq) for seq in replay.doomed]  # wholly after the last COMMIT
        superseded = [self._path(seq) for seq in seqs[:start]]  # below the snapshot: already replaced by it
        for path in [*doomed, *superseded, *(os.path.join(self.directory, name) for name in leftovers)]:
            os.unlink(path)
        if doomed or superseded or leftovers:
            _fsync_directory(self.directory)
        for seq in replay.doomed:
            del self._segments[seq]
        if self._segments:
            newest = max(self._segments)
            for seq, segment in self._segments.items():
                segment.closed = seq != newest
            self._next_seq = newest + 1
            self._active = self._segments[newest]
            self._active_fd = self._sync_newest(self._active.path, writable=True)

    def _snapshot_start(self, seqs: list[int]) -> int:
        """The index in `seqs` of the newest segment that begins with its SNAPSHOT record (0 if none does)."""
        for index in range(len(seqs) - 1, 0, -1):
            with open(self._path(seqs[index]), "rb") as file:
                head = memoryview(file.read(HEADER_BYTES + _ID.size))
            parsed = _parse_record(head, 0, seqs[index])
            if isinstance(parsed, tuple) and parsed[0] == _SNAPSHOT:
                return index
        return 0

    def _sync_newest(self, path: str, *, writable: bool) -> int:
        """Fsync the newest segment: the previous writer may have died between a write and its fsync, and what
        we recover must be durable before anything is written after it (or a power loss could keep the later
        writes only). Returns the file opened for appending when `writable`, else -1."""
        fd = os.open(path, (os.O_WRONLY | os.O_APPEND if writable else os.O_RDONLY) | os.O_CLOEXEC)
        try:
            _fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        if writable:
            return fd
        os.close(fd)
        return -1

    def _truncate(self, seq: int, size: int) -> None:
        fd = os.open(self._path(seq), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            _fsync(fd)
        finally:
            os.close(fd)
        self._segments[seq].size = size

    # ---------------------------------------------------------------- writing

    def _write(self, pending: list[_Pending]) -> None:
        placed: list[tuple[_Pending, int, int]] = []
        chunk: list[bytes] = []
        chunk_bytes = 0
        segment = self._active
        for op in pending:
            size = len(op.record)
            if segment is None or (
                segment.size + chunk_bytes > 0 and segment.size + chunk_bytes + size > self.segment_bytes
            ):
                if segment is not None:
                    self._append(segment, chunk)
                    chunk, chunk_bytes = [], 0
                    _fsync(self._active_fd)  # complete before the next segment exists
                    os.close(self._active_fd)
                    self._active_fd = -1
                    segment.closed = True
                segment = self._new_segment()
            placed.append((op, segment.seq, segment.size + chunk_bytes))
            chunk.append(op.record)
            chunk_bytes += size
        assert segment is not None
        self._append(segment, chunk)
        _fsync(self._active_fd)
        for op, seq, offset in placed:
            if op.mark is not None:
                self._mark, self._mark_seq = op.mark, seq
            elif op.enqueued:
                _place(self._segments, self._where, op.enqueued, _Location(seq, offset, len(op.record)))
            else:  # a remove, or the commit (which removes nothing)
                for message_id in op.removed:
                    _forget(self._segments, self._where, message_id, seq)

    def _append(self, segment: _Segment, chunk: list[bytes]) -> None:
        data = b"".join(chunk)
        _write_all(self._active_fd, data)
        segment.size += len(data)

    def _new_segment(self) -> _Segment:
        seq = self._next_seq
        self._next_seq += 1
        segment = _Segment(seq, self._path(seq))
        self._active_fd = os.open(
            segment.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644
        )
        self._segments[seq] = segment
        self._active = segment
        _fsync_directory(self.directory)
        return segment

    # ---------------------------------------------------------------- reclaiming

    def _collect_garbage(self) -> None:
        for seq in sorted(self._segments):
            segment = self._segments[seq]
            if not segment.closed or segment.live or segment.deps or seq == self._mark_seq:
                continue
            os.unlink(segment.path)
            _fsync_directory(self.directory)  # before anything that depended on this deletion
            del self._segments[seq]
            for other in self._segments.values():
                other.deps.discard(seq)
            self._fault("gc.deleted")

    def _maybe_compact(self) -> None:
        closed = [segment for segment in self._segments.values() if segment.closed]
        closed_bytes = sum(segment.size for segment in closed)
        live_bytes = sum(segment.live_bytes for segment in closed)
        if closed_bytes <= max(self.segment_bytes, self._compact_backoff_bytes):
            return
        if live_bytes >= closed_bytes * COMPACT_LIVE_FRACTION:
            return
        victims = sorted(segment.seq for segment in closed)
        try:
            moved, size = self._write_snapshot(victims)
        except (OSError, MessageLogError) as exc:
            self._compact_backoff_bytes = closed_bytes * 2
            _log.error("message log %s: compaction failed, old segments kept: %s", self.directory, exc)
            return
        self._commit_snapshot(victims, moved, size)

    def _write_snapshot(self, victims: list[int]) -> tuple[list[tuple[int, _Location]], int]:
        """Write the live messages of `victims` into `<last victim>.seg.compacting`, fsynced."""
        last = victims[-1]
        temporary = os.path.join(self.directory, f"{last:020d}{_COMPACTING_SUFFIX}")
        victim_set = set(victims)
        self._fault("compaction.start")
        moved: list[tuple[int, _Location]] = []
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            try:
                out = [_record(_SNAPSHOT, _ID.pack(last))]
                position = len(out[0])
                buffered = position
                sources: dict[int, int] = {}
                try:
                    for message_id, where in self._where.items():
                        if where.seq not in victim_set:
                            continue
                        if where.seq not in sources:
                            sources[where.seq] = os.open(self._path(where.seq), os.O_RDONLY | os.O_CLOEXEC)
                        record = os.pread(sources[where.seq], where.length, where.offset)
                        self._payload(memoryview(record), message_id, self._path(where.seq), where.offset)
                        out.append(record)
                        moved.append((message_id, _Location(last, position, where.length)))
                        position += where.length
                        buffered += where.length
                        if buffered >= MiB:
                            _write_all(fd, b"".join(out))
                            out, buffered = [], 0
                finally:
                    for source in sources.values():
                        os.close(source)
                if self._mark:
                    out.append(_record(_MARK, self._mark))  # the newest mark outlives the segments it was in
                    position += len(out[-1])
                _write_all(fd, b"".join(out))
                self._fault("compaction.written")
                _fsync(fd)
            finally:
                os.close(fd)
            self._fault("compaction.synced")
            os.rename(temporary, self._path(last))  # the commit point
        except (OSError, MessageLogError):
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        return moved, position

    def _commit_snapshot(self, victims: list[int], moved: list[tuple[int, _Location]], size: int) -> None:
        self._fault("compaction.renamed")
        _fsync_directory(self.directory)
        last = victims[-1]
        for seq in victims:
            del self._segments[seq]
        self._segments[last] = _Segment(last, self._path(last), size=size, closed=True, snapshot=True)
        for message_id, where in moved:
            _place(self._segments, self._where, message_id, where)
        if self._mark_seq in victims:
            self._mark_seq = last  # the snapshot carries it
        for other in self._segments.values():
            other.deps.difference_update(victims)  # what they removed is in no file now
        self._fault("compaction.dir_synced")
        for seq in victims[:-1]:
            os.unlink(self._path(seq))
            self._fault("compaction.deleted")
        _fsync_directory(self.directory)  # before the snapshot itself may be collected

    # ---------------------------------------------------------------- helpers

    def _payload(self, record: memoryview, message_id: int, path: str, offset: int) -> bytes:
        parsed = _parse_record(record, 0)
        if (
            isinstance(parsed, str)
            or parsed[0] != _ENQUEUE
            or parsed[2] != len(record)
            or _ID.unpack_from(record, parsed[1])[0] != message_id
        ):
            problem = parsed if isinstance(parsed, str) else "unexpected record"
            raise MessageLogError(f"{path} at {offset}: the record of message {message_id} changed on disk: {problem}")
        return bytes(record[parsed[1] + _ID.size :])

    def _path(self, seq: int) -> str:
        return os.path.join(self.directory, f"{seq:020d}{_SEGMENT_SUFFIX}")

    def _fault(self, step: str) -> None:
        if self._hook is not None:
            self._hook(step)

    def _check_usable(self) -> None:
        if self._closed:
            raise LogClosedError(f"message log {self.directory} is closed")
        if self._failed is not None:
            raise LogFailedError(
                f"message log {self.directory} failed in an earlier flush ({self._failed!r}); reopen it"
            ) from self._failed

    def _check_writable(self) -> None:
        self._check_usable()
        if self.damage:
            more = f" and {len(self.damage) - 1} more" if len(self.damage) > 1 else ""
            raise LogDamagedError(
                f"message log {self.directory} is damaged ({self.damage[0]}{more}): it is read-only; "
                "rewrite what it holds into a fresh log or discard it"
            )

    def _release_files(self) -> None:
        if self._active_fd >= 0:
            os.close(self._active_fd)
            self._active_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
