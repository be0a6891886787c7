"""records.py over SqliteStore: round trips, compare-and-set, durability across reopen, racing writers.

(tests/test_store_contract.py runs the Store contract and records.py over both stores.)
"""

from __future__ import annotations

import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.coordinator.group_table import (
    AddMember,
    CreateGroup,
    EraseMembers,
    Group,
    GroupMember,
    MarkMemberDead,
    Outcome,
)
from services.coordinator.records import change_group, list_nodes, read_group, register_node
from services.coordinator.sqlite_store import SqliteStore

ROOT = GroupMember("root", "n0")
THREADS = 8


def addresses(store: SqliteStore) -> list[tuple[str, str]]:
    return [(n.node, n.address) for n in list_nodes(store)]


def test_absent_group_reads_as_version_zero(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "c.db"))
    assert read_group(store, "nope") == Group("nope", 0, ())
    assert addresses(store) == []
    store.close()


def test_round_trip(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "c.db"))
    a, b = GroupMember("a", "n1"), GroupMember("b", "n2")
    assert change_group(store, "g", CreateGroup(0, ROOT)) == (Outcome.APPLIED, Group("g", 1, (ROOT,)))
    assert change_group(store, "g", AddMember(1, "root", a))[0] is Outcome.APPLIED
    assert change_group(store, "g", AddMember(2, "root", b))[0] is Outcome.APPLIED
    assert change_group(store, "g", MarkMemberDead(3, "b", "a"))[0] is Outcome.APPLIED
    expected = Group("g", 4, (ROOT, GroupMember("b", "n2", alive=False), a))
    assert read_group(store, "g") == expected
    assert change_group(store, "g", EraseMembers(4, ("b",), "root")) == (
        Outcome.APPLIED,
        Group("g", 5, (ROOT, a)),
    )
    assert read_group(store, "g") == Group("g", 5, (ROOT, a))
    assert read_group(store, "other") == Group("other")  # groups are independent

    register_node(store, "n2", "127.0.0.1:2")
    register_node(store, "n1", "127.0.0.1:1")
    register_node(store, "n2", "127.0.0.1:22")  # upsert
    assert addresses(store) == [("n1", "127.0.0.1:1"), ("n2", "127.0.0.1:22")]
    store.close()


def test_compare_and_set_conflict_writes_nothing(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "c.db"))
    change_group(store, "g", CreateGroup(0, ROOT))
    current = change_group(store, "g", AddMember(1, "root", GroupMember("a", "n1")))[1]
    stale = AddMember(1, "root", GroupMember("b", "n2"))
    assert change_group(store, "g", stale) == (Outcome.VERSION_CONFLICT, current)
    assert change_group(store, "g", MarkMemberDead(2, "root", "ghost")) == (Outcome.ACTOR_NOT_ALIVE, current)
    assert change_group(store, "g", CreateGroup(2, GroupMember("x", "n9"))) == (
        Outcome.VERSION_CONFLICT,
        current,
    )
    assert read_group(store, "g") == current
    store.close()


def test_survives_close_and_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "c.db")
    store = SqliteStore(path)
    change_group(store, "g", CreateGroup(0, ROOT))
    change_group(store, "g", AddMember(1, "root", GroupMember("a", "n1")))
    register_node(store, "n1", "127.0.0.1:1")
    before = read_group(store, "g")
    store.close()

    reopened = SqliteStore(path)
    assert read_group(reopened, "g") == before == Group("g", 2, (ROOT, GroupMember("a", "n1")))
    assert addresses(reopened) == [("n1", "127.0.0.1:1")]
    assert change_group(reopened, "g", MarkMemberDead(2, "a", "root"))[1].version == 3
    reopened.close()

    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()


def test_a_file_in_the_old_layout_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE groups (name TEXT PRIMARY KEY, version INTEGER NOT NULL, members TEXT NOT NULL)")
    raw.commit()
    raw.close()
    with pytest.raises(RuntimeError, match="older coordinator"):
        SqliteStore(str(path))


@pytest.mark.parametrize("shared", [True, False], ids=["one-store", "store-per-thread"])
def test_racing_writers_one_winner_per_version(tmp_path: Path, shared: bool) -> None:
    """Every round all threads read the same version, then all try to add: exactly one wins."""
    rounds = 25
    path = str(tmp_path / "c.db")
    first = SqliteStore(path)
    change_group(first, "g", CreateGroup(0, ROOT))
    stores = [first] * THREADS if shared else [SqliteStore(path) for _ in range(THREADS)]
    barrier = threading.Barrier(THREADS, timeout=30)

    def writer(t: int) -> list[tuple[int, Outcome, Group]]:
        results = []
        for r in range(rounds):
            barrier.wait()
            seen = read_group(stores[t], "g")
            barrier.wait()  # everyone has read before anyone writes
            newcomer = GroupMember(f"t{t}-r{r}", f"n{t}")
            outcome, after = change_group(stores[t], "g", AddMember(seen.version, "root", newcomer))
            results.append((seen.version, outcome, after))
        return results

    with ThreadPoolExecutor(THREADS) as pool:
        per_thread = list(pool.map(writer, range(THREADS)))

    winners: list[Group] = []
    for r in range(rounds):
        attempts = [results[r] for results in per_thread]
        assert {seen for seen, _, _ in attempts} == {r + 1}, f"round {r}: threads read different versions"
        outcomes = sorted(outcome.name for _, outcome, _ in attempts)
        assert outcomes == ["APPLIED"] + ["VERSION_CONFLICT"] * (THREADS - 1), f"round {r}"
        # Losers were answered with the winner's group, so they can re-decide against it.
        assert all(after.version == r + 2 for _, _, after in attempts)
        winners += [after for _, outcome, after in attempts if outcome is Outcome.APPLIED]

    assert [w.version for w in winners] == list(range(2, rounds + 2))
    final = read_group(first, "g")
    assert final == winners[-1]
    assert len(final.members) == 1 + len(winners)
    for store in set(stores):
        store.close()


def test_free_running_writers_lose_no_update(tmp_path: Path) -> None:
    """Threads add members as fast as they can, re-reading on conflict: no applied change is lost."""
    adds_per_thread = 15
    path = str(tmp_path / "c.db")
    change_group(SqliteStore(path), "g", CreateGroup(0, ROOT))

    def writer(t: int) -> list[Group]:
        store = SqliteStore(path)
        applied: list[Group] = []
        for k in range(adds_per_thread):
            newcomer = GroupMember(f"t{t}-{k}", f"n{t}")
            while True:
                seen = read_group(store, "g")
                outcome, after = change_group(store, "g", AddMember(seen.version, "root", newcomer))
                if outcome is Outcome.APPLIED:
                    assert after.version == seen.version + 1
                    applied.append(after)
                    break
                assert outcome is Outcome.VERSION_CONFLICT
        store.close()
        return applied

    with ThreadPoolExecutor(THREADS) as pool:
        applied = [group for groups in pool.map(writer, range(THREADS)) for group in groups]

    assert sorted(g.version for g in applied) == list(range(2, 2 + THREADS * adds_per_thread))
    final = read_group(SqliteStore(path), "g")
    assert final.version == 1 + len(applied)
    assert len(final.members) == 1 + len(applied)
    assert {m.id for m in final.members} == {"root"} | {f"t{t}-{k}" for t in range(8) for k in range(15)}
