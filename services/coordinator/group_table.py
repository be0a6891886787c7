"""The group table: pure rules for changing one GM ring's membership.

Responsible for: the four changes a ring makes to its group (create, add a
member right of a live one, record a member dead, erase dead members) as pure
functions over immutable values, each a compare-and-set on the group version.
Guarantees: a change computed from version V applies only to version V and
produces version V + 1 (or leaves the group untouched when it is already
true); the member making a change must be a live member (else it has lost its
membership); dead entries keep their ring position until erased. Stores (SQLite,
ZooKeeper, the simulator's dictionary) hold `Group` values and call `apply`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class GroupMember:
    """One entry of the ring, in ring order."""

    id: str
    node: str
    alive: bool = True


@dataclass(frozen=True, slots=True)
class Group:
    """A ring's membership at one view version (version 0: no such group)."""

    name: str
    version: int = 0
    members: tuple[GroupMember, ...] = ()

    def member(self, member_id: str) -> GroupMember | None:
        for entry in self.members:
            if entry.id == member_id:
                return entry
        return None

    def is_alive(self, member_id: str) -> bool:
        entry = self.member(member_id)
        return entry is not None and entry.alive

    def alive_ids(self) -> list[str]:
        return [entry.id for entry in self.members if entry.alive]


class Outcome(enum.Enum):
    """What became of a change (mirrors ringq.v1.GroupChangeOutcome)."""

    APPLIED = 1
    VERSION_CONFLICT = 2
    ACTOR_NOT_ALIVE = 3


@dataclass(frozen=True, slots=True)
class CreateGroup:
    """Write a group holding only `creator`, if absent or without live members."""

    expected_version: int
    creator: GroupMember


@dataclass(frozen=True, slots=True)
class AddMember:
    """Insert `newcomer` right of the live member `left` (the actor)."""

    expected_version: int
    left: str
    newcomer: GroupMember


@dataclass(frozen=True, slots=True)
class MarkMemberDead:
    """`actor` records `member` dead. A `joining` actor (not yet in the group) reports the member it
    failed to join through; any other actor must be a live member."""

    expected_version: int
    member: str
    actor: str
    joining: bool = False


@dataclass(frozen=True, slots=True)
class EraseMembers:
    """Erase dead `members` that have nothing in flight; `actor` inherited them."""

    expected_version: int
    members: tuple[str, ...]
    actor: str


GroupChange = CreateGroup | AddMember | MarkMemberDead | EraseMembers


def member_node(member_id: str) -> str:
    """The node a member id names. Nodes mint their members' ids as `NODE.SUFFIX` (services/node.py)
    with a suffix that holds no '.', so with TLS a node can be held to speaking for its own members."""
    return member_id.rpartition(".")[0]


def actor_of(change: GroupChange) -> str:
    """The member making the change ('' for a CreateGroup, which needs none)."""
    if isinstance(change, AddMember):
        return change.left
    if isinstance(change, MarkMemberDead | EraseMembers):
        return change.actor
    return ""


def apply(group: Group, change: GroupChange) -> tuple[Outcome, Group]:
    """Apply `change` to `group`; returns the outcome and the group after it.

    On a conflict or a lost membership the group is returned unchanged, so the
    caller can re-decide against it.
    """
    if change.expected_version != group.version:
        return Outcome.VERSION_CONFLICT, group
    if isinstance(change, CreateGroup):
        if group.alive_ids():
            return Outcome.VERSION_CONFLICT, group
        return Outcome.APPLIED, Group(group.name, group.version + 1, (change.creator,))
    actor = actor_of(change)
    joiner = isinstance(change, MarkMemberDead) and change.joining and bool(actor) and group.member(actor) is None
    if not joiner and not group.is_alive(actor):
        return Outcome.ACTOR_NOT_ALIVE, group
    if isinstance(change, AddMember):
        if group.member(change.newcomer.id) is not None:
            return Outcome.APPLIED, group
        members: list[GroupMember] = []
        for entry in group.members:
            members.append(entry)
            if entry.id == change.left:
                members.append(change.newcomer)
        return Outcome.APPLIED, _bump(group, members)
    if isinstance(change, MarkMemberDead):
        if not group.is_alive(change.member):
            return Outcome.APPLIED, group
        # A group whose every entry is dead is restarted by CreateGroup.
        members = [replace(e, alive=False) if e.id == change.member else e for e in group.members]
        return Outcome.APPLIED, _bump(group, members)
    erasable = {m for m in change.members if (e := group.member(m)) is not None and not e.alive}
    if not erasable:
        return Outcome.APPLIED, group
    return Outcome.APPLIED, _bump(group, [e for e in group.members if e.id not in erasable])


def _bump(group: Group, members: list[GroupMember]) -> Group:
    return Group(group.name, group.version + 1, tuple(members))
