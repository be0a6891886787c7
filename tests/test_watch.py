"""The change feed behind Watch (services/coordinator/watch.py), over an in-memory store."""

from __future__ import annotations

import asyncio

from services.coordinator.store import Change
from services.coordinator.watch import ChangeFeed, Resync
from tests.memory_store import MemoryStore


async def _take(feed: ChangeFeed, kinds: frozenset[str], after: int, count: int) -> list[Change | Resync]:
    out: list[Change | Resync] = []
    async for item in feed.watch(kinds, after):
        out.append(item)
        if len(out) == count:
            break
    return out


def test_a_watcher_sees_later_changes_of_its_kinds_in_order() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        store.put("queue", "old", {"v": 0}, 0)
        feed = ChangeFeed(store, poll_interval=0.01)
        await feed.start()
        watcher = asyncio.ensure_future(_take(feed, frozenset({"queue"}), 0, 3))
        await asyncio.sleep(0.05)
        store.put("queue", "a", {"v": 1}, 0)
        store.put("lease", "x", {"v": 1}, 0)
        store.put("queue", "a", {"v": 2}, 1)
        store.delete("queue", "a", 2)
        seen = await asyncio.wait_for(watcher, 5)
        assert [(c.key, c.record.value["v"] if c.record else None) for c in seen if isinstance(c, Change)] == [
            ("a", 1),
            ("a", 2),
            ("a", None),
        ]
        await feed.stop()

    asyncio.run(scenario())


def test_a_watcher_can_start_from_an_earlier_revision() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        for i in range(5):
            store.put("policy", f"p{i}", {}, 0)
        feed = ChangeFeed(store, poll_interval=0.01, history=2)
        await feed.start()
        seen = await asyncio.wait_for(_take(feed, frozenset(), 2, 3), 5)
        assert [c.revision for c in seen if isinstance(c, Change)] == [3, 4, 5]
        await feed.stop()

    asyncio.run(scenario())


def test_a_watcher_too_far_behind_is_told_to_resync() -> None:
    async def scenario() -> None:
        store = MemoryStore(change_log_retained=3)
        for i in range(10):
            store.put("node", f"n{i}", {}, 0)
        feed = ChangeFeed(store, poll_interval=0.01)
        await feed.start()
        watcher = asyncio.ensure_future(_take(feed, frozenset({"node"}), 1, 2))
        await asyncio.sleep(0.05)
        store.put("node", "late", {}, 0)
        first, second = await asyncio.wait_for(watcher, 5)
        assert first == Resync(10)
        assert isinstance(second, Change) and second.key == "late"
        await feed.stop()

    asyncio.run(scenario())
