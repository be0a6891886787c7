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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from services.coordinator.store import Change, ChangesTrimmed, Store, StoreUnavailable

log = logging.getLogger("ringq.watch")
NEWEST = 2**62  # a revision past any real one: asks the store only for its latest revision


@dataclass(frozen=True)
class Resync:
    """Changes were missed: re-list the watched kinds; `revision` is where the feed resumes."""

    revision: int


class ChangeFeed:
    """Follows a store's change log and fans it out to watchers."""

    def __init__(self, store: Store, poll_interval: float = 0.05, history: int = 10_000) -> None:
        self.store = store
        self.poll_interval = poll_interval
        self._recent: deque[Change] = deque(maxlen=history)
        self._latest = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

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

    async def _follow(self) -> None:
        while True:
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
                self._recent.extend(changes)
                self._latest = max(latest, changes[-1].revision if changes else latest)
                async with self._changed:
                    self._changed.notify_all()
            if len(changes) < 1000:
                await asyncio.sleep(self.poll_interval)

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
