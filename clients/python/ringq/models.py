"""What the SDK's calls return: frozen dataclasses, not the protobuf messages of the wire.

Responsible for: one dataclass per thing a caller is told about (a queue's status, a queue's record, a
policy, the cluster and its nodes, users and permissions) and building each from its ringq.v1 message
(`from_proto`). Guarantees: fields are plain Python values (str, int, bool, tuples, dicts; None where the
node did not say); JSON texts of the wire (policy definitions, queue arguments) are decoded; the blocking
API (`ringq.Connection`, `ringq.Admin`) and the asyncio API (`ringq.aio`) return the same classes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ringq.v1 import access_pb2, cluster_pb2, queue_pb2

__all__ = [
    "ClusterStatus",
    "CoordinatorStatus",
    "NodeStatus",
    "Permission",
    "Policy",
    "QueueEvent",
    "QueueRecord",
    "QueueStatus",
    "User",
]

_REPLICATION = {
    cluster_pb2.REPLICATION_LEVEL_UNSPECIFIED: "",
    cluster_pb2.REPLICATION_LEVEL_NONE: "none",
    cluster_pb2.REPLICATION_LEVEL_WIRING: "wiring",
    cluster_pb2.REPLICATION_LEVEL_ALL: "all",
}


def _json(text: str) -> Any:
    """A JSON text of the wire, decoded (the text itself if it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class QueueEvent:
    """Something noteworthy that happened to a queue's replicas (`kind`: "promoted", "log_damaged", ...)."""

    time_unix_ms: int
    kind: str
    node: str
    detail: str

    @classmethod
    def from_proto(cls, event: queue_pb2.QueueEvent) -> QueueEvent:
        return cls(event.time_unix_ms, event.kind, event.node, event.detail)


@dataclass(frozen=True)
class QueueStatus:
    """A queue as its master sees it now (declare_queue and queue_status): `depth` is `ready` plus
    `unacked`; `status` is "running", or why the queue is not serving."""

    name: str
    vhost: str
    depth: int
    ready: int
    unacked: int
    consumers: int
    master_node: str
    master_address: str = ""
    mirrors: tuple[str, ...] = ()
    synchronised_mirrors: tuple[str, ...] = ()
    syncing: tuple[str, ...] = ()
    status: str = ""
    policy: str = ""
    events: tuple[QueueEvent, ...] = ()

    @classmethod
    def from_proto(cls, info: queue_pb2.QueueInfo) -> QueueStatus:
        return cls(
            name=info.queue.queue,
            vhost=info.queue.vhost,
            depth=info.depth,
            ready=info.ready,
            unacked=info.unacked,
            consumers=info.consumers,
            master_node=info.master_node,
            master_address=info.master_address,
            mirrors=tuple(info.mirrors),
            synchronised_mirrors=tuple(info.synchronised_mirrors),
            syncing=tuple(info.syncing),
            status=info.status,
            policy=info.policy,
            events=tuple(QueueEvent.from_proto(e) for e in info.events),
        )


@dataclass(frozen=True)
class QueueRecord:
    """A queue as the coordinator records it (Admin.list_queues): where its replicas are and what applies to
    it; `arguments` and `policy_definition` are decoded from JSON; `replication` is "all", "wiring",
    "none" (or "" when the policy decides)."""

    vhost: str
    name: str
    durable: bool = False
    auto_delete: bool = False
    exclusive_owner: str = ""
    arguments: Mapping[str, Any] = field(default_factory=dict)
    master: str = ""
    mirrors: tuple[str, ...] = ()
    synchronised_mirrors: tuple[str, ...] = ()
    policy: str = ""
    policy_definition: Mapping[str, Any] = field(default_factory=dict)
    gm_group: str = ""
    replication: str = ""
    version: int = 0
    master_epoch: int = 0
    recovery_positions: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, record: cluster_pb2.QueueRecord) -> QueueRecord:
        definition = _json(record.policy_definition_json) if record.policy_definition_json else {}
        return cls(
            vhost=record.vhost,
            name=record.name,
            durable=record.durable,
            auto_delete=record.auto_delete,
            exclusive_owner=record.exclusive_owner,
            arguments={k: _json(v) for k, v in record.arguments.items()},
            master=record.master,
            mirrors=tuple(record.mirrors),
            synchronised_mirrors=tuple(record.synchronised_mirrors),
            policy=record.policy,
            policy_definition=definition if isinstance(definition, dict) else {},
            gm_group=record.gm_group,
            replication=_REPLICATION.get(record.replication, ""),
            version=record.version,
            master_epoch=record.master_epoch,
            recovery_positions=dict(record.recovery_positions),
        )


