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
  there; never a later operation without all earlier ones).
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
  crash is not recovered, the one before it is.

`FileMessageLog` on disk (one writer per directory, enforced with an
exclusive `flock` on `LOCK`; a second opener gets `LogLockedError`):
- Segment files `<seq:020d>.seg`, appended to in order; a new one is started
  when the current one would exceed `segment_bytes`. A record is a 16-byte
  header (magic, type, format version, reserved, body length, CRC32) and a
  body; the CRC covers the header fields after the magic and the body.
  Records: ENQUEUE (id, payload), REMOVE (ids), SNAPSHOT (first record of a
  compacted segment), MARK (the owner's value, at most 256 bytes). A snapshot
  carries the newest mark after its messages, and garbage collection keeps
  the segment holding the newest mark, so it survives both.
- Write order: a flush writes its records and fsyncs the segment; a segment is
  fsynced before the next one is created, and the directory is fsynced after
  every file is created, renamed or deleted. So on disk, every segment but
  the newest is complete, and the newest is intact up to its last fsync;
  beyond it a crash may leave a torn or garbled tail. Opening fsyncs the
  newest segment, so what `recover` returns is durable even if the previous
  writer died between a write and its fsync.
- Recovery replays the segments in order. Policy for a record that is not
  valid (short, bad magic, bad CRC, malformed): the segment is truncated at
  that record and everything after it *in that segment* is dropped, never
  returned. In the newest segment that is the torn tail of a write a crash
  interrupted, beyond the last completed flush. In an older segment it cannot
  come from a crash (those were fsynced before the next segment was created):
  it is media corruption; the rest of that segment is lost, the later segments
  are still replayed (keeping what can be kept rather than discarding
  confirmed messages), and it is logged as an error. Every truncation is
  listed in `FileMessageLog.truncations`.
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
  newest segment that begins with a SNAPSHOT record, ignoring (and deleting)
  every lower segment, and ignores `*.compacting` files.* Before the rename the
  old segments are the log (the temporary file is ignored); the rename
  replaces segment k atomically with a complete, fsynced snapshot of every
  message live in segments <= k, so from then on the lower segments are
  ignored whether or not they are deleted yet. The snapshot keeps the
  messages in id order and every later segment holds greater ids, so replay
  still sees enqueues in enqueue order.
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
    "FileMessageLog",
    "LogClosedError",
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


def _parse_record(data: memoryview, offset: int) -> tuple[int, int, int] | str:
    """(type, body start, end) of the record at `offset`, or why there is no valid record there."""
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
    elif rtype == _SNAPSHOT:
        if length != _ID.size:
            return "malformed snapshot"
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


# ------------------------------------------------------------------ in memory


class MemoryMessageLog:
    """The contract with nothing durable: `recover` returns what was flushed into this instance.

    `reopened()` gives what a restart after a crash would see: a new log
    holding exactly the flushed state.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[int, bytes] | list[int] | bytes] = []
        self._flushed: dict[int, bytes] = {}
        self._mark = b""
        self._live: set[int] = set()
        self._last_id = 0
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

    def live_count(self) -> int:
        with self._lock:
            return len(self._live)

    def live_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._live)

    def last_id(self) -> int:
        with self._lock:
            return self._last_id

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
    """A segment cut short at recovery: from `offset`, `dropped_bytes` were not valid records."""

    path: str
    offset: int
    dropped_bytes: int
    reason: str
    newest_segment: bool


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
    enqueued: int  # the id, or 0 for a remove or a mark
    removed: list[int]
    mark: bytes | None = None


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


class FileMessageLog:
    """The contract in segment files in one directory (see the module docstring for the format and guarantees).

    Opening replays the directory (truncating torn tails); `recover()` then
    reads the live messages. `fault_hook`, for tests, is called with the name
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
        self._hook = fault_hook
        self._lock = threading.Lock()  # the appended (not yet written) state
        self._flush_lock = threading.Lock()  # the written state: segments, locations, files
        self._pending: list[_Pending] = []
        self._live: set[int] = set()
        self._last_id = 0
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
        self._lock_fd = self._take_lock()
        try:
            self._replay()
            self._collect_garbage()
        except BaseException:
            self._release_files()
            raise

    # ---------------------------------------------------------------- contract

    def append_enqueue(self, message_id: int, payload: bytes) -> None:
        _check_new_id(message_id, 0)
        record = _enqueue_record(message_id, _check_payload(payload))  # outside the lock: may be large
        with self._lock:
            self._check_usable()
            _check_new_id(message_id, self._last_id)
            self._last_id = message_id
            self._live.add(message_id)
            self._pending.append(_Pending(record, message_id, []))

    def append_remove(self, message_ids: Iterable[int]) -> int:
        with self._lock:
            self._check_usable()
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
            self._check_usable()
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
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
            self._check_usable()
            self._pending.append(_Pending(record, 0, [], mark=bytes(mark)))

    def mark(self) -> bytes:
        with self._flush_lock:
            return self._mark

    def live_count(self) -> int:
        with self._lock:
            return len(self._live)

    def live_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._live)

    def last_id(self) -> int:
        with self._lock:
            return self._last_id

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
        leftovers = False
        for name in os.listdir(self.directory):
            if name.endswith(_COMPACTING_SUFFIX):
                os.unlink(os.path.join(self.directory, name))  # a compaction that never reached its rename
                leftovers = True
            elif name.endswith(_SEGMENT_SUFFIX) and name[: -len(_SEGMENT_SUFFIX)].isdigit():
                seqs.append(int(name[: -len(_SEGMENT_SUFFIX)]))
        seqs.sort()
        superseded: list[int] = []
        for index, seq in enumerate(seqs):
            segment = _Segment(seq, self._path(seq), closed=index < len(seqs) - 1)
            self._segments[seq] = segment
            with open(segment.path, "rb") as file:
                data = memoryview(file.read())
            offset = 0
            problem: str | None = None
            while offset < len(data):
                parsed = _parse_record(data, offset)
                if isinstance(parsed, str):
                    problem = parsed
                    break
                rtype, body, end = parsed
                if rtype == _SNAPSHOT:
                    if offset != 0 or _ID.unpack_from(data, body)[0] != seq:
                        problem = "misplaced snapshot"
                        break
                    superseded.extend(older for older in self._segments if older != seq)
                    self._segments = {seq: segment}
                    self._where.clear()
                    segment.snapshot = True
                elif rtype == _ENQUEUE:
                    message_id = _ID.unpack_from(data, body)[0]
                    if self._where and message_id <= next(reversed(self._where)):
                        problem = f"enqueue of id {message_id} out of order"
                        break
                    self._where[message_id] = _Location(seq, offset, end - offset)
                    segment.live += 1
                    segment.live_bytes += end - offset
                elif rtype == _MARK:
                    self._mark, self._mark_seq = bytes(data[body:end]), seq
                else:
                    for (message_id,) in _ID.iter_unpack(data[body:end]):
                        self._forget(message_id, segment)
                offset = end
            segment.size = offset
            if problem is not None:
                self._truncate(segment, len(data), problem, newest=index == len(seqs) - 1)
        for seq in superseded:  # below a snapshot: already replaced by it
            os.unlink(self._path(seq))
        if superseded or leftovers:
            _fsync_directory(self.directory)
        if seqs:
            self._next_seq = seqs[-1] + 1
            self._active = self._segments[seqs[-1]]
            self._active_fd = os.open(self._active.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            # The previous writer may have died between a write and its fsync: make what we recover durable
            # before anything is written after it (or a power loss could keep the later writes only).
            _fsync(self._active_fd)
        self._live = set(self._where)
        self._last_id = next(reversed(self._where), 0)

    def _truncate(self, segment: _Segment, file_size: int, reason: str, *, newest: bool) -> None:
        cut = Truncation(segment.path, segment.size, file_size - segment.size, reason, newest)
        self.truncations.append(cut)
        if newest:
            _log.warning("message log %s: dropping a torn tail: %s", self.directory, cut)
        else:
            _log.error(
                "message log %s: corrupt record in an older segment, rest of it dropped: %s", self.directory, cut
            )
        fd = os.open(segment.path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, segment.size)
            _fsync(fd)
        finally:
            os.close(fd)

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
                self._where[op.enqueued] = _Location(seq, offset, len(op.record))
                self._segments[seq].live += 1
                self._segments[seq].live_bytes += len(op.record)
            else:
                for message_id in op.removed:
                    self._forget(message_id, self._segments[seq])

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

    def _forget(self, message_id: int, removed_in: _Segment) -> None:
        where = self._where.pop(message_id, None)
        if where is None:
            return
        home = self._segments[where.seq]
        home.live -= 1
        home.live_bytes -= where.length
        if where.seq != removed_in.seq:
            removed_in.deps.add(where.seq)

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
        snapshot = _Segment(last, self._path(last), size=size, closed=True, snapshot=True)
        for message_id, where in moved:
            self._where[message_id] = where
            snapshot.live += 1
            snapshot.live_bytes += where.length
        for seq in victims:
            del self._segments[seq]
        self._segments[last] = snapshot
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

    def _release_files(self) -> None:
        if self._active_fd >= 0:
            os.close(self._active_fd)
            self._active_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
