"""The change feed behind Watch (services/coordinator/watch.py), over an in-memory store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.coordinator.store import Change
from services.coordinator.watch import ChangeFeed, NudgingStore, Resync
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


def test_a_write_made_through_this_process_reaches_watchers_without_waiting_for_the_poll() -> None:
    """The feed polled the store every 50 ms, so every record a coordinator wrote (a failed master's
    successor, say) reached its watchers 25 ms later on average. A write through the `NudgingStore`,
    from the worker thread the services write from, wakes the feed at once."""

    async def scenario() -> None:
        store = MemoryStore()
        feed = ChangeFeed(store, poll_interval=60.0)  # only a nudge can bring the change in time
        await feed.start()
        nudging = NudgingStore(store, feed, asyncio.get_running_loop())
        for round_ in range(3):  # the first poll is done and the feed waits out its interval each time
            watcher = asyncio.ensure_future(_take(feed, frozenset({"queue"}), 0, 1))
            await asyncio.sleep(0.05)
            await asyncio.to_thread(nudging.put, "queue", "q", {"v": round_}, round_)
            seen = await asyncio.wait_for(watcher, 5)
            assert isinstance(seen[0], Change) and seen[0].record is not None
            assert seen[0].record.value == {"v": round_}
        assert not await asyncio.to_thread(nudging.delete, "queue", "q", 99)  # a conflict: no nudge needed
        await feed.stop()

    asyncio.run(scenario())


def test_a_nudge_that_comes_while_the_feed_polls_is_not_lost() -> None:
    async def scenario() -> None:
        feed = ChangeFeed(MemoryStore(), poll_interval=60.0)
        feed.nudge()  # as if during a poll: the pause after it must not wait
        await asyncio.wait_for(feed._pause(), 1)

    asyncio.run(scenario())


def test_the_feed_polls_slowly_only_while_no_other_coordinators_registration_comes_through() -> None:
    """An idle coordinator spent half of its CPU polling every 50 ms for writes nobody else made (its own
    are nudged). It polls every `lone_poll_interval` once no other coordinator's registration has come
    through the log for the silence it is given, and every `poll_interval` again from the first one."""

    async def scenario() -> None:
        store = MemoryStore()
        feed = ChangeFeed(store, poll_interval=0.01, lone_poll_interval=30.0)
        await feed.start()
        feed.watch_peers("coordinator", "127.0.0.1:1", silence_seconds=0.1)
        assert not feed.alone  # a peer may have registered just before this one started
        store.put("coordinator", "127.0.0.1:1", {"at_unix_ms": 1}, 0)  # its own registration
        await asyncio.sleep(0.15)
        assert feed.alone
        store.put("coordinator", "127.0.0.1:2", {"at_unix_ms": 1}, 0)  # another coordinator registers
        feed.nudge()  # the next slow poll, without waiting 30 s for it
        await asyncio.wait_for(_until(lambda: not feed.alone), 5)
        watcher = asyncio.ensure_future(_take(feed, frozenset({"queue"}), 0, 1))
        await asyncio.sleep(0.03)
        store.put("queue", "q", {"v": 1}, 0)  # the other's write: found by the next fast poll
        await asyncio.wait_for(watcher, 10)  # within the 30 s of a slow one
        await feed.stop()

    asyncio.run(scenario())


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.005)