@dataclass(frozen=True)
class Policy:
    """A policy: the highest `priority` whose `pattern` (RE2, searched in queue names) matches applies."""

    name: str
    pattern: str
    definition: Mapping[str, Any]
    vhost: str = "/"
    priority: int = 0
    apply_to: str = "queues"

    @classmethod
    def from_proto(cls, policy: cluster_pb2.Policy) -> Policy:
        definition = _json(policy.definition_json) if policy.definition_json else {}
        return cls(
            name=policy.name,
            pattern=policy.pattern,
            definition=definition if isinstance(definition, dict) else {},
            vhost=policy.vhost,
            priority=policy.priority,
            apply_to=policy.apply_to,
        )


@dataclass(frozen=True)
class NodeStatus:
    """A broker node as the coordinator knows it. The disk and memory figures are None until the node has
    reported them; the alarms are False then."""

    node: str
    address: str
    alive: bool
    draining: bool = False
    last_heartbeat_unix_ms: int = 0
    disk_free_bytes: int | None = None
    disk_free_limit_bytes: int | None = None
    disk_alarm: bool = False
    memory_used_bytes: int | None = None
    memory_high_watermark_bytes: int | None = None
    memory_alarm: bool = False
    cluster_address: str = ""
    certificate_address: str = ""

    @classmethod
    def from_proto(cls, node: cluster_pb2.NodeRecord) -> NodeStatus:
        def optional(name: str) -> int | None:
            return int(getattr(node, name)) if node.HasField(name) else None  # type: ignore[arg-type]

        return cls(
            node=node.node,
            address=node.address,
            alive=node.alive,
            draining=node.draining,
            last_heartbeat_unix_ms=node.last_heartbeat_unix_ms,
            disk_free_bytes=optional("disk_free_bytes"),
            disk_free_limit_bytes=optional("disk_free_limit_bytes"),
            disk_alarm=node.disk_alarm,
            memory_used_bytes=optional("memory_used_bytes"),
            memory_high_watermark_bytes=optional("memory_high_watermark_bytes"),
            memory_alarm=node.memory_alarm,
            cluster_address=node.cluster_address,
            certificate_address=node.certificate_address,
        )


@dataclass(frozen=True)
class CoordinatorStatus:
    """A coordinator serving the cluster's store."""

    address: str
    alive: bool


@dataclass(frozen=True)
class ClusterStatus:
    """The cluster (Admin.cluster_status): its nodes sorted by id, its coordinators, and the store kind
    ("sqlite" or "zookeeper")."""

    nodes: tuple[NodeStatus, ...]
    coordinators: tuple[CoordinatorStatus, ...]
    store_kind: str

    @classmethod
    def from_proto(cls, response: cluster_pb2.ClusterStatusResponse) -> ClusterStatus:
        return cls(
            nodes=tuple(NodeStatus.from_proto(n) for n in response.nodes),
            coordinators=tuple(CoordinatorStatus(c.address, c.alive) for c in response.coordinators),
            store_kind=response.store_kind,
        )

    def node(self, node_id: str) -> NodeStatus:
        """The node `node_id`; KeyError if the cluster does not know it."""
        for node in self.nodes:
            if node.node == node_id:
                return node
        raise KeyError(node_id)


@dataclass(frozen=True)
class User:
    """A user and its tags ("administrator", "monitoring", "policymaker", "management")."""

    name: str
    tags: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, user: access_pb2.UserInfo) -> User:
        return cls(user.name, tuple(user.tags))


@dataclass(frozen=True)
class Permission:
    """What `user` may do in `vhost`: RE2 patterns of the names it may configure, write to and read from."""

    user: str
    vhost: str
    configure: str = ""
    write: str = ""
    read: str = ""

    @classmethod
    def from_proto(cls, permission: access_pb2.Permission) -> Permission:
        return cls(permission.user, permission.vhost, permission.configure, permission.write, permission.read)
