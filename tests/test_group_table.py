"""Unit tests of the pure group-table rules (services.coordinator.group_table.apply)."""

from __future__ import annotations

from services.coordinator.group_table import (
    AddMember,
    CreateGroup,
    EraseMembers,
    Group,
    GroupChange,
    GroupMember,
    MarkMemberDead,
    Outcome,
    apply,
)

A = GroupMember("a", "n1")
B = GroupMember("b", "n2")
C = GroupMember("c", "n3")


def ids(group: Group) -> list[str]:
    return [m.id for m in group.members]


def ring(*members: GroupMember, version: int = 5) -> Group:
    return Group("g", version, members)


def dead(member: GroupMember) -> GroupMember:
    return GroupMember(member.id, member.node, alive=False)


def test_create_on_absent_group() -> None:
    outcome, group = apply(Group("g"), CreateGroup(0, A))
    assert outcome is Outcome.APPLIED
    assert group == Group("g", 1, (A,))


def test_create_restarts_an_all_dead_group() -> None:
    outcome, group = apply(ring(dead(A), dead(B)), CreateGroup(5, C))
    assert outcome is Outcome.APPLIED
    assert group == Group("g", 6, (C,))


def test_create_refused_while_a_live_member_exists() -> None:
    before = ring(dead(A), B)
    outcome, group = apply(before, CreateGroup(5, C))
    assert outcome is Outcome.VERSION_CONFLICT
    assert group is before


def test_add_inserts_right_of_left_in_ring_order() -> None:
    outcome, group = apply(ring(A, B), AddMember(5, "a", C))
    assert outcome is Outcome.APPLIED
    assert ids(group) == ["a", "c", "b"]
    outcome, group = apply(ring(A, B), AddMember(5, "b", C))
    assert ids(group) == ["a", "b", "c"]


def test_add_skips_dead_entries_only_by_position() -> None:
    # A dead entry right of `left` stays where it is; the newcomer goes directly right of left.
    outcome, group = apply(ring(A, dead(B)), AddMember(5, "a", C))
    assert outcome is Outcome.APPLIED
    assert ids(group) == ["a", "c", "b"]


def test_add_is_idempotent_for_an_existing_newcomer() -> None:
    before = ring(A, C, B)
    outcome, group = apply(before, AddMember(5, "a", C))
    assert outcome is Outcome.APPLIED
    assert group is before


def test_version_conflict_leaves_the_group_unchanged() -> None:
    before = ring(A, dead(B))
    changes: list[GroupChange] = [
        CreateGroup(4, C),
        AddMember(4, "a", C),
        MarkMemberDead(6, "a", "a"),
        EraseMembers(0, ("b",), "a"),
    ]
    for change in changes:
        outcome, group = apply(before, change)
        assert (outcome, group) == (Outcome.VERSION_CONFLICT, before), change


def test_actor_not_alive() -> None:
    before = ring(A, dead(B))
    changes: list[GroupChange] = [
        AddMember(5, "b", C),  # left is dead
        AddMember(5, "zz", C),  # left is not a member
        MarkMemberDead(5, "a", "b"),
        EraseMembers(5, ("b",), "zz"),
    ]
    for change in changes:
        outcome, group = apply(before, change)
        assert (outcome, group) == (Outcome.ACTOR_NOT_ALIVE, before), change


def test_mark_dead_keeps_the_entry_in_place() -> None:
    outcome, group = apply(ring(A, B, C), MarkMemberDead(5, "b", "a"))
    assert outcome is Outcome.APPLIED
    assert group.members == (A, dead(B), C)
    assert group.alive_ids() == ["a", "c"]


def test_mark_dead_by_a_joiner_not_yet_in_the_group() -> None:
    outcome, group = apply(ring(A, B), MarkMemberDead(5, "a", "j", joining=True))
    assert outcome is Outcome.APPLIED
    assert group.members == (dead(A), B)


def test_mark_dead_without_an_actor_is_refused() -> None:
    """Anyone could record any member dead with no actor: a change always names the member making it."""
    before = ring(A, B)
    assert apply(before, MarkMemberDead(5, "a", "")) == (Outcome.ACTOR_NOT_ALIVE, before)
    assert apply(before, MarkMemberDead(5, "a", "", joining=True)) == (Outcome.ACTOR_NOT_ALIVE, before)


def test_a_joining_actor_that_was_a_member_once_is_not_a_joiner() -> None:
    """A member recorded dead (or dead and erased) that still runs cannot pass itself off as a joiner."""
    before = ring(A, dead(B))
    assert apply(before, MarkMemberDead(5, "a", "b", joining=True)) == (Outcome.ACTOR_NOT_ALIVE, before)


def test_mark_dead_of_a_dead_or_unknown_member_is_already_true() -> None:
    before = ring(A, dead(B))
    for member in ("b", "zz"):
        outcome, group = apply(before, MarkMemberDead(5, member, "a"))
        assert (outcome, group) == (Outcome.APPLIED, before)


def test_erase_only_erases_dead_entries() -> None:
    outcome, group = apply(ring(A, dead(B), C, dead(GroupMember("d", "n4"))), EraseMembers(5, ("b", "c", "d"), "a"))
    assert outcome is Outcome.APPLIED
    assert group.members == (A, C)


def test_erase_with_nothing_erasable_changes_nothing() -> None:
    before = ring(A, C)
    outcome, group = apply(before, EraseMembers(5, ("c", "zz"), "a"))
    assert (outcome, group) == (Outcome.APPLIED, before)


def test_every_applied_change_bumps_the_version_by_exactly_one() -> None:
    group = Group("g")
    steps: list[GroupChange] = [
        CreateGroup(0, A),
        AddMember(1, "a", B),
        AddMember(2, "b", C),
        MarkMemberDead(3, "b", "c"),
        EraseMembers(4, ("b",), "a"),
        MarkMemberDead(5, "a", "c"),
        MarkMemberDead(6, "c", "j", joining=True),
        CreateGroup(7, B),
    ]
    for step in steps:
        outcome, after = apply(group, step)
        assert outcome is Outcome.APPLIED, step
        assert after.version == group.version + 1, step
        assert after.name == "g"
        group = after
    assert group == Group("g", 8, (B,))
