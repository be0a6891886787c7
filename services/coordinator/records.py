"""Typed records over any `Store`: group tables, broker nodes and node heartbeats.

Responsible for: how the coordinator's values are kept as store records, and
every read-modify-write on them as a compare-and-set on the record version:

    kind "group"      key: group name  value {"members": [{"id", "node", "alive"}, ...]}
    kind "node"       key: node id     value {"address", "draining"}
    kind "heartbeat"  key: node id     value {"at_unix_ms", "disk_alarm", "memory_alarm",
                                             "disk_free_bytes"?, "disk_free_limit_bytes"?,
                                             "memory_used_bytes"?, "memory_high_watermark_bytes"?}

Heartbeats are their own kind so that watchers of "node" records (membership,
addresses, draining) are not woken by every heartbeat. A heartbeat carries the
node's disk report (services/disk_monitor.py), shown with the node: its free
bytes and limit are left out when the node did not send them (an older node),
and its alarm is then off.

Guarantees:
- A group's version is its record's version: a group never written reads as
  version 0 with no members, and `group_table.apply` of CreateGroup to it
  yields version 1, the version of a record's first put. Groups are never
  deleted, so a group's version never goes back.
- `change_group` applies `group_table.apply` to the group it read and writes
  the result only if the record still has the version it read: of several
  callers that decided from the same version exactly one gets APPLIED; the
  others get VERSION_CONFLICT with the group as it is now (re-read), so they
  can re-decide. A change that leaves the group as it is writes nothing.
- `register_node`, `set_node_draining` and `node_heartbeat` retry their
  compare-and-set until it lands, so concurrent callers lose no update:
  re-registering keeps `draining`; a heartbeat never moves backwards.
- Store errors (StoreUnavailable, ValueError for an unusable key) propagate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.coordinator import group_table
from services.coordinator.group_table import Group, GroupChange, GroupMember, Outcome
from services.coordinator.store import Record, Store

GROUP = "group"
NODE = "node"
HEARTBEAT = "heartbeat"


# ---------------------------------------------------------------------------------------------- groups


def read_group(store: Store, name: str) -> Group:
    """The group `name` (version 0 with no members if it was never written)."""
    return group_from_record(name, store.get(GROUP, name))


def change_group(store: Store, name: str, change: GroupChange) -> tuple[Outcome, Group]:
    """Apply `change` to group `name` as a compare-and-set; returns the outcome and the group after it."""
    before = read_group(store, name)
    outcome, after = group_table.apply(before, change)
    if outcome is not Outcome.APPLIED or after.version == before.version:
        return outcome, after
    written = store.put(GROUP, name, _group_value(after), before.version)
    if written is None:  # someone else changed it since we read it
        return Outcome.VERSION_CONFLICT, read_group(store, name)
    if written.version != after.version:
        raise RuntimeError(f"group {name!r}: the store wrote version {written.version}, expected {after.version}")
    return outcome, after


def _group_value(group: Group) -> dict[str, Any]:
    return {"members": [{"id": m.id, "node": m.node, "alive": m.alive} for m in group.members]}


def list_groups(store: Store, node: str, after: str, limit: int) -> tuple[list[Group], str]:
    """Up to `limit` groups in name order whose name sorts after `after`, only those with a member on `node`
    unless it is "", and the `after` of the next page ("" when this one is the last)."""
    page: list[Group] = []
    for record in store.list(GROUP):
        if record.key <= after:
            continue
        group = group_from_record(record.key, record)
        if node and not any(member.node == node for member in group.members):
            continue
        if len(page) == limit:
            return page, page[-1].name
        page.append(group)
    return page, ""


def group_from_record(name: str, record: Record | None) -> Group:
    if record is None:
        return Group(name)
    members = tuple(GroupMember(str(m["id"]), str(m["node"]), bool(m["alive"])) for m in record.value["members"])
    return Group(name, record.version, members)


# ---------------------------------------------------------------------------------------------- nodes


@dataclass(frozen=True)
class DiskReport:
    """What a node's heartbeat says of its disk (None: not said)."""

    free_bytes: int | None = None
    limit_bytes: int | None = None
    alarm: bool = False


NO_DISK_REPORT = DiskReport()


@dataclass(frozen=True)
class MemoryReport:
    """What a node's heartbeat says of its memory (None: not said)."""

    used_bytes: int | None = None
    watermark_bytes: int | None = None
    alarm: bool = False


NO_MEMORY_REPORT = MemoryReport()


@dataclass(frozen=True)
class NodeRecord:
    """A registered broker node, with its last heartbeat (None if never heard) and disk report."""

    node: str
    address: str
    draining: bool = False
    last_heartbeat_unix_ms: int | None = None
    disk: DiskReport = NO_DISK_REPORT
    memory: MemoryReport = NO_MEMORY_REPORT
    # Where the node serves other cluster members; "" means at `address`.
    cluster_address: str = ""
    # Where clients with a user certificate reach the node; "" means nowhere.
    certificate_address: str = ""


