"""A hand-stepped harness for ring unit tests: cores joined by in-memory FIFO
links and an in-memory group table, with every message held until a test
delivers it (or drops it), and every flush timer held until a test fires it
(`flush`) or the ring is quiet (`pump`). Deterministic: no randomness, no clock."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.coordinator import group_table
from services.coordinator.group_table import Group
from services.gm.messages import (
    Action,
    AddOnRightReply,
    ChooseLeft,
    Confirmed,
    Deliver,
    Joined,
    MembersChanged,
    ReadGroup,
    RequestAddOnRight,
    RingMessage,
    SendRight,
    StartFlushTimer,
    Stopped,
    WriteGroup,
)
from services.gm.ring import RingMember


@dataclass
class Seen:
    """What one member's application saw."""

    delivered: dict[str, list[bytes]] = field(default_factory=dict)
    confirmed: int = 0
    joined: Joined | None = None
    births: list[str] = field(default_factory=list)
    deaths: list[str] = field(default_factory=list)
    stopped: Stopped | None = None


class Harness:
    def __init__(self, group: str = "g") -> None:
        self.group = Group(group)
        self.cores: dict[str, RingMember] = {}
        self.seen: dict[str, Seen] = {}
        self.links: dict[tuple[str, str], deque[RingMessage]] = {}
        self.dead: set[str] = set()
        self.flush_due: set[str] = set()  # members whose flush timer is armed

    # -------------------------------------------------------------- building

    def start(self, member: str, via: str | None = None) -> RingMember:
        """Start `member`; it joins right of `via` (or of the first candidate)."""
        core = RingMember(self.group.name, member, node=f"node-{member}", max_buffer_bytes=1)
        self.cores[member] = core
        self.seen[member] = Seen()
        self._via = via
        self.run(member, core.start())
        return core

    def ring(self, *members: str) -> None:
        """Start members one after another, each added right of the previous, and settle."""
        previous = None
        for member in members:
            self.start(member, via=previous)
            self.pump()
            previous = member

    # ------------------------------------------------------------- executing

    def run(self, member: str, actions: list[Action]) -> None:
        core = self.cores[member]
        pending = list(actions)
        while pending:
            action = pending.pop(0)
            seen = self.seen[member]
            if isinstance(action, SendRight):
                self.links.setdefault((member, action.message.receiver), deque()).append(action.message)
            elif isinstance(action, Deliver):
                seen.delivered.setdefault(action.publisher, []).extend(action.bodies)
            elif isinstance(action, Confirmed):
                seen.confirmed = max(seen.confirmed, action.through_seq)
            elif isinstance(action, Joined):
                seen.joined = action
            elif isinstance(action, MembersChanged):
                seen.births += action.births
                seen.deaths += action.deaths
            elif isinstance(action, Stopped):
                seen.stopped = action
            elif isinstance(action, StartFlushTimer):
                self.flush_due.add(member)
            elif isinstance(action, ReadGroup):
                pending[:0] = core.on_group(self.group)
            elif isinstance(action, WriteGroup):
                outcome, self.group = group_table.apply(self.group, action.change)
                pending[:0] = core.on_group_written(outcome, self.group)
            elif isinstance(action, ChooseLeft):
                left = self._via if self._via in action.candidates else action.candidates[0]
                pending[:0] = core.join_via(left)
            elif isinstance(action, RequestAddOnRight):
                self.run(action.left, self.cores[action.left].on_add_on_right(member, core.node))
            elif isinstance(action, AddOnRightReply) and action.group is not None:
                self.run(action.newcomer, self.cores[action.newcomer].on_join_reply(action.group))

    def deliver_one(self, sender: str, receiver: str) -> RingMessage:
        message = self.links[(sender, receiver)].popleft()
        if receiver not in self.dead:
            self.run(receiver, self.cores[receiver].on_message(message))
        return message

    def drop(self, sender: str, receiver: str) -> int:
        """Lose everything in flight on one link."""
        queue = self.links.get((sender, receiver), deque())
        count = len(queue)
        queue.clear()
        return count

    def flush(self, member: str) -> None:
        """`member`'s flush timer fires (it must be armed)."""
        assert member in self.flush_due, f"{member} has no flush timer armed"
        self.flush_due.discard(member)
        if member not in self.dead:
            self.run(member, self.cores[member].flush())

    def pump(self, limit: int = 10_000) -> None:
        """Deliver every message in flight, round robin over links, and fire the flush timers armed
        whenever nothing is in flight, until quiet."""
        for _ in range(limit):
            busy = [link for link, queue in self.links.items() if queue]
            if busy:
                for sender, receiver in busy:
                    self.deliver_one(sender, receiver)
            elif self.flush_due:
                for member in sorted(self.flush_due):
                    self.flush(member)
            else:
                return
        raise AssertionError("the ring did not settle")

    def broadcast(self, member: str, *bodies: bytes) -> int:
        first, actions = self.cores[member].broadcast(list(bodies))
        self.run(member, actions)
        return first

    def crash(self, member: str) -> None:
        """The member stops; what it had in flight is lost; its neighbours notice."""
        self.dead.add(member)
        for (sender, _), queue in self.links.items():
            if sender == member:
                queue.clear()

    def notice_death(self, watcher: str, member: str) -> None:
        self.run(watcher, self.cores[watcher].on_neighbour_down(member, "crashed"))
