"""The Store contract (services/coordinator/store.py), run against every store: SQLite and a real ZooKeeper.

Then records.py (groups, nodes, heartbeats) over both stores, and ZooKeeper-only behaviour:
StoreUnavailable while the server is down, and recovery once it is back.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from services.coordinator import records
from services.coordinator.group_table import AddMember, CreateGroup, Group, GroupMember, MarkMemberDead, Outcome
from services.coordinator.records import NodeRecord
from services.coordinator.sqlite_store import SqliteStore
from services.coordinator.store import (
    CHANGE_LOG_RETAINED,
    MAX_KEY_LENGTH,
    Change,
    ChangesTrimmed,
    Record,
    Store,
    StoreUnavailable,
)
from services.coordinator.store_rules import MAX_VALUE_BYTES
from services.coordinator.zookeeper_store import ZooKeeperStore
from tests.zookeeper import ZooKeeperServer

THREADS = 8
_T = TypeVar("_T")


class Opener(Protocol):
    """Opens another instance (its own connection) of the store under test: same file, same ZooKeeper root."""

    def __call__(self, *, change_log_retained: int = CHANGE_LOG_RETAINED) -> Store: ...


@pytest.fixture(params=["sqlite", "zookeeper"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    opened: list[Store] = []
    make: Callable[[int], Store]
    if request.param == "sqlite":
        path = str(tmp_path / "store.db")

        def make(retained: int) -> Store:
            return SqliteStore(path, change_log_retained=retained)
    else:
        hosts: str = request.getfixturevalue("zookeeper")
        root = f"/test-{uuid.uuid4().hex}"

        def make(retained: int) -> Store:
            return ZooKeeperStore(hosts, root, timeout=10.0, change_log_retained=retained)

    def opener(*, change_log_retained: int = CHANGE_LOG_RETAINED) -> Store:
        store = make(change_log_retained)
        opened.append(store)
        return store

    yield opener
    for store in opened:
        store.close()


@pytest.fixture
def store(open_store: Opener) -> Store:
    return open_store()


def all_changes(store: Store, since: int = 0) -> list[Change]:
    return store.changes_since(since, limit=1_000_000)[0]


def race(work: Callable[[int], _T]) -> list[_T]:
    """Run work(0..THREADS-1) in THREADS threads at once; their results in thread order."""
    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(work, range(THREADS)))


# ---------------------------------------------------------------------------------------------- records


def test_create_read_update_delete(store: Store) -> None:
    assert store.kind_name in ("sqlite", "zookeeper")
    assert store.get("k", "a") is None
    created = store.put("k", "a", {"n": 1, "nested": {"list": [1, "two", None]}}, 0)
    assert created == Record("k", "a", {"n": 1, "nested": {"list": [1, "two", None]}}, 1)
    assert store.get("k", "a") == created
    updated = store.put("k", "a", {"n": 2}, 1)
    assert updated == Record("k", "a", {"n": 2}, 2)
    assert store.get("k", "a") == updated  # replaced, not merged
    assert store.put("k", "a", {"n": 3}, 2) == Record("k", "a", {"n": 3}, 3)
    assert store.delete("k", "a", 3) is True
    assert store.get("k", "a") is None
    assert store.put("k", "a", {"again": True}, 0) == Record("k", "a", {"again": True}, 1)  # re-created: version 1
    assert store.get("other-kind", "a") is None  # kinds are separate


def test_compare_and_set_conflicts_write_nothing(store: Store) -> None:
    store.put("k", "a", {"n": 1}, 0)
    store.put("k", "a", {"n": 2}, 1)
    before = store.changes_since(0)
    assert store.put("k", "a", {"stale": True}, 1) is None  # stale version
    assert store.put("k", "a", {"ahead": True}, 3) is None  # a version that does not exist yet
    assert store.put("k", "a", {"create": True}, 0) is None  # create when it exists
    assert store.put("k", "absent", {"n": 1}, 1) is None  # update of an absent record
    assert store.delete("k", "a", 1) is False  # delete with a wrong version
    assert store.delete("k", "a", 0) is False
    assert store.delete("k", "absent", 1) is False
    assert store.get("k", "a") == Record("k", "a", {"n": 2}, 2)
    assert store.get("k", "absent") is None
    assert store.changes_since(0) == before  # refused writes leave no change


def test_list_is_sorted_by_key_per_kind(store: Store) -> None:
    assert store.list("k") == []
    keys = ["m", "b", "a/b", "Z", "a", "é", "10", "9"]
    for key in keys:
        store.put("k", key, {"key": key}, 0)
    store.put("other", "x", {}, 0)
    store.put("k", "b", {"key": "b", "v": 2}, 1)
    store.delete("k", "m", 1)
    listed = store.list("k")
    assert [r.key for r in listed] == sorted(set(keys) - {"m"})
    assert all(r.kind == "k" and r.value["key"] == r.key for r in listed)
    assert next(r for r in listed if r.key == "b") == Record("k", "b", {"key": "b", "v": 2}, 2)
    assert store.list("other") == [Record("other", "x", {}, 1)]


AWKWARD_KEYS = [
    "a/b",
    "/leading/slash",
    "trailing/",
    "//",
    "with space",
    " ",
    ".",
    "..",
    "%2F",
    "%",
    "a%b",
    "100%",
    "ünïcödé",
    "日本語のキー",
    "emoji 😀",
    "quote'\"",
    "back\\slash",
    "zookeeper",
    "x" * MAX_KEY_LENGTH,
    "😀" * MAX_KEY_LENGTH,
]


def test_awkward_keys_and_kinds_round_trip(store: Store) -> None:
    for key in AWKWARD_KEYS:
        assert store.put("kind/with slash", key, {"key": key}, 0) is not None, key
        assert store.get("kind/with slash", key) == Record("kind/with slash", key, {"key": key}, 1), key
    assert [r.key for r in store.list("kind/with slash")] == sorted(AWKWARD_KEYS)
    assert [c.key for c in all_changes(store)] == AWKWARD_KEYS
    for kind in ("ünï", ".", "..", "a b"):
        assert store.put(kind, "/", {"kind": kind}, 0) == Record(kind, "/", {"kind": kind}, 1)
        assert store.list(kind) == [Record(kind, "/", {"kind": kind}, 1)]
    assert store.get(".", "/") != store.get("..", "/")
    for key in AWKWARD_KEYS:
        assert store.delete("kind/with slash", key, 1), key
    assert store.list("kind/with slash") == []


BAD_NAMES = [
    pytest.param("", id="empty"),
    pytest.param("x" * (MAX_KEY_LENGTH + 1), id="too-long"),
    pytest.param("nul\x00byte", id="nul"),
    pytest.param("new\nline", id="newline"),
    pytest.param("tab\there", id="tab"),
    pytest.param("del\x7f", id="del"),
    pytest.param("lone\ud800surrogate", id="surrogate"),
]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_kinds_and_keys_raise_value_error(store: Store, bad: str) -> None:
    calls: list[Callable[[], object]] = [
        lambda: store.get(bad, "k"),
        lambda: store.get("k", bad),
        lambda: store.list(bad),
        lambda: store.put(bad, "k", {}, 0),
        lambda: store.put("k", bad, {}, 0),
        lambda: store.delete(bad, "k", 1),
        lambda: store.delete("k", bad, 1),
    ]
    for call in calls:
        with pytest.raises(ValueError):
            call()
    assert store.changes_since(0) == ([], 0)


def test_bad_versions_and_values_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="expected_version"):
        store.put("k", "a", {}, -1)
    with pytest.raises(ValueError, match="expected_version"):
        store.delete("k", "a", -1)
    with pytest.raises(TypeError):
        store.put("k", "a", ["not", "a", "mapping"], 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.put("k", "a", {"not json": object()}, 0)
    with pytest.raises(ValueError, match="at most"):
        store.put("k", "a", {"big": "x" * MAX_VALUE_BYTES}, 0)
    big = store.put("k", "a", {"big": "x" * (MAX_VALUE_BYTES - 100)}, 0)
    assert big is not None and store.get("k", "a") == big
    assert len(all_changes(store)) == 1


# ---------------------------------------------------------------------------------------------- change log


def test_changes_since_returns_each_write_once_in_order(store: Store) -> None:
    assert store.changes_since(0) == ([], 0)
    store.put("k", "a", {"n": 1}, 0)
    store.put("k", "b", {"n": 1}, 0)
    store.put("k", "a", {"n": 2}, 1)
    store.put("k", "a", {"n": 9}, 1)  # conflict: not logged
    store.delete("k", "b", 1)
    store.put("j", "a", {"other": "kind"}, 0)
    store.delete("k", "a", 1)  # conflict: not logged
    changes, latest = store.changes_since(0)
    assert [(c.kind, c.key, c.record) for c in changes] == [
        ("k", "a", Record("k", "a", {"n": 1}, 1)),
        ("k", "b", Record("k", "b", {"n": 1}, 1)),
        ("k", "a", Record("k", "a", {"n": 2}, 2)),
        ("k", "b", None),
        ("j", "a", Record("j", "a", {"other": "kind"}, 1)),
    ]
    revisions = [c.revision for c in changes]
    assert revisions == sorted(set(revisions)) and revisions[0] > 0
    assert latest == revisions[-1]
    assert store.changes_since(latest) == ([], latest)
    assert store.changes_since(revisions[2]) == (changes[3:], latest)
    store.put("k", "c", {}, 0)
    newer, latest2 = store.changes_since(latest)
    assert [(c.key, c.revision > latest) for c in newer] == [("c", True)]
    assert latest2 == newer[0].revision


def test_changes_since_limit_pages_through_the_log(store: Store) -> None:
    for i in range(10):
        store.put("k", f"key{i}", {"i": i}, 0)
    everything, latest = store.changes_since(0)
    paged: list[Change] = []
    since = 0
    while True:
        page, page_latest = store.changes_since(since, limit=3)
        assert page_latest == latest and len(page) <= 3
        if not page:
            break
        paged += page
        since = page[-1].revision
    assert paged == everything and len(paged) == 10
    with pytest.raises(ValueError):
        store.changes_since(0, limit=0)


def test_trimmed_log_raises_changes_trimmed(open_store: Opener) -> None:
    store = open_store(change_log_retained=5)
    for i in range(23):
        assert store.put("k", f"key{i % 4}", {"i": i}, i // 4) is not None
    with pytest.raises(ChangesTrimmed):
        store.changes_since(0)
    first = oldest_kept(store)
    kept, latest = store.changes_since(first - 1)  # a reader that has seen everything before `first`
    values = [c.record.value["i"] for c in kept if c.record]
    assert len(values) >= 5 and values == list(range(23 - len(values), 23))  # the newest, none missing
    assert len(values) < 23 and kept[0].revision == first
    with pytest.raises(ChangesTrimmed):
        store.changes_since(first - 2)
    assert store.changes_since(latest) == ([], latest)
    # Another instance (another coordinator) reads the same trimmed log.
    assert open_store().changes_since(first - 1) == (kept, latest)


def oldest_kept(store: Store) -> int:
    """The oldest revision in the log, found as a reader would: asking from older and older revisions."""
    since = 0
    while True:
        try:
            return store.changes_since(since, limit=1)[0][0].revision
        except ChangesTrimmed:
            since += 1


# ---------------------------------------------------------------------------------------------- concurrency


def test_compare_and_set_race_one_winner_per_version(open_store: Opener) -> None:
    """Every round all threads (each with its own connection) read, then all put on what they read."""
    rounds = 20
    stores = [open_store() for _ in range(THREADS)]
    barrier = threading.Barrier(THREADS, timeout=60)

    def writer(t: int) -> list[tuple[int, bool]]:
        outcomes = []
        for r in range(rounds):
            barrier.wait()
            seen = stores[t].get("race", "key")
            version = 0 if seen is None else seen.version
            barrier.wait()  # everyone has read before anyone writes
            written = stores[t].put("race", "key", {"writer": t, "round": r}, version)
            assert written is None or written.version == version + 1
            outcomes.append((version, written is not None))
        return outcomes

    per_thread = race(writer)
    successes = 0
    for r in range(rounds):
        attempts = [outcomes[r] for outcomes in per_thread]
        assert {version for version, _ in attempts} == {r}, f"round {r}: threads read different versions"
        assert sum(won for _, won in attempts) == 1, f"round {r}: {attempts}"
        successes += 1
    final = stores[0].get("race", "key")
    assert final is not None and final.version == successes == rounds
    logged = [c for c in all_changes(stores[0]) if c.key == "key"]
    assert [c.record.version for c in logged if c.record] == list(range(1, rounds + 1))
    winners = [next(t for t in range(THREADS) if per_thread[t][r][1]) for r in range(rounds)]
    assert [c.record.value["writer"] for c in logged if c.record] == winners


def test_free_running_increments_lose_no_update(open_store: Opener) -> None:
    """Threads increment a counter with get/put retries: every increment lands exactly once."""
    increments = 10
    stores = [open_store() for _ in range(THREADS)]
    stores[0].put("counter", "c", {"n": 0}, 0)

    def worker(t: int) -> int:
        conflicts = 0
        for _ in range(increments):
            while True:
                seen = stores[t].get("counter", "c")
                assert seen is not None
                if stores[t].put("counter", "c", {"n": seen.value["n"] + 1}, seen.version) is not None:
                    break
                conflicts += 1
        return conflicts

    race(worker)
    final = stores[0].get("counter", "c")
    assert final == Record("counter", "c", {"n": THREADS * increments}, 1 + THREADS * increments)
    logged = [c.record.value["n"] for c in all_changes(stores[0]) if c.record]
    assert logged == list(range(THREADS * increments + 1))


def test_a_write_is_visible_at_once_through_another_instance(open_store: Opener) -> None:
    writer, reader = open_store(), open_store()
    version = 0
    for i in range(50):
        written = writer.put("lin", "key", {"i": i}, version)
        assert written is not None
        version = written.version
        assert reader.get("lin", "key") == written
        assert reader.list("lin") == [written]
        assert reader.changes_since(0, limit=1_000_000)[1] == writer.changes_since(0)[1]
    assert reader.delete("lin", "key", version)
    assert writer.get("lin", "key") is None


# ---------------------------------------------------------------------------------------------- records.py


ROOT = GroupMember("root", "n0")


def test_group_version_is_the_record_version(store: Store) -> None:
    assert records.read_group(store, "g") == Group("g")
    assert records.change_group(store, "g", CreateGroup(0, ROOT)) == (Outcome.APPLIED, Group("g", 1, (ROOT,)))
    record = store.get(records.GROUP, "g")
    assert record is not None and record.version == 1
    a = GroupMember("a", "n1")
    outcome, group = records.change_group(store, "g", AddMember(1, "root", a))
    assert (outcome, group) == (Outcome.APPLIED, Group("g", 2, (ROOT, a)))
    assert records.read_group(store, "g") == group
    logged = len(all_changes(store))
    # Already true: APPLIED without a write. Stale or by a non-member: refused with the current group.
    assert records.change_group(store, "g", AddMember(2, "root", a)) == (Outcome.APPLIED, group)
    assert records.change_group(store, "g", AddMember(1, "root", GroupMember("b", "n2"))) == (
        Outcome.VERSION_CONFLICT,
        group,
    )
    assert records.change_group(store, "g", MarkMemberDead(2, "a", "ghost")) == (Outcome.ACTOR_NOT_ALIVE, group)
    assert len(all_changes(store)) == logged


def test_change_group_race_one_winner_per_round(open_store: Opener) -> None:
    rounds = 12
    stores = [open_store() for _ in range(THREADS)]
    assert records.change_group(stores[0], "g", CreateGroup(0, ROOT))[0] is Outcome.APPLIED
    barrier = threading.Barrier(THREADS, timeout=60)

    def writer(t: int) -> list[tuple[int, Outcome, Group]]:
        results = []
        for r in range(rounds):
            barrier.wait()
            seen = records.read_group(stores[t], "g")
            barrier.wait()
            newcomer = GroupMember(f"t{t}-r{r}", f"n{t}")
            outcome, after = records.change_group(stores[t], "g", AddMember(seen.version, "root", newcomer))
            results.append((seen.version, outcome, after))
        return results

    per_thread = race(writer)
    for r in range(rounds):
        attempts = [results[r] for results in per_thread]
        assert {seen for seen, _, _ in attempts} == {r + 1}
        assert sorted(o.name for _, o, _ in attempts) == ["APPLIED"] + ["VERSION_CONFLICT"] * (THREADS - 1)
        # Losers are answered with the winner's group, so they can re-decide against it.
        assert len({after for _, _, after in attempts}) == 1 and attempts[0][2].version == r + 2
    final = records.read_group(stores[0], "g")
    assert final.version == rounds + 1 and len(final.members) == rounds + 1


def test_nodes_register_drain_and_heartbeat(open_store: Opener) -> None:
    store, other = open_store(), open_store()
    assert records.list_nodes(store) == []
    assert records.set_node_draining(store, "n1", True) is False  # not registered
    records.register_node(store, "n2", "127.0.0.1:2")
    records.register_node(store, "n1", "127.0.0.1:1")
    assert records.list_nodes(other) == [NodeRecord("n1", "127.0.0.1:1"), NodeRecord("n2", "127.0.0.1:2")]

    assert records.set_node_draining(other, "n1", True) is True
    records.register_node(store, "n1", "127.0.0.1:11")  # re-registering keeps draining
    assert records.list_nodes(store)[0] == NodeRecord("n1", "127.0.0.1:11", draining=True)
    assert records.set_node_draining(store, "n1", False) is True

    before = store.changes_since(0)[1]
    records.register_node(store, "n1", "127.0.0.1:11")  # no change: no write
    records.node_heartbeat(store, "n1", 1_000)
    records.node_heartbeat(other, "n1", 2_000)
    records.node_heartbeat(store, "n1", 1_500)  # older than the recorded one: ignored
    changes = store.changes_since(before)[0]
    assert [(c.kind, c.key) for c in changes] == [("heartbeat", "n1"), ("heartbeat", "n1")]  # node watchers sleep
    assert records.list_nodes(other) == [
        NodeRecord("n1", "127.0.0.1:11", draining=False, last_heartbeat_unix_ms=2_000),
        NodeRecord("n2", "127.0.0.1:2", draining=False, last_heartbeat_unix_ms=None),
    ]


def test_concurrent_heartbeats_keep_the_latest(open_store: Opener) -> None:
    stores = [open_store() for _ in range(THREADS)]
    records.register_node(stores[0], "n1", "127.0.0.1:1")

    def beat(t: int) -> None:
        for k in range(10):
            records.node_heartbeat(stores[t], "n1", 1_000 + k * THREADS + t)

    race(beat)
    assert records.list_nodes(stores[0])[0].last_heartbeat_unix_ms == 1_000 + 9 * THREADS + THREADS - 1


# ---------------------------------------------------------------------------------------------- ZooKeeper only


def test_zookeeper_outage_raises_store_unavailable_then_recovers(zookeeper: str) -> None:
    """A private server (the shared one stays up): stop it, calls fail fast enough; start it, calls work."""
    with ZooKeeperServer() as server:
        store = ZooKeeperStore(server.hosts, "/outage", timeout=2.0)
        try:
            written = store.put("k", "a", {"n": 1}, 0)
            assert written is not None
            server.stop()
            deadline = time.monotonic() + 10
            while True:  # the first calls may still reach the server before the client notices it has gone
                try:
                    store.get("k", "a")
                except StoreUnavailable:
                    break
                assert time.monotonic() < deadline, "still answering after the server stopped"
                time.sleep(0.05)
            calls: list[Callable[[], Any]] = [
                lambda: store.get("k", "a"),
                lambda: store.put("k", "a", {"n": 2}, 1),
                lambda: store.list("k"),
                lambda: store.changes_since(0),
                lambda: store.delete("k", "a", 1),
            ]
            for call in calls:
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    call()
                assert time.monotonic() - started < 0.5  # disconnected: at once, nothing queued
            server.start()  # same port, same data
            deadline = time.monotonic() + 20
            while True:
                try:
                    assert store.get("k", "a") == written  # the acknowledged write survived the restart
                    break
                except StoreUnavailable:
                    assert time.monotonic() < deadline, "the store did not reconnect"
                    time.sleep(0.1)
            assert store.put("k", "a", {"n": 2}, 1) == Record("k", "a", {"n": 2}, 2)  # the refused put never landed
            assert len(store.changes_since(0)[0]) == 2
        finally:
            store.close()
        server.stop()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="cannot connect"):
            ZooKeeperStore(server.hosts, "/outage", timeout=1.0)
        assert time.monotonic() - started < 4
