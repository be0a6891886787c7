"""The change feed behind the coordinator's Watch streams.

Responsible for: following the store's change log with one poller per
coordinator process (whatever coordinator made a change, every coordinator
sees it in the shared log), keeping the recent changes in memory, and
handing each watcher the changes of the kinds it asked for, in revision
order, from the revision it asked for.
Guarantees: a watcher sees every change after its starting revision exactly
once and in order, or, if the changes it needs are gone from the log, a
`Resync` first (it must re-list, then follows on from the current revision);
memory is bounded by `history` changes; a slow watcher delays only itself.
A write made through this process's `NudgingStore` is looked for at once (its
watchers hear of it without waiting for the next poll: a master's failover
is a record written here); other coordinators' writes are found by polling,
every `poll_interval`, or every `lone_poll_interval` while no other
coordinator's registration has come through the log for a while
(`watch_peers`: nobody else writes; the first one seen ends that at once).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.coordinator.store import Change, ChangesTrimmed, Record, Store, StoreUnavailable

log = logging.getLogger("ringq.watch")
NEWEST = 2**62  # a revision past any real one: asks the store only for its latest revision


@dataclass(frozen=True)
class Resync:
    """Changes were missed: re-list the watched kinds; `revision` is where the feed resumes."""

    revision: int


class ChangeFeed:
    """Follows a store's change log and fans it out to watchers."""

    def __init__(
        self, store: Store, poll_interval: float = 0.05, history: int = 10_000, lone_poll_interval: float = 1.0
    ) -> None:
        self.store = store
        self.poll_interval = poll_interval
        self.lone_poll_interval = lone_poll_interval
        # Other coordinators' registrations (`watch_peers`): (record kind, this coordinator's key, how long
        # without one of theirs in the log means none is alive), and when one was last seen (loop time).
        self._peers: tuple[str, str, float] | None = None
        self._peer_seen_at = 0.0
        self._recent: deque[Change] = deque(maxlen=history)
        self._latest = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None  # ends the pause between polls early
        self._nudged = False  # a write was made here since the last poll began

    async def start(self) -> None:
        _, self._latest = await asyncio.to_thread(self.store.changes_since, NEWEST, 1)
        self._task = asyncio.ensure_future(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def latest(self) -> int:
        return self._latest

    def watch_peers(self, registrations: str, own_key: str, silence_seconds: float) -> None:
        """Poll every `lone_poll_interval` while no other coordinator's registration (a record of kind
        `registrations` under another key than `own_key`; each refreshes its own a few times per
        `silence_seconds`) has come through the log for `silence_seconds`: nobody else writes then. An
        idle coordinator spent half of its CPU (1.3 % of a core) polling every 50 ms for nobody's writes."""
        self._peers = (registrations, own_key, silence_seconds)
        self._peer_seen_at = asyncio.get_running_loop().time()  # as if one had just been seen

    @property
    def alone(self) -> bool:
        """Whether no other coordinator's registration came through the log lately (see `watch_peers`)."""
        peers = self._peers
        return peers is not None and asyncio.get_running_loop().time() - self._peer_seen_at > peers[2]

    def nudge(self) -> None:
        """A write was committed through this process: poll now, not at the end of the pause."""
        self._nudged = True
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _pause(self) -> None:
        """Wait out the poll interval, or less if nudged (also by a nudge during the last poll)."""
        if self._nudged:
            return
        loop = asyncio.get_running_loop()
        self._wake = wake = loop.create_future()
        interval = self.lone_poll_interval if self.alone else self.poll_interval
        timer = loop.call_later(interval, _resolve, wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._wake = None

    async def _follow(self) -> None:
        while True:
            self._nudged = False  # what was written before this poll, it finds
            try:
                changes, latest = await asyncio.to_thread(self.store.changes_since, self._latest, 1000)
            except ChangesTrimmed:
                # We fell behind the log itself: watchers older than this resync.
                _, latest = await asyncio.to_thread(self.store.changes_since, NEWEST, 1)
                changes = []
                self._recent.clear()
            except StoreUnavailable as error:
                log.warning("change feed paused: %s", error)
                await asyncio.sleep(self.poll_interval * 10)
                continue
            if changes or latest != self._latest:
                if self._peers is not None and any(_peer_registered(c, self._peers) for c in changes):
                    self._peer_seen_at = asyncio.get_running_loop().time()  # its writes come only by polls
                self._recent.extend(changes)
                self._latest = max(latest, changes[-1].revision if changes else latest)
                async with self._changed:
                    self._changed.notify_all()
            if len(changes) < 1000:
                await self._pause()

    def _newer_than(self, cursor: int) -> Callable[[], bool]:
        return lambda: self._latest > cursor

    async def watch(self, kinds: frozenset[str], after_revision: int = 0) -> AsyncIterator[Change | Resync]:
        """Changes of `kinds` (all if empty) after `after_revision` (0: from now on)."""
        cursor = after_revision or self._latest
        while True:
            oldest = self._recent[0].revision if self._recent else self._latest + 1
            if cursor < oldest - 1 and cursor < self._latest:
                try:
                    older, _ = await asyncio.to_thread(self.store.changes_since, cursor, oldest - 1 - cursor)
                except ChangesTrimmed:
                    cursor = self._latest
                    yield Resync(cursor)
                    continue
                for change in older:
                    if change.revision < oldest and (not kinds or change.kind in kinds):
                        yield change
                cursor = max(cursor, oldest - 1)
                continue
            batch = [c for c in self._recent if c.revision > cursor]
            for change in batch:
                if not kinds or change.kind in kinds:
                    yield change
            # Nothing newer in memory means nothing newer was logged: move on.
            cursor = batch[-1].revision if batch else max(cursor, min(self._latest, oldest - 1))
            async with self._changed:
                await self._changed.wait_for(self._newer_than(cursor))


def _peer_registered(change: Change, peers: tuple[str, str, float]) -> bool:
    kind, own_key, _ = peers
    return change.kind == kind and change.key != own_key and change.record is not None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class NudgingStore:
    """`store`, nudging `feed` after every write through it that took effect, from whichever thread made
    it (the coordinator's services write from worker threads)."""

    def __init__(self, store: Store, feed: ChangeFeed, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._feed = feed
        self._loop = loop
        self.kind_name = store.kind_name

    def _nudge(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is watching any more
            self._loop.call_soon_threadsafe(self._feed.nudge)

    def get(self, kind: str, key: str) -> Record | None:
        return self._store.get(kind, key)

    def list(self, kind: str) -> builtins.list[Record]:
        return self._store.list(kind)

    def put(self, kind: str, key: str, value: Mapping[str, Any], expected_version: int) -> Record | None:
        record = self._store.put(kind, key, value, expected_version)
        if record is not None:
            self._nudge()
        return record

    def delete(self, kind: str, key: str, expected_version: int) -> bool:
        deleted = self._store.delete(kind, key, expected_version)
        if deleted:
            self._nudge()
        return deleted

    def changes_since(self, revision: int, limit: int = 1000) -> tuple[builtins.list[Change], int]:
        return self._store.changes_since(revision, limit)

    def close(self) -> None:
        self._store.close()
