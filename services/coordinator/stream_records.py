"""An ordered stream's record in the coordinator's store: its broker groups and its send and consume lists
(services/coordinator/stream_lists.py), so that SQLite or ZooKeeper keeps them.

Responsible for: declaring a stream's record, reading and listing them, applying one lists operation by
compare-and-set (re-read and recomputed on a conflict, so concurrent coordinators never lose a change),
and deleting a record. The groups themselves are queues (named by `group_queue`) that the caller
declares; this module keeps only which they are and the lists.

Guarantees: every change of a stream's lists is one compare-and-set of its record, computed by the pure
rules from the record as stored; `pick` returns a group only once the record naming it in the consume
list is stored (rule 1 of stream_lists.py holds across coordinator crashes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ringq.names import check_name
from services.coordinator.metadata import Conflict, NotFound, QueueMismatch, retry_until_set
from services.coordinator.store import Record, Store
from services.coordinator.stream_groups import group_queue
from services.coordinator.stream_lists import StreamLists

STREAM = "stream"
MIN_GROUPS = 2
MAX_GROUPS = 64


@dataclass(frozen=True)
class StreamRecord:
    vhost: str
    name: str
    durable: bool
    lists: StreamLists
    version: int = 0

    @property
    def groups(self) -> tuple[str, ...]:
        return self.lists.groups


def stream_key(vhost: str, name: str) -> str:
    return f"{quote(vhost, safe='')}/{quote(name, safe='')}"


def declare_stream(store: Store, vhost: str, name: str, groups: int, durable: bool) -> StreamRecord:
    """The stream's record, created with `groups` groups (or the existing one if it matches: QueueMismatch
    if its group count or durability differ; ValueError for a count out of range)."""
    check_name("vhost", vhost)
    check_name("name", name)
    if not MIN_GROUPS <= groups <= MAX_GROUPS:
        raise ValueError(f"groups must be {MIN_GROUPS} to {MAX_GROUPS}, got {groups}")
    names = [group_queue(name, number) for number in range(1, groups + 1)]
    for group in names:
        check_name("group queue name", group)
    key = stream_key(vhost, name)

    def step() -> StreamRecord | None:
        existing = store.get(STREAM, key)
        if existing is not None:
            stream = _from_record(existing)
            if (len(stream.groups), stream.durable) != (groups, durable):
                raise QueueMismatch(
                    "groups" if len(stream.groups) != groups else "durable",
                    f"stream {name!r} exists with {len(stream.groups)} groups, durable={stream.durable}; "
                    f"declared with {groups} groups, durable={durable}",
                )
            return stream
        fresh = StreamRecord(vhost, name, durable, StreamLists.new(names))
        written = store.put(STREAM, key, _value(fresh), 0)
        return _from_record(written) if written is not None else None

    return retry_until_set(step)


def get_stream(store: Store, vhost: str, name: str) -> StreamRecord:
    record = store.get(STREAM, stream_key(vhost, name))
    if record is None:
        raise NotFound(f"no stream {name!r} in vhost {vhost!r}")
    return _from_record(record)


def list_streams(store: Store, vhost: str = "") -> list[StreamRecord]:
    streams = [_from_record(record) for record in store.list(STREAM)]
    return sorted((s for s in streams if not vhost or s.vhost == vhost), key=lambda s: (s.vhost, s.name))


def change_lists(store: Store, vhost: str, name: str, operation: Callable[[StreamLists], StreamLists]) -> StreamRecord:
    """Apply `operation` to the stream's lists as stored, by compare-and-set (recomputed on a conflict)."""
    key = stream_key(vhost, name)

    def step() -> StreamRecord | None:
        current = get_stream(store, vhost, name)
        changed = operation(current.lists)
        if changed == current.lists:
            return current
        written = store.put(STREAM, key, _value(StreamRecord(vhost, name, current.durable, changed)), current.version)
        return _from_record(written) if written is not None else None

    return retry_until_set(step)


def pick(store: Store, vhost: str, name: str) -> tuple[StreamRecord, str | None]:
    """Where the stream's producer sends: the group, returned once the record naming it is stored."""
    picked: list[str | None] = []

    def operation(lists: StreamLists) -> StreamLists:
        picked.clear()
        after, group = lists.pick()
        picked.append(group)
        return after

    record = change_lists(store, vhost, name, operation)
    return record, picked[-1]


def delete_stream(store: Store, vhost: str, name: str) -> StreamRecord:
    """Delete the stream's record; the record as it was (its groups' queues are the caller's to delete)."""
    key = stream_key(vhost, name)

    def step() -> StreamRecord | None:
        current = get_stream(store, vhost, name)
        return current if store.delete(STREAM, key, current.version) else None

    try:
        return retry_until_set(step)
    except Conflict:
        raise Conflict(f"stream {name!r} kept changing while it was being deleted; try again") from None


def _value(stream: StreamRecord) -> dict[str, Any]:
    lists = stream.lists
    return {
        "vhost": stream.vhost,
        "name": stream.name,
        "durable": stream.durable,
        "groups": list(lists.groups),
        "send": list(lists.send),
        "consume": list(lists.consume),
        "down": sorted(lists.down),
        "generations": dict(lists.generations),
        "consumed_through": lists.consumed_through,
    }


def _from_record(record: Record) -> StreamRecord:
    v = record.value
    lists = StreamLists(
        groups=tuple(v["groups"]),
        send=tuple(v["send"]),
        consume=tuple(v["consume"]),
        down=frozenset(v["down"]),
        generations={str(group): int(n) for group, n in v["generations"].items()},
        consumed_through=int(v.get("consumed_through", 0)),
    )
    return StreamRecord(str(v["vhost"]), str(v["name"]), bool(v["durable"]), lists, record.version)
