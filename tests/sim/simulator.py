"""Deterministic simulation of GM rings: seeded schedules of joins, broadcasts,
leaves, crashes and arbitrary delays, driving pure `RingMember`s.

Responsible for: playing the shell's part for every member (FIFO links with
random delays, flush timers, a failure detector, join requests, an in-memory
group table with compare-and-set) and feeding everything that happens to a
`Checker`. The same seed replays the same run exactly.

A run has two phases, after TigerBeetle's VOPR: a safety phase with faults
(crashes, never of every member; frames in flight from a crashed member lost
from a random point; joins and leaves during broadcast), then a liveness phase
with no new faults, which must drain: every pending acknowledgement retired,
every dead member erased, every survivor in agreement.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from services.coordinator import group_table
from services.coordinator.group_table import Group, GroupChange, Outcome
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
    WatchNeighbours,
    WriteGroup,
)
from services.gm.ring import RingMember
from tests.sim.checker import Checker

GROUP = "sim"


@dataclass
class SimConfig:
    """The fault model; each seed draws its own schedule within these bounds."""

    max_members: int = 7
    fault_phase: float = 120.0
    broadcasts: int = 40
    max_batch: int = 4
    max_link_delay: float = 4.0
    max_flush_delay: float = 2.0
    max_detect_delay: float = 8.0
    max_events: int = 200_000
    max_buffer_bytes: int = 64


@dataclass
class _Event:
    time: float
    order: int
    run: Callable[[], None]
    cancelled: bool = False

    def __lt__(self, other: _Event) -> bool:
        return (self.time, self.order) < (other.time, other.order)


@dataclass
class SimMember:
    core: RingMember
    crashed: bool = False
    watching: tuple[str, ...] = ()
    detecting: set[str] = field(default_factory=set)
    next_body: int = 1

    @property
    def id(self) -> str:
        return self.core.id

    @property
    def gone(self) -> bool:
        return self.crashed or self.core.stopped is not None


class Simulation:
    """One seeded run; `run()` raises AssertionError (with the seed) on a violation."""

    def __init__(self, seed: int, config: SimConfig | None = None) -> None:
        self.seed = seed
        self.config = config or SimConfig()
        self.rng = random.Random(seed)
        self.now = 0.0
        self.group = Group(GROUP)
        self.members: dict[str, SimMember] = {}
        self.checker = Checker(self)
        self._queue: list[_Event] = []
        self._order = itertools.count()
        self._links: dict[tuple[str, str], list[_Event]] = {}
        self._link_clock: dict[tuple[str, str], float] = {}
        self._ids = itertools.count(1)
        self.events = 0
        self.faults = True

    # ----------------------------------------------------------------- driver

    def run(self) -> Simulation:
        try:
            self._plan()
            self._loop(until=self.config.fault_phase)
            self.faults = False
            self._loop(until=float("inf"))
            self.checker.check_drained()
        except AssertionError as error:
            raise AssertionError(f"seed {self.seed} at t={self.now:.2f}: {error}") from error
        except Exception as error:
            raise AssertionError(f"seed {self.seed} at t={self.now:.2f}: {error!r}") from error
        return self

    def _loop(self, until: float) -> None:
        while self._queue and self._queue[0].time <= until:
            event = heapq.heappop(self._queue)
            if event.cancelled:
                continue
            self.now = event.time
            self.events += 1
            if self.events > self.config.max_events:
                raise AssertionError("the ring did not settle (event budget exhausted)")
            event.run()
            self.checker.check_step()

    def _at(self, delay: float, run: Callable[[], None]) -> _Event:
        event = _Event(self.now + delay, next(self._order), run)
        heapq.heappush(self._queue, event)
        return event

    def _plan(self) -> None:
        cfg = self.config
        rng = self.rng
        total = rng.randint(2, cfg.max_members)
        initial = rng.randint(1, total)
        for index in range(initial):
            self._at(index * rng.uniform(0.0, 3.0), self._spawn)
        for _ in range(total - initial):
            self._at(rng.uniform(5.0, cfg.fault_phase * 0.7), self._spawn)
        for _ in range(cfg.broadcasts):
            self._at(rng.uniform(1.0, cfg.fault_phase), self._random_broadcast)
        for _ in range(rng.randint(0, total - 1)):
            self._at(rng.uniform(5.0, cfg.fault_phase), self._random_crash)
        if rng.random() < 0.3:
            self._at(rng.uniform(5.0, cfg.fault_phase), self._random_leave)

    # ------------------------------------------------------------------ faults

    def alive(self) -> list[SimMember]:
        return [m for m in self.members.values() if not m.gone]

    def _spawn(self) -> None:
        member_id = f"m{next(self._ids)}"
        core = RingMember(GROUP, member_id, node=member_id, max_buffer_bytes=self.config.max_buffer_bytes)
        self.members[member_id] = SimMember(core)
        self.checker.on_spawn(member_id)
        self._execute(self.members[member_id], core.start())

    def _random_broadcast(self) -> None:
        joined = [m for m in self.alive() if m.core.publishers is not None]
        if not joined:
            return
        member = self.rng.choice(joined)
        count = self.rng.randint(1, self.config.max_batch)
        bodies = [body_of(member.id, member.next_body + i) for i in range(count)]
        member.next_body += count
        first, actions = member.core.broadcast(bodies)
        assert first == member.next_body - count, "sequence numbers are not consecutive"
        self.checker.on_publish(member.id, first, count)
        self._execute(member, actions)

    def _random_crash(self) -> None:
        alive = self.alive()
        if len(alive) < 2:
            return  # never every member
        self._crash(self.rng.choice(alive))

    def _crash(self, member: SimMember) -> None:
        member.crashed = True
        for (sender, _receiver), in_flight in self._links.items():
            if sender != member.id or not in_flight:
                continue
            # What the crashed member had written but not yet sent is lost
            # from some point on: a prefix may still arrive.
            keep = self.rng.randint(0, len(in_flight))
            for event in in_flight[keep:]:
                event.cancelled = True
        for watcher in self.members.values():
            if member.id in watcher.watching:
                self._detect(watcher, member.id)

    def _random_leave(self) -> None:
        joined = [m for m in self.alive() if m.core.publishers is not None]
        if len(joined) >= 2:
            member = self.rng.choice(joined)
            self._execute(member, member.core.leave())

    def _detect(self, watcher: SimMember, suspect: str) -> None:
        if suspect in watcher.detecting:
            return
        watcher.detecting.add(suspect)

        def fire() -> None:
            watcher.detecting.discard(suspect)
            if not watcher.gone:
                self._execute(watcher, watcher.core.on_neighbour_down(suspect, "crashed"))

        self._at(self.rng.uniform(0.5, self.config.max_detect_delay), fire)

    # ------------------------------------------------------------------- shell

    def _execute(self, member: SimMember, actions: list[Action]) -> None:
        pending = list(actions)
        while pending:
            action = pending.pop(0)
            more = self._perform(member, action)
            pending[:0] = more

    def _perform(self, member: SimMember, action: Action) -> list[Action]:
        core = member.core
        if isinstance(action, SendRight):
            self._send(member.id, action.message)
        elif isinstance(action, Deliver):
            self.checker.on_deliver(member.id, action)
        elif isinstance(action, Confirmed):
            self.checker.on_confirmed(member.id, action.through_seq)
        elif isinstance(action, Joined):
            self.checker.on_joined(member.id, action)
        elif isinstance(action, MembersChanged):
            self.checker.on_members_changed(member.id, action)
        elif isinstance(action, ReadGroup):
            return core.on_group(self.group)
        elif isinstance(action, WriteGroup):
            assert action.reason, f"{member.id} wrote {action.change} without a reason"
            outcome, group = self._write(action.change)
            return core.on_group_written(outcome, group)
        elif isinstance(action, StartFlushTimer):
            self._at(self.rng.uniform(0.1, self.config.max_flush_delay), lambda: self._flush(member))
        elif isinstance(action, ChooseLeft):
            return core.join_via(self.rng.choice(sorted(action.candidates)))
        elif isinstance(action, RequestAddOnRight):
            self._at(self.rng.uniform(0.1, self.config.max_link_delay), lambda: self._ask(member, action.left))
        elif isinstance(action, AddOnRightReply):
            self._at(self.rng.uniform(0.1, self.config.max_link_delay), lambda: self._answer(action))
        elif isinstance(action, WatchNeighbours):
            member.watching = (action.left, action.right)
            for suspect in member.watching:
                if suspect in self.members and self.members[suspect].gone:
                    self._detect(member, suspect)
        elif isinstance(action, Stopped):
            self.checker.on_stopped(member.id, action)
            for watcher in self.members.values():
                if member.id in watcher.watching:
                    self._detect(watcher, member.id)
            if action.rejoin:
                self._at(self.rng.uniform(0.5, 3.0), self._spawn)
        return []

    def _write(self, change: GroupChange) -> tuple[Outcome, Group]:
        outcome, group = group_table.apply(self.group, change)
        if group is not self.group:
            self.group = group
            self.checker.on_group(group)
        return outcome, group

    def _flush(self, member: SimMember) -> None:
        if not member.gone:
            self._execute(member, member.core.flush())

    def _send(self, sender: str, message: RingMessage) -> None:
        link = (sender, message.receiver)
        arrival = max(self.now + self.rng.uniform(0.05, self.config.max_link_delay), self._link_clock.get(link, 0.0))
        self._link_clock[link] = arrival
        in_flight = self._links.setdefault(link, [])

        def arrive() -> None:
            in_flight.remove(event)
            receiver = self.members.get(message.receiver)
            if receiver is not None and not receiver.gone:
                self._execute(receiver, receiver.core.on_message(message))

        event = _Event(arrival, next(self._order), arrive)
        heapq.heappush(self._queue, event)
        in_flight.append(event)

    def _ask(self, joiner: SimMember, left_id: str) -> None:
        left = self.members.get(left_id)
        if left is None or left.gone:
            if not joiner.gone:
                self._execute(joiner, joiner.core.on_join_failed(left_id, down_evidence="crashed"))
            return
        self._execute(left, left.core.on_add_on_right(joiner.id, joiner.id))

    def _answer(self, reply: AddOnRightReply) -> None:
        joiner = self.members[reply.newcomer]
        if joiner.gone:
            return
        if reply.group is None:
            self._execute(joiner, joiner.core.on_join_failed("", down_evidence=None))
        else:
            self._execute(joiner, joiner.core.on_join_reply(reply.group))


def body_of(publisher: str, seq: int) -> bytes:
    """The body the simulator publishes as `publisher`'s `seq`-th message."""
    return f"{publisher}|{seq}".encode()
