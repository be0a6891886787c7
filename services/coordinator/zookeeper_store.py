"""A `Store` (services/coordinator/store.py) in a ZooKeeper ensemble, for several coordinators.

Responsible for: versioned records and the change log as znodes under `root`:

    {root}/records/{kind}/{key}   the record's value as JSON; record version = znode version + 1
    {root}/changes/c-NNNNNNNNNN   one change (JSON: kind, key, value or null, version),
                                  sequential; revision = sequence number + 1

Kinds and keys are percent-encoded path components (urllib.parse.quote with
nothing safe; "." and ".." are encoded too), so any printable text is a valid key.

Guarantees (beyond the contract):
- Each `put`/`delete` is one ZooKeeper multi-op: the versioned create,
  set_data or delete of the record plus the create of its change znode, so the
  write and its log entry commit together or not at all. A version mismatch
  (BadVersion, NodeExists, NoNode inside the transaction) is a conflict:
  `put` returns None, `delete` returns False.
- Reads `sync` first (pipelined ahead of the read on the same session, which
  ZooKeeper answers in order), so they see every write acknowledged before
  they began, through any server of the ensemble.
- Revisions follow ZooKeeper's sequence numbers, assigned by the leader in
  commit order: strictly increasing. `changes_since(r)` raises ChangesTrimmed
  when the log is non-empty and r < (oldest retained revision - 1): trimming
  deletes oldest first, so this never misses a change; should the sequence
  numbers ever have gaps it can only err towards ChangesTrimmed (a re-list).
  Sequence numbers are 32-bit: the log is good for 2^31 writes per root.
- Every `trim_every` writes through an instance (min(1000, change_log_retained))
  the oldest changes beyond `change_log_retained` are deleted; concurrent
  trimmers only ever delete a prefix of the log.
- Losing the connection, the session or the quorum, or a call not answered
  within `timeout` seconds, raises StoreUnavailable; while the client is not
  connected every call raises it at once (nothing is queued for later). A
  write that raised it may or may not have been applied (it was in flight);
  retrying it is still a compare-and-set. The client reconnects by itself
  (backoff capped at 1 s).
Every method is synchronous and safe to call from any thread.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote

from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import (  # type: ignore[import-untyped]
    BadVersionError,
    ConnectionDropped,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    OperationTimeoutError,
    RequestTimeoutError,
    SessionExpiredError,
    SessionMovedError,
    ZookeeperStoppedError,
)
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]

from services.coordinator.store import CHANGE_LOG_RETAINED, Change, ChangesTrimmed, Record, StoreUnavailable
from services.coordinator.store_rules import (
    check_expected_version,
    check_kind,
    check_name,
    check_retained,
    decode_value,
    encode_value,
)

log = logging.getLogger(__name__)

_TRIM_EVERY = 1000
_CHANGE_PREFIX = "c-"
# Everything that means "ZooKeeper cannot answer now" (SessionExpiredError covers ConnectionClosedError).
_UNAVAILABLE = (
    ConnectionLoss,
    ConnectionDropped,
    SessionExpiredError,
    SessionMovedError,
    OperationTimeoutError,
    RequestTimeoutError,
    ZookeeperStoppedError,
    KazooTimeoutError,
)
_CONFLICTS = (BadVersionError, NodeExistsError, NoNodeError)
_RECONNECT = {"max_tries": -1, "delay": 0.05, "backoff": 2, "max_delay": 1.0}


def path_component(text: str) -> str:
    """`text` as one znode name: percent-encoded; "." and ".." (not valid znode names) encoded too."""
    quoted = quote(text, safe="")
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


class ZooKeeperStore:
    """A `Store` under the znode `root` of the ZooKeeper ensemble `hosts` ("host:port,host:port")."""

    kind_name = "zookeeper"

    def __init__(
        self,
        hosts: str,
        root: str = "/ringq",
        timeout: float = 10.0,
        *,
        change_log_retained: int = CHANGE_LOG_RETAINED,
    ) -> None:
        check_retained(change_log_retained)
        if not root.startswith("/"):
            raise ValueError(f"root must be an absolute znode path, got {root!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._hosts = hosts
        self._root = root.rstrip("/")
        self._timeout = timeout
        self._retained = change_log_retained
        self._trim_every = min(_TRIM_EVERY, change_log_retained)
        self._lock = threading.Lock()  # guards _writes and _kinds
        self._writes = 0
        self._kinds: set[str] = set()
        self._changes = f"{self._root}/changes"
        self._client = KazooClient(hosts=hosts, timeout=timeout, connection_retry=dict(_RECONNECT))
        try:
            self._client.start(timeout=timeout)
        except KazooTimeoutError:
            self._client.close()
            raise StoreUnavailable(f"cannot connect to ZooKeeper at {hosts} within {timeout:g} s") from None
        try:
            for path in (f"{self._root}/records", self._changes):
                self._wait(self._client.ensure_path_async(path))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ reads

    def get(self, kind: str, key: str) -> Record | None:
        check_name(kind, key)
        self._check_connected()
        synced = self._client.sync_async(self._root or "/")
        read = self._client.get_async(self._record_path(kind, key))
        self._wait(synced)
        try:
            data, stat = self._wait(read)
        except NoNodeError:
            return None
        return Record(kind, key, decode_value(data), stat.version + 1)

    def list(self, kind: str) -> list[Record]:
        check_kind(kind)
        self._check_connected()
        directory = self._kind_path(kind)
        synced = self._client.sync_async(self._root or "/")
        listed = self._client.get_children_async(directory)
        self._wait(synced)
        try:
            names: list[str] = self._wait(listed)
        except NoNodeError:
            return []
        reads = [(unquote(name), self._client.get_async(f"{directory}/{name}")) for name in names]
        records = []
        for key, read in reads:
            try:
                data, stat = self._wait(read)
            except NoNodeError:
                continue  # deleted since the listing
            records.append(Record(kind, key, decode_value(data), stat.version + 1))
        return sorted(records, key=lambda record: record.key)

    def changes_since(self, revision: int, limit: int = 1000) -> tuple[builtins.list[Change], int]:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self._check_connected()
        revisions = self._revisions()
        if not revisions:
            return [], 0
        first, latest = revisions[0], revisions[-1]
        if revision < first - 1:
            raise ChangesTrimmed(f"revision {revision} is older than the change log (first kept: {first})")
        wanted = [r for r in revisions if r > revision][:limit]
        reads = [(r, self._client.get_async(self._change_path(r))) for r in wanted]
        changes = []
        for rev, read in reads:
            try:
                data, _ = self._wait(read)
            except NoNodeError:
                raise ChangesTrimmed(f"change {rev} was trimmed while being read") from None
            entry = json.loads(data)
            kind, key = str(entry["kind"]), str(entry["key"])
            value = entry["value"]
            record = None if value is None else Record(kind, key, value, int(entry["version"]))
            changes.append(Change(rev, kind, key, record))
        return changes, latest

    # ------------------------------------------------------------------ writes

    def put(self, kind: str, key: str, value: Mapping[str, Any], expected_version: int) -> Record | None:
        check_name(kind, key)
        check_expected_version(expected_version)
        text = encode_value(value)
        data = text.encode()
        version = expected_version + 1
        change = _change_bytes(kind, key, text, version)
        path = self._record_path(kind, key)
        for attempt in range(2):
            self._check_connected()
            if expected_version == 0:
                self._ensure_kind(kind, known=attempt == 0)
            transaction = self._client.transaction()
            if expected_version == 0:
                transaction.create(path, data)
            else:
                transaction.set_data(path, data, version=expected_version - 1)
            transaction.create(f"{self._changes}/{_CHANGE_PREFIX}", change, sequence=True)
            results = self._wait(transaction.commit_async())
            failure = results[0]
            if isinstance(failure, NoNodeError) and expected_version == 0 and attempt == 0:
                continue  # the kind's directory is gone (or was never seen by this instance): re-create it
            if isinstance(failure, _CONFLICTS):
                return None
            _raise_failure(results)
            if expected_version > 0 and results[0].version + 1 != version:
                raise RuntimeError(f"ZooKeeper wrote version {results[0].version + 1} for {path}, expected {version}")
            self._wrote()
            return Record(kind, key, decode_value(text), version)
        return None

    def delete(self, kind: str, key: str, expected_version: int) -> bool:
        check_name(kind, key)
        check_expected_version(expected_version)
        if expected_version == 0:
            return False
        self._check_connected()
        transaction = self._client.transaction()
        transaction.delete(self._record_path(kind, key), version=expected_version - 1)
        transaction.create(
            f"{self._changes}/{_CHANGE_PREFIX}", _change_bytes(kind, key, None, expected_version), sequence=True
        )
        results = self._wait(transaction.commit_async())
        if isinstance(results[0], _CONFLICTS):
            return False
        _raise_failure(results)
        self._wrote()
        return True

    def trim(self) -> int:
        """Delete the oldest changes beyond `change_log_retained`; returns how many were deleted."""
        self._check_connected()
        revisions = self._revisions()
        victims = revisions[: max(0, len(revisions) - self._retained)]
        # Issued in order on one session, so ZooKeeper deletes a prefix of the log at every moment.
        deletes = [self._client.delete_async(self._change_path(r)) for r in victims]
        deleted = 0
        for pending in deletes:
            try:
                self._wait(pending)
                deleted += 1
            except NoNodeError:
                pass  # another coordinator trimmed it
        return deleted

    def close(self) -> None:
        try:
            self._client.stop()
        finally:
            self._client.close()

    # ------------------------------------------------------------------ internals

    def _kind_path(self, kind: str) -> str:
        return f"{self._root}/records/{path_component(kind)}"

    def _record_path(self, kind: str, key: str) -> str:
        return f"{self._kind_path(kind)}/{path_component(key)}"

    def _change_path(self, revision: int) -> str:
        return f"{self._changes}/{_CHANGE_PREFIX}{revision - 1:010d}"

    def _revisions(self) -> builtins.list[int]:
        """The revisions in the log, oldest first (after a sync)."""
        synced = self._client.sync_async(self._changes)
        listed = self._client.get_children_async(self._changes)
        self._wait(synced)
        names: list[str] = self._wait(listed)
        return sorted(int(name[len(_CHANGE_PREFIX) :]) + 1 for name in names if name.startswith(_CHANGE_PREFIX))

    def _ensure_kind(self, kind: str, *, known: bool) -> None:
        with self._lock:
            if known and kind in self._kinds:
                return
        with contextlib.suppress(NodeExistsError):
            self._wait(self._client.create_async(self._kind_path(kind), b""))
        with self._lock:
            self._kinds.add(kind)

    def _wrote(self) -> None:
        with self._lock:
            self._writes += 1
            due = self._writes % self._trim_every == 0
        if due:
            try:
                self.trim()
            except StoreUnavailable as exc:  # the write itself succeeded; the next trim catches up
                log.warning("could not trim the change log: %s", exc)

    def _check_connected(self) -> None:
        """StoreUnavailable unless connected: kazoo would queue the request and send it after reconnecting,
        possibly long after we reported the call failed."""
        if not self._client.connected:
            raise StoreUnavailable(f"not connected to ZooKeeper at {self._hosts} (reconnecting)")

    def _wait(self, pending: Any) -> Any:
        """The result of a kazoo async call; StoreUnavailable if ZooKeeper cannot answer in time."""
        try:
            return pending.get(timeout=self._timeout)
        except _UNAVAILABLE as exc:
            detail = str(exc) or type(exc).__name__
            raise StoreUnavailable(f"ZooKeeper at {self._hosts} is unavailable: {detail}") from exc


def _change_bytes(kind: str, key: str, value_text: str | None, version: int) -> bytes:
    head = json.dumps({"kind": kind, "key": key, "version": version}, ensure_ascii=False)
    return f'{head[:-1]},"value":{value_text or "null"}}}'.encode()


def _raise_failure(results: list[Any]) -> None:
    """Raise the first real error of a failed transaction (the others are roll-back markers)."""
    errors = [r for r in results if isinstance(r, Exception)]
    if not errors:
        return
    real = [e for e in errors if type(e).__name__ not in ("RolledBackError", "RuntimeInconsistency")]
    error = (real or errors)[0]
    if isinstance(error, _UNAVAILABLE):
        raise StoreUnavailable(f"ZooKeeper transaction failed: {type(error).__name__}") from error
    raise RuntimeError(f"ZooKeeper transaction failed: {type(error).__name__} (results {results!r})") from error
