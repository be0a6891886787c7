"""Pure conversions between the group-table dataclasses and their protobuf messages."""

from __future__ import annotations

import json

from ringq.internal.v1 import coordinator_pb2, group_table_pb2
from ringq.v1 import cluster_pb2
from services.coordinator.group_table import (
    AddMember,
    CreateGroup,
    EraseMembers,
    Group,
    GroupChange,
    GroupMember,
    MarkMemberDead,
    Outcome,
)
from services.coordinator.leases import Lease
from services.coordinator.metadata import QueueRecord
from services.coordinator.policies import Policy, parse_definition
from services.coordinator.records import DiskReport, MemoryReport, NodeRecord

ChangeRequest = (
    coordinator_pb2.CreateGroupRequest
    | coordinator_pb2.AddMemberRequest
    | coordinator_pb2.MarkMemberDeadRequest
    | coordinator_pb2.EraseMembersRequest
)
ChangeResponse = (
    coordinator_pb2.CreateGroupResponse
    | coordinator_pb2.AddMemberResponse
    | coordinator_pb2.MarkMemberDeadResponse
    | coordinator_pb2.EraseMembersResponse
)

_OUTCOME_TO_PROTO: dict[Outcome, coordinator_pb2.GroupChangeOutcome.ValueType] = {
    Outcome.APPLIED: coordinator_pb2.GROUP_CHANGE_OUTCOME_APPLIED,
    Outcome.VERSION_CONFLICT: coordinator_pb2.GROUP_CHANGE_OUTCOME_VERSION_CONFLICT,
    Outcome.ACTOR_NOT_ALIVE: coordinator_pb2.GROUP_CHANGE_OUTCOME_ACTOR_NOT_ALIVE,
}
_OUTCOME_FROM_PROTO = {value: outcome for outcome, value in _OUTCOME_TO_PROTO.items()}


def member_to_proto(member: GroupMember) -> group_table_pb2.GroupMember:
    return group_table_pb2.GroupMember(id=member.id, node=member.node, alive=member.alive)


def member_from_proto(pb: group_table_pb2.GroupMember) -> GroupMember:
    return GroupMember(pb.id, pb.node, pb.alive)


def group_to_proto(group: Group) -> group_table_pb2.Group:
    return group_table_pb2.Group(
        name=group.name, version=group.version, members=[member_to_proto(m) for m in group.members]
    )


def group_from_proto(pb: group_table_pb2.Group) -> Group:
    return Group(pb.name, pb.version, tuple(member_from_proto(m) for m in pb.members))


def outcome_to_proto(outcome: Outcome) -> coordinator_pb2.GroupChangeOutcome.ValueType:
    return _OUTCOME_TO_PROTO[outcome]


def outcome_from_proto(value: int) -> Outcome:
    """The outcome for a wire value; ValueError for UNSPECIFIED or an unknown value."""
    try:
        return _OUTCOME_FROM_PROTO[coordinator_pb2.GroupChangeOutcome.ValueType(value)]
    except KeyError:
        raise ValueError(f"not a group change outcome: {value}") from None


def change_to_request(name: str, change: GroupChange) -> ChangeRequest:
    """The request message that asks the coordinator to make `change` to group `name`."""
    version = change.expected_version
    if isinstance(change, CreateGroup):
        return coordinator_pb2.CreateGroupRequest(
            group=name, expected_version=version, creator=member_to_proto(change.creator)
        )
    if isinstance(change, AddMember):
        return coordinator_pb2.AddMemberRequest(
            group=name, expected_version=version, left=change.left, newcomer=member_to_proto(change.newcomer)
        )
    if isinstance(change, MarkMemberDead):
        return coordinator_pb2.MarkMemberDeadRequest(
            group=name, expected_version=version, member=change.member, actor=change.actor, joining=change.joining
        )
    return coordinator_pb2.EraseMembersRequest(
        group=name, expected_version=version, members=list(change.members), actor=change.actor
    )


def change_from_request(request: ChangeRequest) -> tuple[str, GroupChange]:
    """The group name and change a request carries (the server side of `change_to_request`)."""
    version = request.expected_version
    change: GroupChange
    if isinstance(request, coordinator_pb2.CreateGroupRequest):
        change = CreateGroup(version, member_from_proto(request.creator))
    elif isinstance(request, coordinator_pb2.AddMemberRequest):
        change = AddMember(version, request.left, member_from_proto(request.newcomer))
    elif isinstance(request, coordinator_pb2.MarkMemberDeadRequest):
        change = MarkMemberDead(version, request.member, request.actor, request.joining)
    else:
        change = EraseMembers(version, tuple(request.members), request.actor)
    return request.group, change


# ------------------------------------------------------------------------------- metadata records

