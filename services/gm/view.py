"""Views: what one version of the group table means to the ring.

Responsible for: turning a `Group` (members in ring order, dead entries kept)
into a `View`: each live member's left and right live neighbours and the dead
members it has inherited (its aliases). Guarantees: every dead member is the
alias of exactly one live member, the nearest live member downstream of it
(to its right, wrapping), because that member has seen at least as much of
the dead member's publications as anyone. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.coordinator.group_table import Group


@dataclass(frozen=True, slots=True)
class ViewMember:
    """A live member's place in the ring."""

    id: str
    node: str
    left: str
    right: str
    aliases: frozenset[str]


@dataclass(frozen=True, slots=True)
class View:
    """The ring at one version: live members and everyone still known."""

    version: int
    live: dict[str, ViewMember]
    known: frozenset[str]
    nodes: dict[str, str]

    def owner_of(self, member_id: str) -> str | None:
        """The live member responsible for `member_id`'s messages (itself if alive)."""
        if member_id in self.live:
            return member_id
        for entry in self.live.values():
            if member_id in entry.aliases:
                return entry.id
        return None


def view_of(group: Group) -> View:
    """Compute the view of `group`; a group with no live member has an empty view."""
    members = group.members
    alive = [m for m in members if m.alive]
    nodes = {m.id: m.node for m in members}
    known = frozenset(m.id for m in members)
    if not alive:
        return View(group.version, {}, known, nodes)
    # Rotate so the list ends with a live member: every dead entry then has a
    # live member somewhere to its right in a single pass.
    last_alive = max(i for i, m in enumerate(members) if m.alive)
    rotated = members[last_alive + 1 :] + members[: last_alive + 1]
    aliases: dict[str, set[str]] = {}
    dead_run: set[str] = set()
    for entry in rotated:
        if entry.alive:
            aliases[entry.id] = dead_run
            dead_run = set()
        else:
            dead_run.add(entry.id)
    live: dict[str, ViewMember] = {}
    count = len(alive)
    for index, entry in enumerate(alive):
        live[entry.id] = ViewMember(
            id=entry.id,
            node=entry.node,
            left=alive[(index - 1) % count].id,
            right=alive[(index + 1) % count].id,
            aliases=frozenset(aliases[entry.id]),
        )
    return View(group.version, live, known, nodes)
