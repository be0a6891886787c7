"""The contract every coordinator store meets: versioned records with
compare-and-set, and a change log to watch.

Responsible for: the interface between the coordinator's logic (group
tables, nodes, queues, policies, leases: services/coordinator/records.py) and
where it is kept: one SQLite file (sqlite_store.py, the default) or a
ZooKeeper ensemble (zookeeper_store.py, several coordinators). Both pass the
same contract tests (tests/test_store_contract.py).

Guarantees every implementation gives:
- A record is a JSON object under (kind, key) with a version: 1 when
  created, +1 on every change, never reused while the record exists.
- `put` and `delete` are compare-and-set on that version: of several writers
  that read the same version, exactly one succeeds; the others get a
  conflict and re-read. A write that has returned is durable.
- Reads are linearizable: a `get` or `list` that begins after a write
  returned sees it (ZooKeeper syncs before reading), whichever coordinator
  process serves the read.
- Every successful `put` and `delete` appends one `Change` to a store-wide
  log, atomically with the write; revisions strictly increase. The log keeps
  at least the last `CHANGE_LOG_RETAINED` changes; reading from a revision
  older than that raises `ChangesTrimmed` (the reader re-lists).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

# Kinds and keys name ZooKeeper znodes and SQLite rows: keep them printable. A key fits the longest
# queue key: a vhost and a name of 255 bytes each (ringq.names), both percent-quoted (3 x 255 + 1 + 3 x 255).
MAX_KEY_LENGTH = 2048
CHANGE_LOG_RETAINED = 10_000


@dataclass(frozen=True)
class Record:
    """One stored record."""

    kind: str
    key: str
    value: Mapping[str, Any]
    version: int


@dataclass(frozen=True)
class Change:
    """One entry of the change log: `record` is None when the record was deleted."""

    revision: int
    kind: str
    key: str
    record: Record | None


class ChangesTrimmed(Exception):
    """The requested revision is older than the retained change log."""


class StoreUnavailable(Exception):
    """The store cannot be reached (ZooKeeper lost its session or quorum)."""


class Store(Protocol):
    """Versioned records with compare-and-set and a change log (see the module docstring)."""

    # "sqlite" or "zookeeper", for cluster_status.
    kind_name: str

    def get(self, kind: str, key: str) -> Record | None:
        """The record, or None if absent."""
        ...

    def list(self, kind: str) -> list[Record]:
        """Every record of `kind`, sorted by key."""
        ...

    def put(self, kind: str, key: str, value: Mapping[str, Any], expected_version: int) -> Record | None:
        """Write `value` if the record's version is `expected_version` (0: it must
        not exist). Returns the new record, or None on a conflict."""
        ...

    def delete(self, kind: str, key: str, expected_version: int) -> bool:
        """Delete the record if its version is `expected_version`; False on a conflict or if absent."""
        ...

    def changes_since(self, revision: int, limit: int = 1000) -> tuple[builtins.list[Change], int]:
        """Changes after `revision` (oldest first, at most `limit`) and the latest
        revision in the log; raises ChangesTrimmed if `revision` was trimmed."""
        ...

    def close(self) -> None:
        """Release connections; the store is unusable afterwards."""
        ...
