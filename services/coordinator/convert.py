"""Pure conversions between the group-table dataclasses and their protobuf messages."""

from __future__ import annotations

from ringq.v1 import coordinator_pb2, group_table_pb2
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

ChangeRequest = (
    coordinator_pb2.CreateGroupRequest
    | coordinator_pb2.AddMemberRequest
    | coordinator_pb2.MarkMemberDeadRequest
    | coordinator_pb2.EraseMembersRequest
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
            group=name, expected_version=version, member=change.member, actor=change.actor
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
        change = MarkMemberDead(version, request.member, request.actor)
    else:
        change = EraseMembers(version, tuple(request.members), request.actor)
    return request.group, change