REPLICATION_TO_PROTO = {
    "none": cluster_pb2.REPLICATION_LEVEL_NONE,
    "wiring": cluster_pb2.REPLICATION_LEVEL_WIRING,
    "all": cluster_pb2.REPLICATION_LEVEL_ALL,
}
REPLICATION_FROM_PROTO = {value: name for name, value in REPLICATION_TO_PROTO.items()}


def node_to_proto(node: NodeRecord, alive: bool) -> cluster_pb2.NodeRecord:
    return cluster_pb2.NodeRecord(
        node=node.node,
        address=node.address,
        draining=node.draining,
        alive=alive,
        last_heartbeat_unix_ms=node.last_heartbeat_unix_ms or 0,
        disk_free_bytes=node.disk.free_bytes,
        disk_free_limit_bytes=node.disk.limit_bytes,
        disk_alarm=node.disk.alarm,
        memory_used_bytes=node.memory.used_bytes,
        memory_high_watermark_bytes=node.memory.watermark_bytes,
        memory_alarm=node.memory.alarm,
        cluster_address=node.cluster_address,
        certificate_address=node.certificate_address,
    )


def disk_report_from_heartbeat(request: coordinator_pb2.NodeHeartbeatRequest) -> DiskReport:
    """The disk report a heartbeat carries; what it leaves out stays unknown (the alarm: off)."""
    return DiskReport(
        request.disk_free_bytes if request.HasField("disk_free_bytes") else None,
        request.disk_free_limit_bytes if request.HasField("disk_free_limit_bytes") else None,
        request.disk_alarm,
    )


def memory_report_from_heartbeat(request: coordinator_pb2.NodeHeartbeatRequest) -> MemoryReport:
    """The memory report a heartbeat carries; what it leaves out stays unknown (the alarm: off)."""
    return MemoryReport(
        request.memory_used_bytes if request.HasField("memory_used_bytes") else None,
        request.memory_high_watermark_bytes if request.HasField("memory_high_watermark_bytes") else None,
        request.memory_alarm,
    )


def queue_to_proto(queue: QueueRecord) -> cluster_pb2.QueueRecord:
    return cluster_pb2.QueueRecord(
        vhost=queue.vhost,
        name=queue.name,
        durable=queue.durable,
        auto_delete=queue.auto_delete,
        exclusive_owner=queue.exclusive_owner,
        arguments=dict(queue.arguments),
        master=queue.master,
        mirrors=queue.mirrors,
        synchronised_mirrors=queue.synchronised_mirrors,
        policy=queue.policy,
        policy_definition_json=json.dumps(dict(queue.policy_definition), sort_keys=True),
        gm_group=queue.gm_group,
        replication=REPLICATION_TO_PROTO.get(queue.replication, cluster_pb2.REPLICATION_LEVEL_UNSPECIFIED),
        recovery_positions=dict(queue.recovery_positions),
        master_epoch=queue.master_epoch,
        version=queue.version,
    )


def queue_from_proto(pb: cluster_pb2.QueueRecord) -> QueueRecord:
    """The record's fields; raises ValueError for an unparsable policy definition."""
    return QueueRecord(
        vhost=pb.vhost,
        name=pb.name,
        durable=pb.durable,
        auto_delete=pb.auto_delete,
        exclusive_owner=pb.exclusive_owner,
        arguments=dict(pb.arguments),
        master=pb.master,
        mirrors=tuple(pb.mirrors),
        synchronised_mirrors=tuple(pb.synchronised_mirrors),
        policy=pb.policy,
        policy_definition=json.loads(pb.policy_definition_json or "{}"),
        gm_group=pb.gm_group,
        replication=REPLICATION_FROM_PROTO.get(pb.replication, "all"),
        recovery_positions=dict(pb.recovery_positions),
        master_epoch=pb.master_epoch,
        version=pb.version,
    )


def policy_to_proto(policy: Policy) -> cluster_pb2.Policy:
    return cluster_pb2.Policy(
        vhost=policy.vhost,
        name=policy.name,
        pattern=policy.pattern,
        definition_json=json.dumps(dict(policy.definition), sort_keys=True),
        priority=policy.priority,
        apply_to=policy.apply_to,
    )


def policy_from_proto(pb: cluster_pb2.Policy) -> Policy:
    """The policy; PolicyError (key "definition") if its definition is not a JSON object."""
    definition = parse_definition(pb.definition_json)
    return Policy(pb.vhost or "/", pb.name, pb.pattern, definition, pb.priority, pb.apply_to or "queues")


def lease_to_proto(lease: Lease) -> cluster_pb2.Lease:
    return cluster_pb2.Lease(
        name=lease.name, holder=lease.holder, token=lease.token, expires_at_unix_ms=lease.expires_at_ms
    )
