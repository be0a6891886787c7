"""What makes a queue a broker group of an ordered stream, for placement and for the queue itself.

Responsible for: the reserved queue names of stream groups (`stream/STREAM/N`), and the fixed
definition every group has whatever the policies say: exactly two replicas on two nodes, synced
automatically, confirming only with its mirror synchronised. Guarantees: a group is placed on two
distinct nodes when two are live; a group whose mirror is not synchronised and alive refuses sends
(services/queue/replica_core.py), so a stream never holds a message in one copy only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.coordinator.metadata import QueueRecord

STREAM_QUEUE_PREFIX = "stream/"
GROUP_DEFINITION: Mapping[str, Any] = {
    "ha-mode": "exactly",
    "ha-params": 2,
    "ha-sync-mode": "automatic",
    "ha-min-synchronised": 1,
    "ha-promote-on-failure": "when-synced",
}


def is_stream_group(queue_name: str) -> bool:
    return queue_name.startswith(STREAM_QUEUE_PREFIX)


def group_queue(stream: str, number: int) -> str:
    """The queue name of group `number` of `stream`."""
    return f"{STREAM_QUEUE_PREFIX}{stream}/{number}"


def group_whole(group: QueueRecord, live_nodes: Collection[str]) -> bool:
    """Whether a group may take sends as the coordinator sees it: its master and its one mirror live, on
    two nodes, the mirror synchronised."""
    mirror = group.mirrors[0] if len(group.mirrors) == 1 else ""
    return (
        bool(group.master)
        and bool(mirror)
        and mirror != group.master
        and mirror in group.synchronised_mirrors
        and group.master in live_nodes
        and mirror in live_nodes
    )
