"""A queue replica's message log on disk, driven by the log effects of services/queue/replica_core.py.

Responsible for: opening the log at start (what it recovers, the claim it makes, its damage);
carrying out AppendToLog, WriteLog, FlushLog, DiscardLog and WatchDisk strictly in the order the
core emitted them; group commit (services/queue/group_commit.py); reporting every flush back (done
or failed); and retrying a failed disk with back-off (tenacity) until it writes again.

Layout: a replica's directory holds generations `g<N>/`, each a FileMessageLog, and `CURRENT`, a
file naming the one in use. A fresh log (WriteLog with fresh, or a difference that cannot be
appended in id order) is written as the next generation and becomes CURRENT only once its first
flush is durable (CURRENT is replaced by an atomic rename, then the old generation is deleted). So
a crash at any point leaves either the old log or the new one complete: never neither. (A log
written before generations existed, segments directly in the directory, is opened as it is.)

Guarantees: effects are applied in order (a large WriteLog is written a chunk at a time, and what
follows waits for it); `on_flushed(flush_id)` is called only once every append made before that
FlushLog is durable and would be found after a crash (while CURRENT is being switched to a new
generation, no flush is reported until the switch is done, and only a flush of the new generation
makes it CURRENT); a flush of a generation already replaced is neither reported nor a failure (the
flush that follows the new generation covers it); after a failure nothing more is written until
`on_writable` was called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections import deque
from collections.abc import Callable, Coroutine

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from ringq.internal.v1 import queue_replication_pb2
from services.queue import wire
from services.queue.durability import Claim, Position
from services.queue.group_commit import GroupCommitter
from services.queue.message_log import FileMessageLog, MessageLogError
from services.queue.ops import Message
from services.queue.replica_core import (
    AppendToLog,
    DiscardLog,
    FlushLog,
    LogRecovery,
    WatchDisk,
    WriteLog,
)

log = logging.getLogger("ringq.queue")
CURRENT = "CURRENT"
# Messages written between two turns of the event loop when a log is written whole (100,000 at once
# held a mirror's loop, and so its ring, for 0.6 s).
WRITE_CHUNK = 2_000
DiskEffect = AppendToLog | WriteLog | FlushLog | DiscardLog | WatchDisk


class ReplicaLog:
    """The log of one replica (see the module docstring)."""

    def __init__(
        self,
        directory: str,
        on_flushed: Callable[[int], None],
        on_failed: Callable[[str], None],
        on_writable: Callable[[], None],
    ) -> None:
        self.directory = directory
        self.on_flushed = on_flushed
        self.on_failed = on_failed
        self.on_writable = on_writable
        self.log: FileMessageLog | None = None
        self.committer: GroupCommitter | None = None
        self.generation = 0
        self._pending_generation: tuple[int, int] | None = None  # (generation, flush id that makes it current)
        # The switch of CURRENT to a new generation while it runs: every flush that completes meanwhile waits
        # for it, since what it made durable is found after a crash only once CURRENT names its generation.
        self._switching: asyncio.Future[None] | None = None
        self._queue: deque[DiskEffect] = deque()
        self._worker: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._failed = False
        self._closed = False

    # ---------------------------------------------------------------- opening

    def open(self) -> LogRecovery | None:
        """Open the log there is (None if none): blocking, meant for a worker thread at start."""
        generation = self._current_generation()
        path = self._path(generation) if generation else self.directory
        if generation == 0 and not any(name.endswith(".seg") for name in _listdir(self.directory)):
            return None
        self._remove_other_generations(generation)
        opened = FileMessageLog(path)
        self.log, self.generation = opened, generation
        self.committer = GroupCommitter(opened)
        messages = tuple(_decoded(payload) for _, payload in opened.recover())
        damage = tuple(f"{d.path} at byte {d.offset}: {d.length} bytes, {d.reason}" for d in opened.damage)
        claim = Claim(Position.decode(opened.intact_mark()), damaged=bool(damage))
        return LogRecovery(messages, claim, damage)

    def close(self) -> None:
        self._closed = True
        for task in (self._worker, *self._tasks):
            if task is not None:
                task.cancel()
        if self.log is not None:
            self.log.close()
            self.log = None

    # ---------------------------------------------------------------- effects, in order

    def apply(self, effect: DiskEffect) -> None:
        if self._closed:
            return
        if self._worker is None and not self._queue and isinstance(effect, AppendToLog):
            self._append(effect)  # the hot path: nothing ahead of it
            return
        self._queue.append(effect)
        if self._worker is None:
            self._worker = asyncio.ensure_future(self._work())

    async def _work(self) -> None:
        try:
            while self._queue and not self._closed:
                effect = self._queue.popleft()
                if isinstance(effect, AppendToLog):
                    self._append(effect)
                elif isinstance(effect, WriteLog):
                    await self._write(effect)
                elif isinstance(effect, FlushLog):
                    self._flush(effect.flush_id)
                elif isinstance(effect, DiscardLog):
                    await self._discard()
                else:
                    self._spawn(self._watch_disk())
        finally:
            self._worker = None

    def _append(self, effect: AppendToLog) -> None:
        target = self.log
        if target is None or self._failed:
            return
        try:
            for message in effect.enqueued:
                target.append_enqueue(message.id, _encoded(message))
            if effect.removed:
                target.append_remove(effect.removed)
            if effect.position is not None:
                target.append_mark(effect.position.mark())
        except (MessageLogError, OSError, ValueError) as error:
            self._fail(error)

    async def _write(self, effect: WriteLog) -> None:
        """Make the log hold exactly effect.messages: a difference appended if it can be, else a new generation."""
        if self._failed:
            return
        try:
            if self._switching is not None:
                # A switch under way ends with CURRENT naming its generation and the others deleted: a new
                # generation numbered before it ends could be the very one it deletes or names.
                await asyncio.shield(self._switching)
            current = self.log
            wanted = {message.id: message for message in effect.messages}
            if current is not None and not effect.fresh and not current.damage:
                held = current.live_ids()
                additions = [m for i, m in sorted(wanted.items()) if i not in set(held)]
                if not additions or additions[0].id > current.last_id():
                    current.append_remove([i for i in held if i not in wanted])
                    await self._append_messages(current, additions)
                    current.append_mark(effect.position.mark())
                    return
            generation = max(self.generation, self._current_generation()) + 1
            path = self._path(generation)
            shutil.rmtree(path, ignore_errors=True)
            fresh = FileMessageLog(path)
            await self._append_messages(fresh, list(wanted.values()))
            fresh.append_mark(effect.position.mark())
            self._pending_generation = (generation, 0)  # current once the next flush is durable
            await self._replace_log(fresh)
        except (MessageLogError, OSError, ValueError) as error:
            self._fail(error)

    async def _append_messages(self, target: FileMessageLog, messages: list[Message]) -> None:
        for start in range(0, len(messages), WRITE_CHUNK):
            for message in messages[start : start + WRITE_CHUNK]:
                target.append_enqueue(message.id, _encoded(message))
            await asyncio.sleep(0)

    def _flush(self, flush_id: int) -> None:
        committer = self.committer
        if committer is None or self._failed:
            return
        switching = self._pending_generation
        if switching is not None and switching[1] == 0:
            self._pending_generation = (switching[0], flush_id)
        self._spawn(self._commit(committer, flush_id))

    def _spawn(self, coroutine: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _commit(self, committer: GroupCommitter, flush_id: int) -> None:
        try:
            await committer.commit()
            if committer is not self.committer:
                return  # a flush of a generation replaced since: the next flush covers what it held
            switching = self._pending_generation
            if switching is not None and 0 < switching[1] <= flush_id:
                self._pending_generation = None
                self._switching = asyncio.ensure_future(asyncio.to_thread(self._make_current, switching[0]))
            switch = self._switching
            if switch is not None:
                # Also a later flush that completes while an earlier one switches: what it made durable
                # counts only once CURRENT names its generation.
                await asyncio.shield(switch)
                if self._switching is switch:
                    self._switching = None  # done: CURRENT names the generation
        except (MessageLogError, OSError) as error:
            if committer is self.committer:
                self._fail(error)
            else:  # the replaced generation's log was closed under it: its flush no longer matters
                log.debug("flush %d of a replaced generation of %s failed: %r", flush_id, self.directory, error)
            return
        if committer is self.committer and not self._closed:
            self.on_flushed(flush_id)

    async def _replace_log(self, new: FileMessageLog | None) -> None:
        """Make `new` the log written to (None: none), then close the one it replaces in a worker thread:
        closing waits for a flush of it under way (an fsync), which must not hold the event loop. A flush of
        the replaced log that ends after this is neither reported nor a failure (`_commit`)."""
        replaced = self.log
        self.log, self.committer = new, None if new is None else GroupCommitter(new)
        if replaced is not None:
            await asyncio.to_thread(replaced.close)

    async def _discard(self) -> None:
        await self._replace_log(None)
        self._pending_generation = None
        self._switching = None
        for name in _listdir(self.directory):
            path = os.path.join(self.directory, name)
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        self.generation = 0

    def _fail(self, error: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        log.error("message log %s failed: %r", self.directory, error)
        self.on_failed(f"{type(error).__name__}: {error}")

    async def _watch_disk(self) -> None:
        """Try the disk with back-off until it writes; then the failed log is dropped (the core writes anew)."""
        async for attempt in AsyncRetrying(
            wait=wait_exponential(multiplier=0.5, max=30), retry=retry_if_exception_type(OSError), reraise=True
        ):
            with attempt:
                if self._closed:
                    return
                await asyncio.to_thread(_probe, self.directory)
        if self._closed:
            return
        await self._replace_log(None)
        self._switching = None
        self._failed = False
        self.on_writable()

    # ---------------------------------------------------------------- generations

    def _path(self, generation: int) -> str:
        return os.path.join(self.directory, f"g{generation:06d}")

    def _current_generation(self) -> int:
        try:
            with open(os.path.join(self.directory, CURRENT)) as file:
                text = file.read().strip()
        except FileNotFoundError:
            return 0
        return int(text[1:]) if text.startswith("g") and text[1:].isdigit() else 0

    def _make_current(self, generation: int) -> None:
        os.makedirs(self.directory, exist_ok=True)
        temporary = os.path.join(self.directory, f"{CURRENT}.tmp")
        with open(temporary, "w") as file:
            file.write(f"g{generation:06d}\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, os.path.join(self.directory, CURRENT))
        _fsync_directory(self.directory)
        self.generation = generation
        self._remove_other_generations(generation)

    def _remove_other_generations(self, keep: int) -> None:
        for name in _listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.startswith("g") and name[1:].isdigit() and int(name[1:]) != keep:
                shutil.rmtree(path, ignore_errors=True)
            elif keep and (name.endswith(".seg") or name == "LOCK"):
                with contextlib.suppress(OSError):
                    os.unlink(path)  # a log from before generations, replaced


def current_log_directory(directory: str) -> str:
    """Where a replica's log is now (the generation CURRENT names, or `directory` itself for a log
    written before generations), for tools and tests that look at the files."""
    name = ""
    with contextlib.suppress(FileNotFoundError), open(os.path.join(directory, CURRENT)) as file:
        name = file.read().strip()
    return os.path.join(directory, name) if name else directory


def _encoded(message: Message) -> bytes:
    return wire.message_to_proto(message).SerializeToString()


def _decoded(payload: bytes) -> Message:
    return wire.message_from_proto(queue_replication_pb2.ReplicatedMessage.FromString(payload))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _probe(directory: str) -> None:
    """Write, sync and remove a small file: OSError if the disk still cannot."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "probe.tmp")
    try:
        with open(path, "wb") as file:
            file.write(b"\0" * 65536)
            file.flush()
            os.fsync(file.fileno())
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
