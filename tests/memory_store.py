"""An in-memory Store meeting services/coordinator/store.py's contract, for fast
unit tests of the logic above the store (the real ones are SQLite and ZooKeeper)."""

from __future__ import annotations

import builtins
import copy
import threading
from collections.abc import Mapping
from typing import Any

from services.coordinator.store import CHANGE_LOG_RETAINED, Change, ChangesTrimmed, Record


class MemoryStore:
    kind_name = "memory"

    def __init__(self, change_log_retained: int = CHANGE_LOG_RETAINED) -> None:
        self._records: dict[tuple[str, str], Record] = {}
        self._changes: list[Change] = []
        self._revision = 0
        self._retained = change_log_retained
        self._lock = threading.Lock()

    def get(self, kind: str, key: str) -> Record | None:
        with self._lock:
            return self._records.get((kind, key))

    def list(self, kind: str) -> list[Record]:
        with self._lock:
            return sorted((r for (k, _), r in self._records.items() if k == kind), key=lambda r: r.key)

    def put(self, kind: str, key: str, value: Mapping[str, Any], expected_version: int) -> Record | None:
        with self._lock:
            current = self._records.get((kind, key))
            if (current.version if current else 0) != expected_version:
                return None
            record = Record(kind, key, copy.deepcopy(dict(value)), expected_version + 1)
            self._records[(kind, key)] = record
            self._log(kind, key, record)
            return record

    def delete(self, kind: str, key: str, expected_version: int) -> bool:
        with self._lock:
            current = self._records.get((kind, key))
            if current is None or current.version != expected_version:
                return False
            del self._records[(kind, key)]
            self._log(kind, key, None)
            return True

    def changes_since(self, revision: int, limit: int = 1000) -> tuple[builtins.list[Change], int]:
        with self._lock:
            if self._changes and revision < self._changes[0].revision - 1:
                raise ChangesTrimmed(f"revision {revision} is older than {self._changes[0].revision}")
            return [c for c in self._changes if c.revision > revision][:limit], self._revision

    def close(self) -> None:
        pass

    def _log(self, kind: str, key: str, record: Record | None) -> None:
        self._revision += 1
        self._changes.append(Change(self._revision, kind, key, record))
        del self._changes[: -self._retained]
