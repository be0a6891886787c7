"""Forgetting a node that is gone for good (RabbitMQ's `forget_cluster_node`).

Responsible for: removing a dead node from the cluster's records: its registration and heartbeat, the
queues that lived only on it (they cannot come back), and its place among the mirrors of the others
(placement then gives them a mirror elsewhere). Guarantees: a node heard from within the liveness
timeout is never forgotten (NodeAlive); each change is a compare-and-set of the record it changes, so a
queue changed meanwhile is read again, never overwritten; a queue whose master the node was keeps its
record for its mirrors' promotion (a master is changed only by a replica, by epoch).
"""

from __future__ import annotations

from dataclasses import replace

from services.coordinator import records
from services.coordinator.metadata import QUEUE, NotFound, QueueRecord, list_queues, queue_value, retry_until_set
from services.coordinator.store import Store


class NodeAlive(Exception):
    """The node was heard from lately: stop it before forgetting it."""


def forget_node(store: Store, node: str, liveness_ms: int, now_unix_ms: int) -> list[QueueRecord]:
    """Forget `node`; the queues deleted with it (they had no replica elsewhere)."""
    known = {n.node: n for n in records.list_nodes(store)}
    if node not in known:
        raise NotFound(f"no node {node!r} is registered")
    heard = known[node].last_heartbeat_unix_ms
    if heard is not None and now_unix_ms - heard < liveness_ms:
        raise NodeAlive(
            f"node {node!r} is alive (heard {(now_unix_ms - heard) / 1000:.1f} s ago): stop it before forgetting it"
        )
    records.forget_node_record(store, node)
    deleted = []
    for queue in list_queues(store):
        if node not in queue.replicas:
            continue
        if queue.replicas == {node}:
            if _delete_if_unchanged(store, queue):
                deleted.append(queue)
        else:
            _strike_mirror(store, queue, node)
    return deleted


def _delete_if_unchanged(store: Store, queue: QueueRecord) -> bool:
    """Delete `queue` if it still lives on its node only (False if it changed, e.g. got a mirror)."""

    def step() -> bool | None:
        current = store.get(QUEUE, queue.key)
        if current is None:
            return False
        if current.version != queue.version:
            return False
        return True if store.delete(QUEUE, queue.key, current.version) else None

    return retry_until_set(step)


def _strike_mirror(store: Store, queue: QueueRecord, node: str) -> None:
    if node not in queue.mirrors:
        return  # its master: left for its replicas
    struck = replace(
        queue,
        mirrors=tuple(m for m in queue.mirrors if m != node),
        synchronised_mirrors=tuple(m for m in queue.synchronised_mirrors if m != node),
    )
    store.put(QUEUE, queue.key, queue_value(struck), queue.version)  # changed meanwhile: placement settles it
