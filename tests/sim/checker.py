"""The oracle of the ring simulation: the guarantees of services/gm/ring.py,
checked against everything the simulated members do.

Responsible for: recording publications, deliveries, confirms, joins and
membership events, and asserting, as they happen: no holes and per-publisher
FIFO (each member delivers a publisher's messages consecutively from its join
point, bodies intact, never twice); births before messages and no delivery
after a reported death; a confirm only once every live member that joined
before the publication has delivered it; the well-formed-state invariants after
every step; and, once the liveness phase ends, that the ring drained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.coordinator.group_table import Group
from services.gm.messages import Deliver, Joined, MembersChanged, Stopped
from services.gm.view import view_of

if TYPE_CHECKING:
    from tests.sim.simulator import Simulation


@dataclass
class MemberRecord:
    """What one simulated member has done, as seen by the checker."""

    added_at: float | None = None
    joined: bool = False
    known: set[str] = field(default_factory=set)
    dead: set[str] = field(default_factory=set)
    delivered: dict[str, int] = field(default_factory=dict)
    confirmed: int = 0


class Checker:
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.records: dict[str, MemberRecord] = {}
        self.published_at: dict[str, list[float]] = {}
        self.deliveries = 0
        self.confirms = 0

    # ----------------------------------------------------------------- events

    def on_spawn(self, member: str) -> None:
        self.records[member] = MemberRecord()
        self.published_at[member] = [0.0]  # index = sequence number

    def on_group(self, group: Group) -> None:
        for entry in group.members:
            record = self.records[entry.id]
            if record.added_at is None:
                record.added_at = self.sim.now
        view = view_of(group)
        owners = [view.owner_of(e.id) for e in group.members if not e.alive]
        assert all(o is not None for o in owners) or not view.live, "a dead member has no owner"
        for entry in group.members:
            if not entry.alive:
                holders = [m for m in view.live.values() if entry.id in m.aliases]
                assert len(holders) == (1 if view.live else 0), f"{entry.id} inherited by {len(holders)}"

    def on_publish(self, publisher: str, first: int, count: int) -> None:
        times = self.published_at[publisher]
        assert len(times) == first, f"{publisher} published #{first} after #{len(times) - 1}"
        times.extend([self.sim.now] * count)

    def on_joined(self, member: str, joined: Joined) -> None:
        record = self.records[member]
        assert not record.joined, f"{member} joined twice"
        record.joined = True
        record.known = set(joined.members)
        # The join point: the member starts from its adder's state and
        # delivers each publisher's messages after it, consecutively.
        record.delivered = dict(joined.start_after)

    def on_deliver(self, member: str, deliver: Deliver) -> None:
        from tests.sim.simulator import body_of

        record = self.records[member]
        publisher = deliver.publisher
        assert record.joined, f"{member} delivered before joining"
        assert publisher == member or publisher in record.known, f"{member} delivered {publisher} before its birth"
        assert publisher not in record.dead, f"{member} delivered {publisher} after reporting its death"
        expected = record.delivered.get(publisher, 0) + 1
        assert deliver.first_seq == expected, (
            f"{member} delivered {publisher}#{deliver.first_seq}, expected #{expected} (hole or duplicate)"
        )
        for offset, body in enumerate(deliver.bodies):
            assert body == body_of(publisher, deliver.first_seq + offset), f"{member}: corrupt body {body!r}"
        record.delivered[publisher] = deliver.first_seq + len(deliver.bodies) - 1
        self.deliveries += len(deliver.bodies)

    def on_confirmed(self, member: str, through: int) -> None:
        record = self.records[member]
        published = len(self.published_at[member]) - 1
        assert through <= published, f"{member} confirmed #{through} of {published}"
        if through <= record.confirmed:
            return
        record.confirmed = through
        self.confirms += 1
        published_at = self.published_at[member][through]
        for other_id, other in self.sim.members.items():
            other_record = self.records[other_id]
            if other.gone or other_record.added_at is None or other_record.added_at >= published_at:
                continue
            have = other_record.delivered.get(member, 0)
            assert have >= through, f"{member}#{through} confirmed but {other_id} delivered only #{have}"

    def on_members_changed(self, member: str, change: MembersChanged) -> None:
        record = self.records[member]
        for dead in change.deaths:
            assert dead in record.known, f"{member} told of {dead}'s death before its birth"
            record.dead.add(dead)
        record.known.update(change.births)

    def on_stopped(self, member: str, stopped: Stopped) -> None:
        assert stopped.rejoin or stopped.reason == "left" or self.sim.faults, f"{member} stopped: {stopped}"

    # ------------------------------------------------------------- invariants

    def check_step(self) -> None:
        sim = self.sim
        group = sim.group
        view = view_of(group)
        for member in sim.members.values():
            core = member.core
            if member.gone or core.publishers is None:
                continue
            for publisher, state in core.publishers.items():
                run = state.pending
                assert state.last_ack <= state.last_pub, f"{core.id}: {publisher} acked past last pub"
                if len(run):
                    assert run.end_seq - 1 == state.last_pub, f"{core.id}: {publisher} pending does not end at last pub"
                    assert state.last_ack < run.first_seq, f"{core.id}: {publisher} holds acknowledged messages"
        # Well formed: nobody holds what the owner has retired, nor knows more than it.
        for publisher in group.alive_ids() + [e.id for e in group.members if not e.alive]:
            owner_id = view.owner_of(publisher)
            owner = sim.members.get(owner_id) if owner_id else None
            if owner is None or owner.gone or owner.core.publishers is None or owner.core.view is None:
                continue
            if owner.core.view.version != group.version or not owner.core.caught_up:
                continue
            owned = owner.core.publishers.get(publisher)
            if owned is None:
                continue
            for member in sim.members.values():
                core = member.core
                if member is owner or member.gone or core.publishers is None:
                    continue
                held = core.publishers.get(publisher)
                if held is None:
                    continue
                assert held.last_pub <= owned.last_pub, (
                    f"{core.id} knows {publisher}#{held.last_pub}, its owner {owner_id} only #{owned.last_pub}"
                )
                if len(held.pending):
                    assert held.pending.first_seq > owned.last_ack, (
                        f"{core.id} holds {publisher}#{held.pending.first_seq} retired at {owner_id}"
                    )

    def check_drained(self) -> None:
        sim = self.sim
        alive = sim.alive()
        assert alive, "every member is gone"
        group = sim.group
        for entry in group.members:
            assert entry.alive, f"dead member {entry.id} was never erased"
        assert sorted(group.alive_ids()) == sorted(m.id for m in alive), "group and survivors disagree"
        for member in alive:
            core = member.core
            assert core.publishers is not None, f"{core.id} never got its state"
            assert core.view is not None and core.view.version == group.version, f"{core.id} has a stale view"
            for publisher, state in core.publishers.items():
                assert not len(state.pending), f"{core.id} still holds {publisher}#{state.pending.first_seq}"
        finals: dict[str, int] = {}
        for member in alive:
            for publisher, seq in self.records[member.id].delivered.items():
                finals[publisher] = max(finals.get(publisher, 0), seq)
        for member in alive:
            record = self.records[member.id]
            published = len(self.published_at[member.id]) - 1
            assert record.confirmed == published, f"{member.id} confirmed {record.confirmed} of {published}"
            for publisher, final in finals.items():
                if publisher in record.delivered:
                    have = record.delivered[publisher]
                    assert have == final, f"{member.id} delivered {publisher} to #{have}, others to #{final}"
            for other in alive:
                # A live publisher's messages all reach every live member:
                # those before its join through the join point, the rest delivered.
                have = record.delivered.get(other.id, 0)
                published_by_other = len(self.published_at[other.id]) - 1
                assert have == published_by_other, f"{member.id} has {other.id} to #{have} of {published_by_other}"
