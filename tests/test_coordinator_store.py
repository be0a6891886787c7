"""SqliteStore: round trips, compare-and-set, durability across reopen, racing writers."""

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
from services.coordinator.store import SqliteStore

ROOT = GroupMember("root", "n0")
THREADS = 8


def test_absent_group_reads_as_version_zero(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "c.db"))
    assert store.read_group("nope") == Group("nope", 0, ())
    assert store.list_nodes() == []
    store.close()


def test_round_trip(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "c.db"))
    a, b = GroupMember("a", "n1"), GroupMember("b", "n2")
    assert store.change_group("g", CreateGroup(0, ROOT)) == (Outcome.APPLIED, Group("g", 1, (ROOT,)))
    assert store.change_group("g", AddMember(1, "root", a))[0] is Outcome.APPLIED
    assert store.change_group("g", AddMember(2, "root", b))[0] is Outcome.APPLIED
    assert store.change_group("g", MarkMemberDead(3, "b", "a"))[0] is Outcome.APPLIED
    expected = Group("g", 4, (ROOT, GroupMember("b", "n2", alive=False), a))
    assert store.read_group("g") == expected
    assert store.change_group("g", EraseMembers(4, ("b",), "root")) == (
        Outcome.APPLIED,
        Group("g", 5, (ROOT, a)),
    )
    assert store.read_group("g") == Group("g", 5, (ROOT, a))
    assert store.read_group("other") == Group("other")  # groups are independent

    store.register_node("n2", "127.0.0.1:2")
    store.register_node("n1", "127.0.0.1:1")
    store.register_node("n2", "127.0.0.1:22")  # upsert
    assert store.list_nodes() == [("n1", "127.0.0.1:1"), ("n2", "127.0.0.1:22")]
    store.close()


def test_compare_and_set_conflict_writes_nothing(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "c.db"))
    store.change_group("g", CreateGroup(0, ROOT))
    current = store.change_group("g", AddMember(1, "root", GroupMember("a", "n1")))[1]
    stale = AddMember(1, "root", GroupMember("b", "n2"))
    assert store.change_group("g", stale) == (Outcome.VERSION_CONFLICT, current)
    assert store.change_group("g", MarkMemberDead(2, "root", "ghost")) == (Outcome.ACTOR_NOT_ALIVE, current)
    assert store.change_group("g", CreateGroup(2, GroupMember("x", "n9"))) == (
        Outcome.VERSION_CONFLICT,
        current,
    )
    assert store.read_group("g") == current
    store.close()


def test_survives_close_and_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "c.db")
    store = SqliteStore(path)
    store.change_group("g", CreateGroup(0, ROOT))
    store.change_group("g", AddMember(1, "root", GroupMember("a", "n1")))
    store.register_node("n1", "127.0.0.1:1")
    before = store.read_group("g")
    store.close()

    reopened = SqliteStore(path)
    assert reopened.read_group("g") == before == Group("g", 2, (ROOT, GroupMember("a", "n1")))
    assert reopened.list_nodes() == [("n1", "127.0.0.1:1")]
    assert reopened.change_group("g", MarkMemberDead(2, "a", "root"))[1].version == 3
    reopened.close()

    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()


@pytest.mark.parametrize("shared", [True, False], ids=["one-store", "store-per-thread"])
def test_racing_writers_one_winner_per_version(tmp_path: Path, shared: bool) -> None:
    """Every round all threads read the same version, then all try to add: exactly one wins."""
    rounds = 25
    path = str(tmp_path / "c.db")
    first = SqliteStore(path)
    first.change_group("g", CreateGroup(0, ROOT))
    stores = [first] * THREADS if shared else [SqliteStore(path) for _ in range(THREADS)]
    barrier = threading.Barrier(THREADS, timeout=30)

    def writer(t: int) -> list[tuple[int, Outcome, Group]]:
        results = []
        for r in range(rounds):
            barrier.wait()
            seen = stores[t].read_group("g")
            barrier.wait()  # everyone has read before anyone writes
            newcomer = GroupMember(f"t{t}-r{r}", f"n{t}")
            outcome, after = stores[t].change_group("g", AddMember(seen.version, "root", newcomer))
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
    final = first.read_group("g")
    assert final == winners[-1]
    assert len(final.members) == 1 + len(winners)
    for store in set(stores):
        store.close()


def test_free_running_writers_lose_no_update(tmp_path: Path) -> None:
    """Threads add members as fast as they can, re-reading on conflict: no applied change is lost."""
    adds_per_thread = 15
    path = str(tmp_path / "c.db")
    SqliteStore(path).change_group("g", CreateGroup(0, ROOT))

    def writer(t: int) -> list[Group]:
        store = SqliteStore(path)
        applied: list[Group] = []
        for k in range(adds_per_thread):
            newcomer = GroupMember(f"t{t}-{k}", f"n{t}")
            while True:
                seen = store.read_group("g")
                outcome, after = store.change_group("g", AddMember(seen.version, "root", newcomer))
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
    final = SqliteStore(path).read_group("g")
    assert final.version == 1 + len(applied)
    assert len(final.members) == 1 + len(applied)
    assert {m.id for m in final.members} == {"root"} | {f"t{t}-{k}" for t in range(8) for k in range(15)}
