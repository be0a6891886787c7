"""The coordinator's durable store: group tables and broker node addresses.

Responsible for: persisting `Group` values and node records in one SQLite
file, and running every group change as a compare-and-set through
`group_table.apply`.
Guarantees: `change_group` reads, decides and writes in one `BEGIN IMMEDIATE`
transaction, so two changes computed from the same version never both apply,
even from separate connections or processes on the same file; a change whose
call has returned is durable (WAL with synchronous=FULL survives kill -9 and
power loss); a group that was never written reads as version 0 with no members.
Every method is synchronous and safe to call from any thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from typing import Protocol

from services.coordinator import group_table
from services.coordinator.group_table import Group, GroupChange, GroupMember, Outcome

_BUSY_TIMEOUT_MS = 10_000

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS groups ("
    " name TEXT PRIMARY KEY, version INTEGER NOT NULL, members TEXT NOT NULL) STRICT",
    "CREATE TABLE IF NOT EXISTS nodes (node TEXT PRIMARY KEY, address TEXT NOT NULL) STRICT",
)


class Store(Protocol):
    """What the coordinator server needs from a store."""

    def read_group(self, name: str) -> Group: ...

    def change_group(self, name: str, change: GroupChange) -> tuple[Outcome, Group]: ...

    def register_node(self, node: str, address: str) -> None: ...

    def list_nodes(self) -> list[tuple[str, str]]: ...

    def close(self) -> None: ...


class SqliteStore:
    """A `Store` in one SQLite file (created if absent)."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        # isolation_level=None: no implicit transactions; we BEGIN and COMMIT ourselves.
        self._conn = sqlite3.connect(
            path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
        self._conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise RuntimeError(f"SQLite refused WAL journal mode for {path!r} (got {mode!r})")
        self._conn.execute("PRAGMA synchronous=FULL")
        for statement in _SCHEMA:
            self._conn.execute(statement)

    def read_group(self, name: str) -> Group:
        with self._lock:
            return self._read(name)

    def change_group(self, name: str, change: GroupChange) -> tuple[Outcome, Group]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                before = self._read(name)
                outcome, after = group_table.apply(before, change)
                if outcome is Outcome.APPLIED and after.version != before.version:
                    self._conn.execute(
                        "INSERT INTO groups (name, version, members) VALUES (?, ?, ?)"
                        " ON CONFLICT (name) DO UPDATE"
                        " SET version = excluded.version, members = excluded.members",
                        (name, after.version, _members_to_json(after.members)),
                    )
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
            return outcome, after

    def register_node(self, node: str, address: str) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT INTO nodes (node, address) VALUES (?, ?)"
                " ON CONFLICT (node) DO UPDATE SET address = excluded.address",
                (node, address),
            )

    def list_nodes(self) -> list[tuple[str, str]]:
        with self._lock:
            rows = self._conn.execute("SELECT node, address FROM nodes ORDER BY node").fetchall()
        return [(str(node), str(address)) for node, address in rows]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _read(self, name: str) -> Group:
        row = self._conn.execute("SELECT version, members FROM groups WHERE name = ?", (name,)).fetchone()
        if row is None:
            return Group(name)
        version, members = row
        return Group(name, int(version), _members_from_json(str(members)))


def _members_to_json(members: tuple[GroupMember, ...]) -> str:
    return json.dumps([[m.id, m.node, m.alive] for m in members], separators=(",", ":"))


def _members_from_json(text: str) -> tuple[GroupMember, ...]:
    return tuple(GroupMember(str(i), str(node), bool(alive)) for i, node, alive in json.loads(text))