def register_node(
    store: Store, node: str, address: str, cluster_address: str = "", certificate_address: str = ""
) -> None:
    """Record `node` at `address`, serving members at `cluster_address` ("" : at `address`) and clients
    with user certificates at `certificate_address` ("": nowhere) (insert or update; an existing
    `draining` flag is kept)."""
    while True:
        record = store.get(NODE, node)
        draining = record is not None and bool(record.value.get("draining", False))
        value: dict[str, Any] = {"address": address, "draining": draining}
        if cluster_address:
            value["cluster_address"] = cluster_address
        if certificate_address:
            value["certificate_address"] = certificate_address
        if record is not None and dict(record.value) == value:
            return  # already so: wake no watcher
        if store.put(NODE, node, value, _version(record)) is not None:
            return


def forget_node_record(store: Store, node: str) -> None:
    """Delete `node`'s registration and last heartbeat (whatever their versions)."""
    for kind in (NODE, HEARTBEAT):
        while (record := store.get(kind, node)) is not None and not store.delete(kind, node, record.version):
            pass


def set_node_draining(store: Store, node: str, draining: bool) -> bool:
    """Set the node's `draining` flag; False if `node` is not registered."""
    while True:
        record = store.get(NODE, node)
        if record is None:
            return False
        if bool(record.value.get("draining", False)) == draining:
            return True
        if store.put(NODE, node, {**record.value, "draining": draining}, record.version) is not None:
            return True


def node_draining(store: Store, node: str) -> bool:
    """The node's `draining` flag (False if `node` is not registered)."""
    record = store.get(NODE, node)
    return record is not None and bool(record.value.get("draining", False))


def node_heartbeat(
    store: Store,
    node: str,
    at_unix_ms: int,
    disk: DiskReport = NO_DISK_REPORT,
    memory: MemoryReport = NO_MEMORY_REPORT,
) -> None:
    """Record that `node` was heard from at `at_unix_ms`, its disk and memory as the reports say (an
    older time than the recorded one is ignored, with its reports)."""
    value: dict[str, int | bool] = {"at_unix_ms": at_unix_ms, "disk_alarm": disk.alarm, "memory_alarm": memory.alarm}
    for key, figure in (
        ("disk_free_bytes", disk.free_bytes),
        ("disk_free_limit_bytes", disk.limit_bytes),
        ("memory_used_bytes", memory.used_bytes),
        ("memory_high_watermark_bytes", memory.watermark_bytes),
    ):
        if figure is not None:
            value[key] = figure
    while True:
        record = store.get(HEARTBEAT, node)
        if record is not None and int(record.value["at_unix_ms"]) >= at_unix_ms:
            return
        if store.put(HEARTBEAT, node, value, _version(record)) is not None:
            return


def placeable_nodes(store: Store, liveness_ms: int, now_unix_ms: int) -> list[str]:
    """The nodes new replicas may go to: heard from within `liveness_ms` and not draining."""
    return placeable(list_nodes(store), liveness_ms, now_unix_ms)


def placeable(nodes: Iterable[NodeRecord], liveness_ms: int, now_unix_ms: int) -> list[str]:
    """Of `nodes`, those new replicas may go to (see `placeable_nodes`), in their order."""
    return [
        node.node
        for node in nodes
        if not node.draining
        and node.last_heartbeat_unix_ms is not None
        and now_unix_ms - node.last_heartbeat_unix_ms < liveness_ms
    ]


def list_nodes(store: Store) -> list[NodeRecord]:
    """Every registered node, sorted by node id, with its last heartbeat (None if never heard)."""
    beats = {record.key: record.value for record in store.list(HEARTBEAT)}
    nodes = []
    for record in store.list(NODE):
        beat = beats.get(record.key)
        nodes.append(
            NodeRecord(
                record.key,
                str(record.value["address"]),
                bool(record.value.get("draining", False)),
                int(beat["at_unix_ms"]) if beat is not None else None,
                _disk_report(beat) if beat is not None else NO_DISK_REPORT,
                _memory_report(beat) if beat is not None else NO_MEMORY_REPORT,
                str(record.value.get("cluster_address", "")),
                str(record.value.get("certificate_address", "")),
            )
        )
    return nodes


def _disk_report(beat: Mapping[str, Any]) -> DiskReport:
    free, limit = beat.get("disk_free_bytes"), beat.get("disk_free_limit_bytes")
    return DiskReport(
        int(free) if free is not None else None,
        int(limit) if limit is not None else None,
        bool(beat.get("disk_alarm", False)),
    )


def _memory_report(beat: Mapping[str, Any]) -> MemoryReport:
    used, watermark = beat.get("memory_used_bytes"), beat.get("memory_high_watermark_bytes")
    return MemoryReport(
        int(used) if used is not None else None,
        int(watermark) if watermark is not None else None,
        bool(beat.get("memory_alarm", False)),
    )


def _version(record: Record | None) -> int:
    return 0 if record is None else record.version
