"""A `Store` (services/coordinator/store.py) in one SQLite file: the default.

Responsible for: versioned records and the change log in two tables,
`records (kind, key, value, version)` and `changes (revision, kind, key,
value, version)`.
Guarantees (beyond the contract): each `put` and `delete` checks the version,
writes the record and appends its change in one `BEGIN IMMEDIATE`
transaction, so compare-and-set holds between connections and processes on
the same file, and a change is in the log exactly when its write is; an
acknowledged write survives kill -9 and power loss (WAL with
synchronous=FULL); revisions are consecutive (AUTOINCREMENT, never reused).
A file in the older layout (tables `groups` and `nodes`) is refused, not
silently read as empty.
Every `trim_every` writes through an instance the log is cut back to the
newest `change_log_retained` changes. Every method is synchronous and safe to
call from any thread; reads see every committed write (WAL readers start from
the latest commit).
"""

from __future__ import annotations

import builtins
import sqlite3
import threading
from collections.abc import Mapping
from typing import Any

from services.coordinator.store import CHANGE_LOG_RETAINED, Change, ChangesTrimmed, Record
from services.coordinator.store_rules import (
    check_expected_version,
    check_kind,
    check_name,
    check_retained,
    decode_value,
    encode_value,
)

_BUSY_TIMEOUT_MS = 10_000
_TRIM_EVERY = 1000

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS records ("
    " kind TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, version INTEGER NOT NULL,"
    " PRIMARY KEY (kind, key)) STRICT, WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS changes ("
    " revision INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, key TEXT NOT NULL,"
    " value TEXT, version INTEGER NOT NULL) STRICT",
)


class SqliteStore:
    """A `Store` in the SQLite file at `path` (created if absent)."""

    kind_name = "sqlite"

    def __init__(self, path: str, *, change_log_retained: int = CHANGE_LOG_RETAINED) -> None:
        check_retained(change_log_retained)
        self._retained = change_log_retained
        self._trim_every = min(_TRIM_EVERY, change_log_retained)
        self._writes = 0
        self._lock = threading.Lock()
        # isolation_level=None: no implicit transactions; we BEGIN and COMMIT ourselves.
        self._conn = sqlite3.connect(
            path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
        try:
            self._conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise RuntimeError(f"SQLite refused WAL journal mode for {path!r} (got {mode!r})")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("BEGIN IMMEDIATE")
            old = self._conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ('groups', 'nodes')"
            ).fetchall()
            if old:
                self._conn.execute("ROLLBACK")
                raise RuntimeError(
                    f"{path} was written by an older coordinator (tables groups, nodes) that this one does not read;"
                    " remove the file to start afresh"
                )
            for statement in _SCHEMA:
                self._conn.execute(statement)
            self._conn.execute("COMMIT")
        except BaseException:
            self._conn.close()
            raise

    def get(self, kind: str, key: str) -> Record | None:
        check_name(kind, key)
        with self._lock:
            row = self._conn.execute(
                "SELECT value, version FROM records WHERE kind = ? AND key = ?", (kind, key)
            ).fetchone()
        if row is None:
            return None
        return Record(kind, key, decode_value(row[0]), int(row[1]))

    def list(self, kind: str) -> list[Record]:
        check_kind(kind)
        with self._lock:
            rows = self._conn.execute("SELECT key, value, version FROM records WHERE kind = ?", (kind,)).fetchall()
        records = [Record(kind, str(key), decode_value(value), int(version)) for key, value, version in rows]
        return sorted(records, key=lambda record: record.key)

    def put(self, kind: str, key: str, value: Mapping[str, Any], expected_version: int) -> Record | None:
        check_name(kind, key)
        check_expected_version(expected_version)
        text = encode_value(value)
        with self._lock, self._transaction():
            if self._version(kind, key) != expected_version:
                return None
            version = expected_version + 1
            self._conn.execute(
                "INSERT INTO records (kind, key, value, version) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value, version = excluded.version",
                (kind, key, text, version),
            )
            self._log(kind, key, text, version)
        return Record(kind, key, decode_value(text), version)

    def delete(self, kind: str, key: str, expected_version: int) -> bool:
        check_name(kind, key)
        check_expected_version(expected_version)
        with self._lock, self._transaction():
            if expected_version == 0 or self._version(kind, key) != expected_version:
                return False
            self._conn.execute("DELETE FROM records WHERE kind = ? AND key = ?", (kind, key))
            self._log(kind, key, None, expected_version)
        return True

    def changes_since(self, revision: int, limit: int = 1000) -> tuple[builtins.list[Change], int]:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        with self._lock, self._transaction(write=False):  # one snapshot for the bounds and the rows
            first, latest = self._conn.execute("SELECT MIN(revision), MAX(revision) FROM changes").fetchone()
            if first is None:
                return [], 0
            if revision < first - 1:
                raise ChangesTrimmed(f"revision {revision} is older than the change log (first kept: {first})")
            rows = self._conn.execute(
                "SELECT revision, kind, key, value, version FROM changes WHERE revision > ? ORDER BY revision LIMIT ?",
                (revision, limit),
            ).fetchall()
        changes = []
        for rev, kind, key, value, version in rows:
            record = None if value is None else Record(kind, key, decode_value(value), int(version))
            changes.append(Change(int(rev), str(kind), str(key), record))
        return changes, int(latest)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ------------------------------------------------------------------ internals (caller holds the lock)

    def _transaction(self, *, write: bool = True) -> _Transaction:
        return _Transaction(self._conn, "BEGIN IMMEDIATE" if write else "BEGIN")

    def _version(self, kind: str, key: str) -> int:
        row = self._conn.execute("SELECT version FROM records WHERE kind = ? AND key = ?", (kind, key)).fetchone()
        return 0 if row is None else int(row[0])

    def _log(self, kind: str, key: str, text: str | None, version: int) -> None:
        self._conn.execute(
            "INSERT INTO changes (kind, key, value, version) VALUES (?, ?, ?, ?)", (kind, key, text, version)
        )
        self._writes += 1
        if self._writes % self._trim_every == 0:
            # Keep the newest `retained` changes: delete below the retained-th newest revision.
            self._conn.execute(
                "DELETE FROM changes WHERE revision <"
                " (SELECT revision FROM changes ORDER BY revision DESC LIMIT 1 OFFSET ?)",
                (self._retained - 1,),
            )


class _Transaction:
    """BEGIN on entry; COMMIT on a normal exit (also an early return), ROLLBACK on an exception."""

    def __init__(self, conn: sqlite3.Connection, begin: str) -> None:
        self._conn = conn
        self._begin = begin

    def __enter__(self) -> None:
        self._conn.execute(self._begin)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            try:
                self._conn.execute("COMMIT")
                return
            except BaseException:
                self._rollback()
                raise
        self._rollback()

    def _rollback(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")
