"""The shell around one ring member: real timers, links and coordinator calls.

Responsible for: feeding a `RingMember` its inputs one at a time from an
inbox, and carrying out the actions it returns: sending on links, handing
deliveries to the application, resolving confirmed broadcasts, reading and
writing the group table (each awaited before the next input, as the ring's
contract asks), flush timers, and the join handshake. Guarantees: inputs are
processed strictly one after another in arrival order, and an input's actions
in the order the core returned them, with one exception: an Activity passed
on goes to the link before the publications it carries reach the application,
and the link's writer gets one turn of the event loop in between (the
application still has them before the member's next input; a member that dies
in between has nothing left to deliver to); a protocol violation
stops the member (it never carries on with a state it cannot trust); every
write that records a member dead is logged at INFO with its group, the
member, the ring's reason and the outcome.

Ring messages are `offer`ed: when the member is between inputs (none queued,
none in progress) one is taken at once, in the link reader's turn of the event
loop, and so are those of its actions that neither wait nor feed the core; the
rest go to the inbox ahead of anything that arrives later (what an Activity
passed on delivers is carried out by a callback right after the link writer's
turn). A frame passed on reaches the link's writer a turn earlier, and most
frames cost no task switch.
Broadcasts and flushes are posted: the turn they wait in the inbox lets more
publications join a frame (offered too, W1 and saturated W2 carried 3-7 % less).

The join handshake: while the member asks another to add it (`join_request`),
it watches that member like a neighbour (`watched`); the host keeps asking
through silence and reconnect backoff, and only an answer or the host's
failure detector (`report_down`) ends the request. An answer that the target
is not hosted on its node means it is gone; "not ready" means choose again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from services.coordinator.group_table import Group, GroupChange, MarkMemberDead, Outcome
from services.gm.messages import (
    Action,
    Activity,
    AddOnRightReply,
    Catchup,
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
from services.gm.ring import ProtocolViolation, RingMember

log = logging.getLogger("ringq.member")

MemberEvent = Joined | Deliver | MembersChanged | Stopped
# A broadcast buffer smaller than this is flushed at once even when the link to the right is busy. Measured
# (docs/benchmarks.md, ninth update): at 2,000 msgs/s a publish step is a few messages and flushing at once
# cut the p50 by about 0.5 ms and the p99 by about 1.5 ms; saturated traffic, whose steps are large, still
# batches (flushing those at once too made saturated W2's p99 twice as long).
SMALL_FLUSH_BYTES = 4096
# How long acknowledgements with nothing to ride on wait for a frame going right before they go alone (or
# the flush interval, if longer). They confirm nothing to anyone (services/gm/ring.py, "Acknowledgements
# ride along"), so waiting costs no latency; at 2,000 msgs/s the flush interval (2 ms) sent 17 % of the
# master's ring frames as acknowledgements alone, each a write on the master and a read on its right.
# Not those of a dead member's publications (`StartFlushTimer.prompt`): its death reaches the application,
# and a queue's promotion, only once they went round (a 20 ms wait at each hop made W3's gap 0.03-0.05 s
# longer in 3 runs of 6).
ACKS_ALONE_WAIT_SECONDS = 0.02
# How long to wait before choosing again after the member asked answered "not ready".
NOT_READY_PAUSE_SECONDS = 0.05
# How often a join that has not succeeded is noted in the log.
SLOW_JOIN_NOTE_SECONDS = 5.0


class NotHosted(Exception):
    """The join target's node answered that it does not host that member: it is gone
    (its node restarted, or it stopped)."""


class MemberHost(Protocol):
    """What a member needs from the node hosting it."""

    flush_interval: float
    # How long a member the group table lists may wait for its joining Catchup before it gives up its id
    # and joins again (services/gm/ring.py, hard case 9); checked again every as long until it joined.
    join_timeout: float

    async def read_group(self, group: str) -> Group: ...

    async def change_group(self, group: str, change: GroupChange) -> tuple[Outcome, Group]: ...

    def send_ring_message(self, node: str, message: RingMessage) -> None: ...

    def link_idle(self, node: str) -> bool: ...

    async def add_on_right(self, group: str, left: str, node: str, newcomer: str) -> Group | None:
        """Ask `left` on `node` to add `newcomer` on its right: the group including
        the newcomer, or None if `left` answered that it cannot add members now.
        Raises NotHosted if `node` answered that it does not host `left`. Keeps
        asking while there is no answer; the caller cancels it."""
        ...

    def neighbours_changed(self) -> None: ...


@dataclass
class Neighbours:
    left: str
    left_node: str
    right: str
    right_node: str
    # When each became this member's neighbour (time.monotonic()): a neighbour's silence counts from
    # then at the earliest, so a link that was idle or broken before (a partition just healed) does not
    # make a new neighbour suspect at once.
    left_since: float = 0.0
    right_since: float = 0.0


@dataclass(frozen=True)
class Watched:
    """A member this one watches for failure, on `node`. `since` (time.monotonic())
    is when the watch began: its silence counts from then at the earliest.
    `neighbour` is False for a join target."""

    member: str
    node: str
    since: float = 0.0
    neighbour: bool = True


@dataclass
class JoinRequest:
    """An AddOnRight request to `left` on `node`, outstanding since `since`."""

    left: str
    node: str
    since: float
    task: asyncio.Future[None]


class MemberShell:
    """Runs one RingMember; `events` receives what the application should see."""

    def __init__(self, host: MemberHost, core: RingMember, events: Callable[[MemberEvent], None]) -> None:
        self.host = host
        self.core = core
        self.events = events
        self.neighbours: Neighbours | None = None
        self.join_request: JoinRequest | None = None
        self.joined = asyncio.Event()
        self.stopped: Stopped | None = None
        self._done = asyncio.Event()
        self._inbox: asyncio.Queue[Callable[[RingMember], list[Action]]] = asyncio.Queue()
        # Who waits for the ring to confirm through a seq: called with None then, or with the error once
        # the member stops first (`broadcast_now`'s awaiting callers and `broadcast_then`'s callbacks).
        self._confirms: list[tuple[int, Callable[[Exception | None], None]]] = []
        self._confirmed_through = 0
        self._add_replies: dict[str, asyncio.Future[Group | None]] = {}
        self._joining_since: float | None = None
        self._finished_callbacks: list[Callable[[], None]] = []
        self._join_noted_at = 0.0
        self._join_attempts = 0
        self._calls: set[asyncio.Future[tuple[int, list[Action]]]] = set()
        self._flush_armed = False  # a flush after the interval is scheduled
        self._acks_flush_armed = False  # a flush of acknowledgements alone is scheduled (ACKS_ALONE_WAIT_SECONDS)
        self._flush_soon = False  # a flush once this input is done is scheduled
        self._join_timer_armed = False
        # Told of every ring message this member receives, with the node it came from
        # (the queue layer's ring-hop spans); None: nobody is told.
        self.ring_observer: Callable[[RingMessage, str], None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._in_input = False  # an input is being taken (by the run loop, or at once by `offer`)
        # What an input `offer` took delivers once the link's writer had its turn (None: nothing waits).
        self._after_writers_turn: list[Action] | None = None
        self._tasks: set[asyncio.Future[None]] = set()

    @property
    def id(self) -> str:
        return self.core.id

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())
        self.post(lambda core: core.start())

    def post(self, step: Callable[[RingMember], list[Action]]) -> None:
        """Queue one input for the ring member."""
        self._inbox.put_nowait(step)

    def offer(self, step: Callable[[RingMember], list[Action]]) -> None:
        """Take one input now if the member is between inputs, else queue it (`post`). Taken now, its
        actions that neither wait nor feed the core are carried out now too, and the rest go to the inbox
        ahead of every later input; an Activity passed on goes to the link now and what it delivers right
        after the link's writer had its turn of the event loop (`_after_writers_turn`), still before the
        member's next input."""
        if self._in_input or self.stopped is not None or self._task is None or not self._inbox.empty():
            self.post(step)
            return
        self._in_input = True
        deferred = False
        try:
            actions = step(self.core)
            if _forward_first(actions):
                for action in actions:
                    if isinstance(action, SendRight):
                        self._carry_out(action)  # wakes the link's writer: its turn comes before ours
                self._after_writers_turn = [action for action in actions if not isinstance(action, SendRight)]
                asyncio.get_running_loop().call_soon(self._carry_out_after_writers_turn)
                deferred = True
            else:
                rest = self._carry_out_at_once(actions)
                if rest:
                    self.post(lambda _core: rest)
        except ProtocolViolation as error:  # as the run loop does: nothing raised here reaches the link
            self._violated(error)
        except Exception as error:
            self._failed(error)
        finally:
            if not deferred:
                self._in_input = False
        self._wake_if_stopped()

    def _carry_out_after_writers_turn(self) -> None:
        """The rest of an input `offer` took (what an Activity passed on delivers); the input ends here."""
        actions, self._after_writers_turn = self._after_writers_turn, None
        if actions is None:
            return  # the run loop got here first
        try:
            for action in actions:
                self._carry_out(action)
        except ProtocolViolation as error:
            self._violated(error)
        except Exception as error:
            self._failed(error)
        finally:
            self._in_input = False
        self._wake_if_stopped()

    def _wake_if_stopped(self) -> None:
        if self.stopped is not None:
            self.post(lambda _core: [])  # wakes the run loop, which ends

    async def wait_stopped(self) -> Stopped | None:
        await self._done.wait()
        return self.stopped

    # ------------------------------------------------------------ application

    async def broadcast(self, bodies: list[bytes], confirmed: bool) -> tuple[int, int]:
        """Broadcast `bodies`; with `confirmed`, wait until every live member delivered them."""
        return await self.broadcast_now(bodies, confirmed)

    def broadcast_now(self, bodies: list[bytes], confirmed: bool) -> Awaitable[tuple[int, int]]:
        """Queue the broadcast now, so broadcasts keep the order of these calls
        whoever awaits them when; the result completes as `broadcast` does."""
        if self.stopped is not None:
            raise ConnectionAbortedError(f"member {self.id} stopped: {self.stopped.reason}")
        result: asyncio.Future[tuple[int, list[Action]]] = asyncio.get_running_loop().create_future()
        self._calls.add(result)
        result.add_done_callback(self._calls.discard)

        def step(core: RingMember) -> list[Action]:
            first, actions = core.broadcast(bodies)  # NotJoined propagates to the caller
            result.set_result((first, []))
            return actions

        self.post(self._guard(step, result))  # posted, not offered (the module's docstring says why)
        return self._broadcast_done(result, len(bodies), confirmed)

    def broadcast_then(self, bodies: list[bytes], confirmed: bool, then: Callable[[int, int], None]) -> None:
        """`broadcast_now` for a caller that would rather be called than wait: queue the broadcast now, and
        call `then(first, last)` once the core took it and, with `confirmed`, once every live member
        delivered it, from the input that confirmed it (a queue's step completes in the turn its ring round
        ended, not a turn later in a task awaiting it). Never called if the member stops first, or if the
        core refuses the broadcast (logged)."""
        if self.stopped is not None:
            raise ConnectionAbortedError(f"member {self.id} stopped: {self.stopped.reason}")
        count = len(bodies)

        def step(core: RingMember) -> list[Action]:
            try:
                first, actions = core.broadcast(bodies)
            except ProtocolViolation:
                raise
            except Exception as error:  # NotJoined
                log.warning("member %s refused a broadcast of %d bodies: %r", self.id, count, error)
                return []
            last = first + count - 1
            if confirmed and last > self._confirmed_through:
                self._confirms.append((last, functools.partial(_call_unless_stopped, then, first, last)))
            else:
                asyncio.get_running_loop().call_soon(then, first, last)
            return actions

        self.post(step)  # posted, not offered (the module's docstring says why)

    async def _broadcast_done(
        self, result: asyncio.Future[tuple[int, list[Action]]], count: int, confirmed: bool
    ) -> tuple[int, int]:
        first, _ = await result
        last = first + count - 1
        if confirmed and last > self._confirmed_through:
            if self.stopped is not None:
                # Stopped in the same pass that took the broadcast: _finish already failed the waiters.
                raise ConnectionAbortedError(f"member {self.id} stopped: {self.stopped.reason}")
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._confirms.append((last, functools.partial(_settle, waiter)))
            await waiter
        return first, last

    async def add_on_right(self, newcomer: str, node: str) -> Group | None:
        """Serve a newcomer's AddOnRight request (PeerService)."""
        reply: asyncio.Future[Group | None] = asyncio.get_running_loop().create_future()
        self._add_replies[newcomer] = reply
        self.post(lambda core: core.on_add_on_right(newcomer, node))
        return await reply

    def leave(self) -> None:
        self.post(lambda core: core.leave())

    # ------------------------------------------------------- failure detection

    def watched(self) -> list[Watched]:
        """The members to watch for failure: the neighbours, or while joining the member asked to add us."""
        if self.stopped is not None:
            return []
        out: list[Watched] = []
        neighbours = self.neighbours
        if neighbours is not None:
            out.append(Watched(neighbours.left, neighbours.left_node, neighbours.left_since))
            out.append(Watched(neighbours.right, neighbours.right_node, neighbours.right_since))
        if self.join_request is not None:
            request = self.join_request
            out.append(Watched(request.left, request.node, request.since, neighbour=False))
        return out

    def report_down(self, member: str, evidence: str) -> None:
        """The host's failure detector gave up on `member` (a neighbour, or the
        join target: its request is abandoned); `evidence` says why."""
        request = self.join_request
        if request is not None and request.left == member:
            request.task.cancel()
            self._end_join_request()
            self.post(lambda core: core.on_join_failed(member, down_evidence=evidence))
        else:
            self.post(lambda core: core.on_neighbour_down(member, evidence))

    # ------------------------------------------------------------------- loop

    def _guard(
        self, step: Callable[[RingMember], list[Action]], result: asyncio.Future[tuple[int, list[Action]]]
    ) -> Callable[[RingMember], list[Action]]:
        def guarded(core: RingMember) -> list[Action]:
            try:
                return step(core)
            except ProtocolViolation:
                raise
            except Exception as error:
                if not result.done():
                    result.set_exception(error)
                return []

        return guarded

    async def _run(self) -> None:
        try:
            while self.stopped is None:
                step = await self._inbox.get()
                if self._after_writers_turn is not None:  # never seen: its callback was due first
                    self._carry_out_after_writers_turn()
                self._in_input = True
                try:
                    await self._execute(step(self.core))
                finally:
                    self._in_input = False
        except ProtocolViolation as error:
            self._violated(error)
        except Exception as error:
            self._failed(error)

    def _violated(self, error: ProtocolViolation) -> None:
        log.error("member %s stopped on a protocol violation: %s", self.id, error)
        self._finish(Stopped(f"protocol violation: {error}"))

    def _failed(self, error: Exception) -> None:
        log.exception("member %s failed", self.id)
        self._finish(Stopped(f"failed: {error!r}"))

    def _carry_out_at_once(self, actions: list[Action]) -> list[Action]:
        """Carry out `actions` in order up to the first that waits or feeds the core; return the rest."""
        for index, action in enumerate(actions):
            if isinstance(action, _WAITS_OR_FEEDS):
                return actions[index:]
            self._carry_out(action)
        return []

    async def _execute(self, actions: list[Action]) -> None:
        pending = list(actions)
        if _forward_first(pending):
            # An Activity passed on: its frame goes to the link first, and the writer gets one turn of the
            # event loop to start writing it before this member hands the publications to the application.
            for action in pending:
                if isinstance(action, SendRight):
                    await self._perform(action)  # queues the frame for the link: it never waits
            pending = [action for action in pending if not isinstance(action, SendRight)]
            await asyncio.sleep(0)
        while pending:
            action = pending.pop(0)
            pending[:0] = await self._perform(action)

    async def _perform(self, action: Action) -> list[Action]:
        core = self.core
        if isinstance(action, ReadGroup):
            return core.on_group(await self.host.read_group(core.group_name))
        if isinstance(action, WriteGroup):
            outcome, written = await self.host.change_group(core.group_name, action.change)
            _log_write(core.group_name, action, outcome, written)
            return core.on_group_written(outcome, written)
        if isinstance(action, ChooseLeft):
            return core.join_via(random.choice(action.candidates))
        self._carry_out(action)
        return []

    def _carry_out(self, action: Action) -> None:
        """Carry out an action that neither waits nor feeds the core (any but `_WAITS_OR_FEEDS`)."""
        if isinstance(action, SendRight):
            if isinstance(action.message.body, Catchup):
                log.debug(
                    "member %s: Catchup to %s on %s (joining: %s)",
                    self.id,
                    action.message.receiver,
                    action.node,
                    action.message.body.joining,
                )
            self.host.send_ring_message(action.node, action.message)
        elif isinstance(action, Deliver | MembersChanged):
            self.events(action)
        elif isinstance(action, Confirmed):
            self._confirm(action.through_seq)
        elif isinstance(action, Joined):
            self._joining_since = None
            self.joined.set()
            self.events(action)
        elif isinstance(action, StartFlushTimer):
            # Publications go as soon as this input is done when the link to the right is idle (waiting
            # gains nothing), or when they are few (SMALL_FLUSH_BYTES: light traffic, where a message's
            # latency is mostly such waits; the link's writer merges the frame with the one queued ahead
            # of it, so it costs no extra write). Large ones on a busy link batch for the interval.
            # Acknowledgements alone wait longer (ACKS_ALONE_WAIT_SECONDS) for a frame to ride on; their
            # timer is their own, so it never holds back a buffer's. Prompt ones (a dead member's, whose
            # death the application hears of only once they went round) wait the flush interval.
            loop = asyncio.get_running_loop()
            if action.acks_only and not action.prompt:
                if not self._acks_flush_armed:
                    self._acks_flush_armed = True
                    loop.call_later(max(ACKS_ALONE_WAIT_SECONDS, self.host.flush_interval), self._acks_flush_due)
                return
            idle = self.neighbours is not None and self.host.link_idle(self.neighbours.right_node)
            if not action.acks_only and (idle or action.buffered_bytes < SMALL_FLUSH_BYTES):
                if not self._flush_soon:
                    self._flush_soon = True
                    loop.call_soon(self._flush_due)
            elif not self._flush_armed:
                self._flush_armed = True
                loop.call_later(self.host.flush_interval, self._flush_later_due)
        elif isinstance(action, RequestAddOnRight):
            self._note_slow_join(action.left, action.node)
            task = asyncio.ensure_future(self._request_add(action.left, action.node))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self.join_request = JoinRequest(action.left, action.node, time.monotonic(), task)
            self.host.neighbours_changed()
        elif isinstance(action, AddOnRightReply):
            reply = self._add_replies.pop(action.newcomer, None)
            if reply is not None and not reply.done():
                reply.set_result(action.group)
        elif isinstance(action, WatchNeighbours):
            now, old = time.monotonic(), self.neighbours
            left_since = old.left_since if old is not None and old.left == action.left else now
            right_since = old.right_since if old is not None and old.right == action.right else now
            self.neighbours = Neighbours(
                action.left, action.left_node, action.right, action.right_node, left_since, right_since
            )
            if old is None or (old.left_node, old.right_node) != (action.left_node, action.right_node):
                # Links are per node: the same nodes need no new ones (every view re-read says the
                # neighbours again; recomputing the node's wanted links each time costs O(members)).
                self.host.neighbours_changed()
        elif isinstance(action, Stopped):
            self._finish(action)

    def _note_slow_join(self, left: str, node: str) -> None:
        """Log, every SLOW_JOIN_NOTE_SECONDS, a join that has not succeeded yet (it asks `left` now)."""
        now = time.monotonic()
        if self._joining_since is None:
            self._joining_since, self._join_noted_at, self._join_attempts = now, now, 0
        self._join_attempts += 1
        if now - self._join_noted_at >= SLOW_JOIN_NOTE_SECONDS:
            self._join_noted_at = now
            log.info(
                "member %s: still joining after %.0f s and %d requests; asking %s on %s now",
                self.id,
                now - self._joining_since,
                self._join_attempts,
                left,
                node,
            )

    def _flush_due(self) -> None:
        self._flush_soon = False
        self.post(_flush)

    def _flush_later_due(self) -> None:
        self._flush_armed = False
        self.post(_flush)

    def _acks_flush_due(self) -> None:
        self._acks_flush_armed = False
        self.post(_flush)

    def _confirm(self, through: int) -> None:
        self._confirmed_through = max(self._confirmed_through, through)
        if not any(seq <= through for seq, _ in self._confirms):
            return
        due = [call for seq, call in self._confirms if seq <= through]
        self._confirms = [(seq, call) for seq, call in self._confirms if seq > through]
        for call in due:
            call(None)

    async def _request_add(self, left: str, node: str) -> None:
        """Ask `left` to add us; report its answer. Silence is the failure detector's
        business: it cancels this task through `report_down`."""
        try:
            group = await self.host.add_on_right(self.core.group_name, left, node, self.id)
        except NotHosted as error:
            evidence = str(error)
            self._end_join_request()
            self.post(lambda core: core.on_join_failed(left, down_evidence=evidence))
            return
        except Exception as error:
            log.warning("member %s: asking %s on %s to add it failed: %r; choosing again", self.id, left, node, error)
            group = None
        self._end_join_request()  # an answer: whatever it says, the target's node lives
        if group is None:
            await asyncio.sleep(NOT_READY_PAUSE_SECONDS)  # the member asked is still joining itself
            self.post(lambda core: core.on_join_failed(left, down_evidence=None))
        else:
            self.post(lambda core: core.on_join_reply(group))
            self._arm_join_timer()

    def _arm_join_timer(self) -> None:
        if not self._join_timer_armed:
            self._join_timer_armed = True
            asyncio.get_running_loop().call_later(self.host.join_timeout, self._join_timer_due)

    def _join_timer_due(self) -> None:
        """Added but not joined yet after the join timeout: the joining Catchup may be lost (hard case 9)."""
        self._join_timer_armed = False
        if self.joined.is_set() or self.stopped is not None:
            return
        self.post(lambda core: core.join_catchup_overdue())
        self._arm_join_timer()

    def _end_join_request(self) -> None:
        if self.join_request is not None:
            self.join_request = None
            self.host.neighbours_changed()

    def add_finished_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the member has stopped (at once if it has)."""
        if self.stopped is not None:
            callback()
        else:
            self._finished_callbacks.append(callback)

    def _finish(self, stopped: Stopped) -> None:
        if self.stopped is not None:
            return
        self.stopped = stopped
        waiting, self._confirms = self._confirms, []
        for _, waiter in waiting:
            waiter(ConnectionAbortedError(f"member {self.id} stopped: {stopped.reason}"))
        for call in list(self._calls):
            if not call.done():
                call.set_exception(ConnectionAbortedError(f"member {self.id} stopped: {stopped.reason}"))
        for reply in self._add_replies.values():
            if not reply.done():
                reply.set_result(None)
        if self.join_request is not None:
            self.join_request.task.cancel()
            self.join_request = None
        self.events(stopped)
        self._done.set()
        self.host.neighbours_changed()
        callbacks, self._finished_callbacks = self._finished_callbacks, []
        for callback in callbacks:
            callback()


def _settle(waiter: asyncio.Future[None], error: Exception | None) -> None:
    """A confirm waiter of `broadcast_now`'s: done, or failed with the member's stop."""
    if waiter.done():
        return
    if error is None:
        waiter.set_result(None)
    else:
        waiter.set_exception(error)


def _call_unless_stopped(then: Callable[[int, int], None], first: int, last: int, error: Exception | None) -> None:
    """A confirm waiter of `broadcast_then`'s: its caller hears of a stop from the member's Stopped event."""
    if error is None:
        then(first, last)


# Actions that wait (for the group table) or give the core a new input: carried out by the run loop only.
_WAITS_OR_FEEDS = (ReadGroup, WriteGroup, ChooseLeft)


def _flush(core: RingMember) -> list[Action]:
    return core.flush()


def _forward_first(actions: list[Action]) -> bool:
    """Whether `actions` pass an Activity on and deliver publications, and nothing else that must keep its
    place among them."""
    sends = delivers = False
    for action in actions:
        if isinstance(action, SendRight):
            if not isinstance(action.message.body, Activity):
                return False  # a Catchup: the ring's healing, not worth reordering
            sends = True
        elif isinstance(action, Deliver):
            delivers = True
        elif not isinstance(action, Confirmed | StartFlushTimer):
            return False
    return sends and delivers


def _log_write(group: str, write: WriteGroup, outcome: Outcome, written: Group) -> None:
    """Log a write that records a member dead at INFO (any other at DEBUG), with its reason and outcome."""
    change = write.change
    if not isinstance(change, MarkMemberDead):
        log.debug("group %s: %s (reason: %s): %s", group, type(change).__name__, write.reason, outcome.name)
        return
    member = change.member
    if outcome is not Outcome.APPLIED:
        log.info("group %s: did not record %s dead (reason: %s): %s", group, member, write.reason, outcome.name)
    elif written.version > change.expected_version:
        log.info("group %s: recorded %s dead (reason: %s)", group, member, write.reason)
    else:
        log.info("group %s: %s was already recorded dead (reason: %s)", group, member, write.reason)
