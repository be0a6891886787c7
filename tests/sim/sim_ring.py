"""The GM ring in the queue simulation: pure `RingMember`s driven with asynchronous group-table I/O.

Responsible for: one member's shell (an inbox of inputs; actions carried out in order; a read or
write of the group table suspends the member until the coordinator answers, which it does only
while the member's node reaches it), FIFO links between members with random delays that drop
frames across a cut or to a crashed node, flush timers, joins through AddOnRight, and a failure
detector that suspects a neighbour whose node is down or cut off from ours for a while. What the
ring tells the application goes to the member's `MemberListener` (the queue replica's shell).
"""

from __future__ import annotations

import functools
import random
from collections import deque
from collections.abc import Callable
from typing import Protocol

from services.coordinator import group_table
from services.coordinator.group_table import Group, GroupChange, Outcome
from services.gm.messages import (
    Action,
    Activity,
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
from services.gm.ring import NotJoined, RingMember
from tests.sim.scheduler import Scheduler

DETECT_AFTER_MS = (300, 1500)
# How long an added newcomer waits for its joining Catchup before giving up its id (ring.py's hard case 9):
# services/node.py's JOIN_TIMEOUT_FLOOR_SECONDS, the node's join timeout with default settings.
JOIN_TIMEOUT_MS = 3000


class MemberListener(Protocol):
    def on_ring_event(self, event: Deliver | Confirmed | Joined | MembersChanged | Stopped) -> None: ...


class Network(Protocol):
    """What members need from the simulated world."""

    scheduler: Scheduler
    rng: random.Random

    def node_up(self, node: str) -> bool: ...

    def linked(self, a: str, b: str) -> bool: ...

    def reaches_coordinator(self, node: str) -> bool: ...

    def member(self, member_id: str) -> SimMember | None: ...

    def members_of_group(self) -> list[SimMember]: ...


class GroupStore:
    """The coordinator's group table for the queue's ring (compare-and-set on the version); like the
    node's group watch, every new version reaches each member whose node reaches the coordinator."""

    def __init__(self, name: str, world: Network) -> None:
        self.group = Group(name)
        self.world = world

    def apply(self, change: GroupChange) -> tuple[Outcome, Group]:
        outcome, group = group_table.apply(self.group, change)
        if group is not self.group:
            self.group = group
            for member in list(self.world.members_of_group()):
                self.world.scheduler.at(self.world.rng.randint(1, 20), functools.partial(member.watch, group))
        return outcome, group


class SimMember:
    """One ring member on `node` and the shell around it."""

    def __init__(self, world: Network, store: GroupStore, node: str, member_id: str, listener: MemberListener) -> None:
        self.world = world
        self.store = store
        self.node = node
        self.core = RingMember(store.group.name, member_id, node, max_buffer_bytes=4096)
        self.listener = listener
        self.inbox: deque[Callable[[RingMember], list[Action]]] = deque()
        self.actions: deque[Action] = deque()
        self.waiting_io = False
        self.crashed = False
        self.watching: tuple[str, ...] = ()
        self.flush_armed = False
        self.link_clock: dict[str, int] = {}
        self.asked_by: set[str] = set()  # newcomers whose AddOnRight this member has not answered yet
        self.queued: dict[str, RingMessage] = {}  # receiver -> the last message to it not yet arrived
        self.join_timer_armed = False

    @property
    def id(self) -> str:
        return self.core.id

    @property
    def gone(self) -> bool:
        return self.crashed or self.core.stopped is not None

    def start(self) -> None:
        self.post(lambda core: core.start())
        self.world.scheduler.at(100, self._detect)
        self.world.scheduler.at(self.world.rng.randint(3000, 6000), self._check_membership)

    def _check_membership(self) -> None:
        """The node's fallback when its group watch may have missed something: re-read the group."""
        if self.gone:
            return
        self.post(lambda core: core.check_membership())
        self.world.scheduler.at(self.world.rng.randint(3000, 6000), self._check_membership)

    def post(self, step: Callable[[RingMember], list[Action]]) -> None:
        if self.gone:
            return
        self.inbox.append(step)
        self._run()

    def watch(self, group: Group) -> None:
        """A new view from the group watch (only while this node reaches the coordinator)."""
        if not self.world.reaches_coordinator(self.node):
            return

        self.post(lambda core: core.on_group_watched(group))

    def broadcast(self, bodies: list[bytes], expected_first: int) -> None:
        def step(core: RingMember) -> list[Action]:
            try:
                first, actions = core.broadcast(bodies)
            except NotJoined:
                return []
            assert first == expected_first, f"{core.id}: broadcast numbered {first}, expected {expected_first}"
            return actions

        self.post(step)

    # ------------------------------------------------------------------ the shell loop

    def _run(self) -> None:
        """Carry out pending actions (a stopped member's last ones too), then take the next input."""
        while not self.crashed and not self.waiting_io:
            if self.actions:
                self._perform(self.actions.popleft())
            elif self.inbox and self.core.stopped is None:
                self.actions.extend(self.inbox.popleft()(self.core))
            else:
                return

    def _perform(self, action: Action) -> None:
        world, core = self.world, self.core
        if isinstance(action, SendRight):
            self._send(action.message, action.node)
        elif isinstance(action, Deliver | Confirmed | Joined | MembersChanged):
            self.listener.on_ring_event(action)
        elif isinstance(action, ReadGroup):
            self._group_io(lambda: core.on_group(self.store.group))
        elif isinstance(action, WriteGroup):
            change = action.change
            self._group_io(lambda: core.on_group_written(*self.store.apply(change)))
        elif isinstance(action, StartFlushTimer):
            if not self.flush_armed:
                self.flush_armed = True
                world.scheduler.at(world.rng.randint(1, 5), self._flush)
        elif isinstance(action, ChooseLeft):
            self.actions.extendleft(reversed(core.join_via(world.rng.choice(sorted(action.candidates)))))
        elif isinstance(action, RequestAddOnRight):
            world.scheduler.at(world.rng.randint(1, 10), lambda: self._ask(action.left, action.node))
        elif isinstance(action, AddOnRightReply):
            self.asked_by.discard(action.newcomer)
            self._answer(action.newcomer, action.group)
        elif isinstance(action, WatchNeighbours):
            self.watching = (action.left, action.right)
        elif isinstance(action, Stopped):
            for newcomer in sorted(self.asked_by):  # as the node's AddOnRight handler: "not ready"
                self._answer(newcomer, None)
            self.asked_by.clear()
            self.listener.on_ring_event(action)

    def _answer(self, newcomer_id: str, group: Group | None, *, unreachable: bool = False) -> None:
        world = self.world
        left = self.id

        def answer() -> None:
            newcomer = world.member(newcomer_id)
            if newcomer is None:
                return
            if group is None:
                evidence = "its node is down" if unreachable else None
                newcomer.post(lambda core: core.on_join_failed(left, evidence))
            else:
                newcomer.post(lambda core: core.on_join_reply(group))
                newcomer.arm_join_timer()

        world.scheduler.at(world.rng.randint(1, 10), answer)

    def arm_join_timer(self) -> None:
        """As services/gm/member.py: added, the newcomer waits for its joining Catchup only so long."""
        if not self.join_timer_armed:
            self.join_timer_armed = True
            self.world.scheduler.at(JOIN_TIMEOUT_MS, self._join_timer_due)

    def _join_timer_due(self) -> None:
        self.join_timer_armed = False
        if self.gone or self.core.publishers is not None:
            return
        self.post(lambda core: core.join_catchup_overdue())
        self.arm_join_timer()

    def crash(self) -> None:
        """The member's process died: a newcomer waiting on its AddOnRight finds it unreachable."""
        self.crashed = True
        for newcomer in sorted(self.asked_by):
            self._answer(newcomer, None, unreachable=True)
        self.asked_by.clear()

    def _group_io(self, complete: Callable[[], list[Action]]) -> None:
        """Suspend the member until the coordinator answers (only while this node reaches it)."""
        self.waiting_io = True
        world = self.world

        def attempt() -> None:
            if self.crashed:
                return
            if not world.reaches_coordinator(self.node):
                world.scheduler.at(50, attempt)
                return
            self.waiting_io = False
            if self.core.stopped is None:
                self.actions.extendleft(reversed(complete()))
            self._run()

        world.scheduler.at(world.rng.randint(1, 8), attempt)

    def _flush(self) -> None:
        self.flush_armed = False
        self.post(lambda core: core.flush())

    def _send(self, message: RingMessage, node: str) -> None:
        world = self.world
        queued = self.queued.get(message.receiver)
        if queued is not None and _mergeable(queued, message) and world.rng.random() < 0.7:
            # As the link layer does (services/gm/links.py, _coalesce): consecutive Activities for one
            # receiver at one view travel as one, their entries in order.
            assert isinstance(queued.body, Activity) and isinstance(message.body, Activity)
            queued.body.entries.extend(message.body.entries)
            return
        arrival = max(world.scheduler.now_ms + world.rng.randint(1, 15), self.link_clock.get(message.receiver, 0))
        self.link_clock[message.receiver] = arrival
        self.queued[message.receiver] = message

        def arrive() -> None:
            if self.queued.get(message.receiver) is message:
                del self.queued[message.receiver]
            receiver = world.member(message.receiver)
            if self.crashed or receiver is None or not world.linked(self.node, node):
                return  # lost with its sender, or across a cut
            receiver.post(lambda core: core.on_message(message))

        world.scheduler.at(arrival - world.scheduler.now_ms, arrive)

    def _ask(self, left: str, node: str) -> None:
        world = self.world
        target = world.member(left)
        if self.gone:
            return
        if target is None or target.crashed or not world.linked(self.node, node):
            self.post(lambda core: core.on_join_failed(left, "its node is down or cut off"))
            return
        if target.core.stopped is not None:
            self.post(lambda core: core.on_join_failed(left, "its node does not host it"))
            return
        target.asked_by.add(self.id)
        target.post(lambda core: core.on_add_on_right(self.id, self.node))

    def _detect(self) -> None:
        """The failure detector: a neighbour whose node is down or cut off from ours is reported."""
        if self.gone:
            return
        world = self.world
        view = self.core.view
        for suspect in self.watching:
            if suspect == self.id or view is None or suspect not in view.nodes:
                continue
            node = view.nodes[suspect]
            member = world.member(suspect)
            down = member is None or member.crashed or not world.node_up(node) or not world.linked(self.node, node)
            if down:
                delay = world.rng.randint(*DETECT_AFTER_MS)

                def report(suspect: str = suspect, node: str = node) -> None:
                    member = world.member(suspect)
                    still = member is None or member.crashed or not world.linked(self.node, node)
                    if still:
                        self.post(lambda core: core.on_neighbour_down(suspect, "down or cut off"))

                world.scheduler.at(delay, report)
        world.scheduler.at(world.rng.randint(200, 400), self._detect)


def _mergeable(first: RingMessage, then: RingMessage) -> bool:
    return (
        isinstance(first.body, Activity)
        and isinstance(then.body, Activity)
        and bool(first.body.entries)
        and bool(then.body.entries)
        and (first.group, first.sender, first.receiver, first.view_version)
        == (then.group, then.sender, then.receiver, then.view_version)
    )
