"""Guaranteed multicast on a ring: the pure state machine of one member.

The guarantee
-------------
If member P publishes m and then m', every member that was in the group
before m was published and that delivers m' also delivers m, and delivers it
first. A message keeps travelling to every member as long as not every member
that holds it leaves. Only per-publisher order is promised: there is no causal
or total order across publishers (if Q delivers m and then publishes m'',
another member may deliver m'' before m).

What the application sees
-------------------------
- `Deliver(publisher, first_seq, bodies)`: consecutive publications of one
  publisher, never a gap, never twice. A member delivers its own publications
  at once, when it publishes them; that says nothing about anyone else.
- `Confirmed(through_seq)`: every live member has delivered this member's
  publications up to `through_seq` (confirmed broadcast).
- `MembersChanged(births, deaths)`: a birth is reported before any message of
  that member is delivered; a death only once the dead member has been
  erased from the group, which happens only after every one of its
  messages has gone all the way round: nothing of it is delivered afterwards.
  A member that joins and dies quickly may be seen dead at birth.

Why a ring
----------
A publisher sending to every member itself would need a full mesh, and if it
died half way through its fan-out nobody would know who still lacks the
message. Arranged in a ring, each member sends only to its right neighbour:
the load is even whoever publishes, and responsibility is clear. A
publication goes once round the ring; when it comes back to its publisher,
every member has it, and the publisher sends an acknowledgement round so that
members can forget it. Until then every member keeps it "pending": that copy
is what lets the ring heal when a member dies.

Protocol
--------
Membership is a totally ordered group table in the coordinator: members in
ring order, each alive or dead, and a version bumped by every change (each a
compare-and-set on the version). Every ring message carries its sender's
view version; a member receiving a newer version re-reads the table first
(a message sent under view N is interpreted correctly under any view >= N).

- Join: a newcomer asks a live member L to add it on L's right. L records it
  in the table, then sends it a Catchup holding L's whole state (marked
  `joining`), and from then on forwards to it. The newcomer starts from
  exactly L's state, delivering nothing in it, and forwards it to its own
  right neighbour (which may have missed what L sent it before the change).
- Broadcast: deliver locally, append to a buffer; the buffer goes right as one
  Activity when the flush timer fires or when it holds `max_buffer_bytes`.
- Acknowledgements ride along: an acknowledgement to pass right (one this
  member issued, or one from its left that carries no publication) waits for
  the next Activity going right and travels in it, merged into its publisher's
  entry; with nothing else to carry it, a flush timer sends it alone
  (`StartFlushTimer(acks_only=True)`: the shell waits for a frame to ride on
  longer than the flush interval, even on an idle link: services/gm/member.py
  `ACKS_ALONE_WAIT_SECONDS`). Acknowledgements only let members forget what
  went all the way round: they confirm nothing to anyone, so waiting costs no
  latency, and under steady traffic it halves the ring's frames. Except those
  of a dead member's publications (`prompt`: the flush interval at most): the
  dead member is erased, and its death reported, only once they are back.
- Activity from the left: publications not seen before are delivered, kept
  pending and forwarded; acknowledgements drop pending entries and are
  forwarded. A publication that comes back to the member that owns its
  publisher (the publisher itself, or the live member that inherited it) is
  turned into an acknowledgement; an acknowledgement that comes back to the
  owner is retired and goes no further.
- Death: a member whose neighbour fails records it dead in the table. A dead
  member is inherited by the nearest live member to its right (it saw the
  dead member's publications first, so it knows most of them). When a
  member's right neighbour changes it sends the new right a Catchup; the
  receiver computes from it what it missed: publications the left holds past
  its own last one, acknowledgements implied where the left holds nothing
  (prefix); for publishers it owns, publications the left also holds have
  completed the round (common) and become acknowledgements; the rest
  (suffix) is still on its way.
- Erasure: once everything an inherited member published is retired at its
  owner (last acknowledgement retired == last publication), the owner erases
  it from the table. Only then do members report its death.

Hard cases (each is a test in tests/sim)
----------------------------------------
1. Conflicting changes (B dies while B' joins between A and B) must not leave
   two members each thinking it inherited B: the table imposes a total order
   on all changes, and inheritance is a function of one version of it.
2. A newcomer must get its state atomically with its insertion. If it took
   state from any other member than the one that added it, that state could
   hold publications made after it joined, which it would then never
   deliver: a hole. So a newcomer adopts only the `joining` Catchup of the
   member that added it; if that member dies before the Catchup arrives, the
   newcomer records itself dead and rejoins under a new id.
3. A message from a member that is no longer my left (it died, or someone
   joined in between) is dropped: the Catchup from my new left covers all it
   could have carried, because the new left knows at least as much.
4. A newly inherited member's acknowledgements may still be in flight
   downstream: its owner's "last ack" was only the last one it *saw*. The
   Catchup from the left replaces it with the left's, the last one that went
   all the way round, and no erasure is decided before that Catchup.
5. The last live member confirms everything pending (no one else can
   deliver it) and erases every dead member.
6. An acknowledgement dies with the members carrying it if all of them go
   (one crashes, its neighbour leaves): its owner would wait forever to
   retire it and could never erase a dead publisher. So an owner re-issues,
   on every Catchup it receives, each acknowledgement it issued and has not
   seen come back; members pass on acknowledgements even when not news, and
   a duplicate dies at the owner like any other.

7. A link between two live neighbours breaks: frames in flight are lost, and
   frames queued meanwhile reach the right neighbour on the new connection
   *before* the Catchup the left re-sends on reconnecting (the link layer
   calls `resend_catchup`). The right then sees a gap in a publisher's run
   from its own left. That is lost frames, not a broken protocol: it drops
   everything from the left until the Catchup, which covers all of it
   (tests/sim/queue_sim.py cuts links between live members).

8. The joining Catchup itself may be lost that way (the link to the
   newcomer was still the one from before a partition, dead but not yet
   noticed). A newcomer adopts only a joining Catchup from its adder, so
   the Catchup re-sent on reconnecting is marked joining when its receiver
   is a member this one added; a member that has joined treats it as any
   Catchup.

9. That re-sent Catchup goes to the adder's right neighbour, and by then
   that may be another newcomer, added on the adder's right after the first
   (a partition heals and every node's replica joins through the one
   survivor at once): the first newcomer would wait for ever, and the ring
   with it, since nothing passes a member that has no state. So a newcomer
   whose joining Catchup has not come within the shell's join timeout
   (`join_catchup_overdue`) gives up its id as when its adder dies: it
   records itself dead and rejoins under a new id (found in a partition
   test: tests/test_partition_integrity.py).

Invariants (asserted by the simulator after every step)
-------------------------------------------------------
- Every dead member in a view is inherited by exactly one live member.
- A member's pending run for a publisher is consecutive and ends at its
  last publication; at a non-owner it starts right after its last ack.
- Well formed: no member holds pending a publication whose acknowledgement
  its owner has already retired, nor knows a publication the owner does not.

The shell contract
------------------
Each `on_*` method is one input and returns actions, to be carried out in
order. After `ReadGroup` the shell must call `on_group`, and after
`WriteGroup` `on_group_written`, before any other input. A read must return
the table at least as new as every change committed before it began (a
ZooKeeper store syncs first): a message claiming a newer view than that is
dropped as forged. The state machine
has no clock, socket, thread or random choice: timers, failure detection and
choice of a join target are the shell's, so a simulator can drive it
deterministically.

Who is recorded dead: a member records another dead only on the shell's
word, given with its evidence: `on_neighbour_down(member, evidence)` for a
neighbour, `on_join_failed(left, evidence)` for the member it asked to add
it. The shell says so only once that member's node has been unreachable
continuously for the failure timeout and still is after a grace, or has
answered that it does not host that member (its node restarted). A join
request that merely failed (no answer yet: the target's node was slow, or
the channel to it was still backing off from an earlier outage) is a
suspicion like any other, checked by the same failure detector, and is
never reported as a death; a refusal ("not ready") is reported with no
evidence and only makes the member choose again. Every `WriteGroup` carries
the reason of its change in words (for a death: whose, on which node, and
the evidence), for the shell to log.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    PublisherActivity,
    PublisherState,
    ReadGroup,
    RequestAddOnRight,
    RingMessage,
    SendRight,
    StartFlushTimer,
    Stopped,
    WatchNeighbours,
    WriteGroup,
)
from services.gm.pending import PendingRun
from services.gm.view import View, view_of

# A flush as large as a link fragment: bigger batches gain little and would be
# split anyway (peer.proto: bodies over 64 KiB travel as fragments).
DEFAULT_MAX_BUFFER_BYTES = 64 * 1024


class ProtocolViolation(Exception):
    """A message contradicts the ring's invariants: a bug, never bad luck."""


class NotJoined(Exception):
    """The member cannot broadcast: it has not joined, or has left."""


class _Publisher:
    """What this member knows of one publisher."""

    __slots__ = ("last_ack", "last_pub", "pending")

    def __init__(self, last_pub: int = 0, last_ack: int = 0, pending: PendingRun | None = None) -> None:
        self.last_pub = last_pub
        # At a non-owner: the last acknowledgement seen. At the owner: the last
        # one retired (it came back round the ring).
        self.last_ack = last_ack
        # At a non-owner: received and not yet acknowledged. At the owner: not
        # yet back round the ring.
        self.pending = pending if pending is not None else PendingRun(last_pub + 1)

    def acked_through(self) -> int:
        """Everything up to here is acknowledged (issued, at the owner) as far as we know."""
        return self.pending.first_seq - 1 if len(self.pending) else self.last_pub


@dataclass(frozen=True, slots=True)
class _Intent:
    """A group change this member wants; re-decided against each new version.

    `reason` says why, in words for the log: it travels with the `WriteGroup`.
    """

    kind: str  # "create" | "add" | "mark_dead" | "abandon" | "leave"
    reason: str
    member: str = ""
    node: str = ""


class RingMember:
    """One member of one group's ring (see the module header)."""

    def __init__(
        self, group: str, member_id: str, node: str, *, max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES
    ) -> None:
        self.group_name = group
        self.id = member_id
        self.node = node
        self.max_buffer_bytes = max_buffer_bytes
        self.view: View | None = None
        self._group: Group | None = None
        # None until the member has its starting state.
        self.publishers: dict[str, _Publisher] | None = None
        self.next_seq = 1
        self._buffer: list[bytes] = []
        self._buffer_bytes = 0
        # Acknowledgements to pass right (publisher -> acknowledged through), waiting to ride on the next
        # Activity that goes right, or on the flush timer (see "Acknowledgements ride along" above).
        self._acks_out: dict[str, int] = {}
        # True once a Catchup from the current left was processed (or alone).
        self._caught_up = False
        # Frames from the left were lost (hard case 7): its messages are dropped until its Catchup.
        self._lost_from_left = False
        self._deferred: list[RingMessage] = []
        # Messages that arrived before our starting state, replayed after it.
        self._early: list[RingMessage] = []
        self._awaiting: str | None = None  # "read" | "write"
        self._intents: list[_Intent] = []
        self._adding: dict[str, str] = {}  # newcomer -> node, while its AddMember is decided
        # Newcomers this member added (still in the view): a Catchup re-sent to one is marked joining,
        # since its first one may have been lost with a broken link (hard case 8).
        self._added: set[str] = set()
        self._adder: str | None = None
        self._was_member = False
        self._reported: frozenset[str] = frozenset()
        self.stopped: Stopped | None = None

    @property
    def caught_up(self) -> bool:
        """True once a Catchup from the current left was processed (or alone)."""
        return self._caught_up

    # ------------------------------------------------------------------ inputs

    def start(self) -> list[Action]:
        """Begin joining the group."""
        return self._read(0)

    def on_group(self, group: Group) -> list[Action]:
        """The group table, as read after a `ReadGroup` (at least as new as every
        change committed before the read began)."""
        if self._awaiting == "read":
            self._awaiting = None
        self._expect_no_io()
        if self.stopped:
            return []
        # The table is the source of truth: a message claiming a view newer
        # than a fresh read of it was forged or corrupted. Waiting for that
        # view would stall this member for good, so the message is dropped.
        self._deferred = [m for m in self._deferred if m.view_version <= group.version]
        return self._adopt_group(group)

    def on_group_watched(self, group: Group) -> list[Action]:
        """A version of the group table the coordinator's watch brought, unasked. A member takes it if it
        is newer than its view and it is in the group (joined, or added and waiting for its adder's
        Catchup: if the adder died meanwhile it must see so, hard case 2); a newcomer still choosing
        whom to join through reads the table itself."""
        self._expect_no_io()
        if self.stopped or self.view is None or group.version <= self.view.version:
            return []
        if self.publishers is None and self.id not in self.view.known:
            return []
        return self.on_group(group)

    def on_group_written(self, outcome: Outcome, group: Group) -> list[Action]:
        """The result of the last `WriteGroup`."""
        if self._awaiting != "write":
            raise ProtocolViolation("on_group_written without a WriteGroup")
        self._awaiting = None
        if self.stopped:
            return []
        if outcome is Outcome.ACTOR_NOT_ALIVE:
            return self._stop("lost membership", rejoin=self.publishers is None)
        return self._adopt_group(group)

    def on_message(self, message: RingMessage) -> list[Action]:
        """A ring message from a neighbour."""
        self._expect_no_io()
        if self.stopped or message.group != self.group_name:
            return []
        if self._deferred or self.view is None or message.view_version > self.view.version:
            self._deferred.append(message)
            return self._read(message.view_version)
        return self._handle_message(message)

    def broadcast(self, bodies: list[bytes]) -> tuple[int, list[Action]]:
        """Publish `bodies`; returns the sequence number of the first and the actions."""
        self._expect_no_io()
        if self.publishers is None or self.view is None or self.stopped or self._leaving():
            raise NotJoined(f"member {self.id} of {self.group_name} is not joined")
        first = self.next_seq
        self.next_seq += len(bodies)
        actions: list[Action] = [Deliver(self.id, first, bodies)]
        if self._alone():
            own = self._state(self.id)
            own.last_pub = own.last_ack = self.next_seq - 1
            own.pending = PendingRun(self.next_seq)
            actions.append(Confirmed(self.next_seq - 1))
            return first, actions
        was_empty = not self._buffer
        self._buffer.extend(bodies)
        self._buffer_bytes += sum(len(body) for body in bodies)
        if self._buffer_bytes >= self.max_buffer_bytes:
            actions += self.flush()
        elif was_empty:
            actions.append(StartFlushTimer(buffered_bytes=self._buffer_bytes))
        return first, actions

    def flush(self) -> list[Action]:
        """Send the broadcast buffer right, with the acknowledgements waiting (the flush timer fired)."""
        self._expect_no_io()
        if self.publishers is None or self.view is None or self.stopped:
            return []
        if not self._buffer:
            if not self._acks_out or self._alone():
                self._acks_out.clear()
                return []
            return [self._send(Activity(self._take_acks([])))]
        own = self._state(self.id)
        first = own.last_pub + 1
        bodies = self._buffer
        self._buffer = []
        self._buffer_bytes = 0
        own.pending.append(first, bodies)
        own.last_pub = first + len(bodies) - 1
        return [self._send(Activity(self._take_acks([PublisherActivity(self.id, first, bodies)])))]

    def on_add_on_right(self, newcomer: str, node: str) -> list[Action]:
        """A newcomer asks to be added right of this member."""
        self._expect_no_io()
        if self.publishers is None or self.view is None or self.stopped or self._leaving():
            return [AddOnRightReply(newcomer, None)]
        if newcomer in self.view.known:
            return [AddOnRightReply(newcomer, self._group)]  # a retried request
        self._adding[newcomer] = node
        self._intents.append(_Intent("add", f"{newcomer} on {node} asked to join on our right", newcomer, node))
        return self._next_write()

    def join_via(self, left: str) -> list[Action]:
        """The shell chose `left` (from `ChooseLeft`) to join through."""
        self._adder = left
        node = self.view.nodes.get(left, "") if self.view else ""
        return [RequestAddOnRight(left, node)]

    def on_join_reply(self, group: Group) -> list[Action]:
        """The member asked to add us answered with the group including us."""
        return self.on_group(group)

    def on_join_failed(self, left: str, down_evidence: str | None) -> list[Action]:
        """The member asked to add us did not. `down_evidence` None: it answered
        that it cannot add members now (it is still joining itself), so choose
        again. Otherwise the shell found `left` gone, and this says how (its node
        silent past the failure timeout and the grace, or answering that it does
        not host `left`): `left` is recorded dead. A join that merely failed,
        with no such finding, must never be reported this way (see the header)."""
        self._expect_no_io()
        if self.stopped or self._was_member:
            return []
        self._adder = None
        if down_evidence is not None:
            node = self.view.nodes.get(left, "?") if self.view else "?"
            reason = f"join target {left} on {node} down ({down_evidence})"
            self._intents.append(_Intent("mark_dead", reason, left))
            return self._next_write()
        return self._read(0)

    def on_neighbour_down(self, member: str, evidence: str) -> list[Action]:
        """The failure detector gave up on `member` (after its grace period);
        `evidence` says why (e.g. "silent 2.1 s"), for the record."""
        self._expect_no_io()
        if self.stopped or self.view is None or self.id not in self.view.live:
            return []
        me = self.view.live[self.id]
        if member not in (me.left, me.right) or member == self.id or member not in self.view.live:
            return []
        reason = f"neighbour {member} on {self.view.nodes[member]} down ({evidence})"
        self._intents.append(_Intent("mark_dead", reason, member))
        return self._next_write()

    def leave(self) -> list[Action]:
        """Leave gracefully: flush, record ourselves dead, tell the ring."""
        self._expect_no_io()
        if self.stopped:
            return []
        if self.view is None or self.id not in self.view.live:
            return self._stop("left")
        actions = self.flush()
        self._intents.append(_Intent("leave", "left the group"))
        return actions + self._next_write()

    def join_catchup_overdue(self) -> list[Action]:
        """The shell's join timer fired (hard case 9): if this member is in the group but has no
        starting state yet, its adder's joining Catchup was lost; record ourselves dead and rejoin."""
        self._expect_no_io()
        if self.stopped or self.publishers is not None or self._adder is None or self.view is None:
            return []
        if self.id not in self.view.live or any(intent.kind == "abandon" for intent in self._intents):
            return []  # not added yet (the join request is still the shell's business), or given up already
        self._intents = [_Intent("abandon", f"join interrupted: no joining Catchup from {self._adder}")]
        return self._next_write()

    def check_membership(self) -> list[Action]:
        """Re-read the table (the node's fallback to its group watch asks when
        its listing of the node's groups lacks this member's). A member
        recorded dead (paused past the failure timeout, or cut off) is sent
        nothing more, so this is one way it learns that it must stop."""
        self._expect_no_io()
        if self.stopped or self.view is None or not self._was_member:
            return []
        return self._read(self.view.version)

    def resend_catchup(self) -> list[Action]:
        """The link to the right neighbour was re-established: frames may have
        been lost with the old one, and a Catchup recovers anything missed."""
        self._expect_no_io()
        if self.stopped or self.publishers is None or self.view is None or self._alone():
            return []
        me = self.view.live.get(self.id)
        return [self._catchup_to_right(joining=me is not None and me.right in self._added)]

    # ------------------------------------------------------------ group table

    def _read(self, version: int) -> list[Action]:
        if self._awaiting is not None:
            return []
        self._awaiting = "read"
        return [ReadGroup(version)]

    def _adopt_group(self, group: Group) -> list[Action]:
        if self.view is not None and group.version < self.view.version:
            return self._after_view()
        self._group = group
        entry = group.member(self.id)
        if entry is None:
            if self._was_member:
                return self._stop("erased from the group", rejoin=self.publishers is None)
            return self._decide_join(group)
        if not entry.alive:
            if self._leaving():
                return self._leave_done(group)
            return self._stop("recorded dead", rejoin=self.publishers is None)
        self._was_member = True
        actions = self._change_view(view_of(group))
        if self.stopped:
            return actions
        return actions + self._after_view()

    def _decide_join(self, group: Group) -> list[Action]:
        alive = group.alive_ids()
        self.view = view_of(group)
        if not alive:
            self._intents = [_Intent("create", "no live member: starting the group")]
            return self._next_write()
        return [ChooseLeft(tuple(alive))]

    def _after_view(self) -> list[Action]:
        """Replay deferred messages, then pursue intents and erasures."""
        actions: list[Action] = []
        while self._deferred and self.view is not None and not self.stopped:
            if self._deferred[0].view_version > self.view.version:
                return actions + self._read(self._deferred[0].view_version)
            actions += self._handle_message(self._deferred.pop(0))
            if self._awaiting is not None:
                return actions
        if self.stopped or self._awaiting is not None:
            return actions
        return actions + self._next_write()

    def _next_write(self) -> list[Action]:
        """Issue the first intent still wanted, or an erasure, as one WriteGroup."""
        if self._awaiting is not None or self.stopped or self.view is None:
            return []
        group_version = self.view.version
        while self._intents:
            intent = self._intents[0]
            change = self._change_for(intent, group_version)
            if change is None:
                self._intents.pop(0)
                continue
            self._awaiting = "write"
            return [WriteGroup(change, intent.reason)]
        erasable = self._erasable()
        if erasable:
            self._awaiting = "write"
            reason = f"nothing of {', '.join(erasable)} is in flight any more"
            return [WriteGroup(EraseMembers(group_version, tuple(erasable), self.id), reason)]
        return []

    def _change_for(self, intent: _Intent, version: int) -> GroupChange | None:
        view = self.view
        assert view is not None
        if intent.kind == "create":
            if view.live or self._was_member:
                return None
            return CreateGroup(version, GroupMember(self.id, self.node))
        if intent.kind == "add":
            if intent.member in view.known:
                return None
            return AddMember(version, self.id, GroupMember(intent.member, intent.node))
        if intent.kind == "mark_dead":
            if intent.member not in view.live:
                return None
            return MarkMemberDead(version, intent.member, self.id, joining=not self._was_member)
        # "abandon" and "leave": record ourselves dead.
        if self.id not in view.live or (intent.kind == "abandon" and self.publishers is not None):
            return None
        return MarkMemberDead(version, self.id, self.id)

    def _erasable(self) -> list[str]:
        if self.publishers is None or self.view is None or not self._caught_up:
            return []
        me = self.view.live.get(self.id)
        if me is None:
            return []
        out = []
        for alias in sorted(me.aliases):
            state = self.publishers.get(alias)
            if state is None or (state.last_ack == state.last_pub and not state.pending):
                out.append(alias)
        return out

    # ------------------------------------------------------------ view change

    def _change_view(self, new: View) -> list[Action]:
        old = self.view
        self.view = new
        me = new.live[self.id]
        old_me = old.live.get(self.id) if old is not None else None
        actions: list[Action] = [WatchNeighbours(me.left, new.nodes[me.left], me.right, new.nodes[me.right])]
        if old_me is None or me.left != old_me.left or not me.aliases <= old_me.aliases:
            self._caught_up = me.left == self.id
        if self.publishers is None:
            if me.right == self.id:
                # Alone: no one else can hold anything; start empty.
                return actions + self._start_state({}, new)
            if self._adder is not None and self._adder not in new.live:
                self._intents = [_Intent("abandon", f"join interrupted: {self._adder}, adding us, died")]
            return actions
        for publisher in [p for p in self.publishers if p not in new.known]:
            del self.publishers[publisher]
        births = tuple(sorted(new.known - self._reported))
        deaths = tuple(sorted(self._reported - new.known))
        self._reported = new.known
        if births or deaths:
            actions.append(MembersChanged(births, deaths, new.version))
        if me.right == self.id:
            actions += self._become_alone()
        elif old_me is None or me.right != old_me.right:
            actions.append(self._catchup_to_right(joining=me.right in self._adding))
        elif old is None or new.version > old.version:
            actions.append(self._send(Activity()))  # view notice
        newly_dead = old is not None and any(p in old.live and p not in new.live for p in self._acks_out)
        if newly_dead and not self._buffer:
            # Acknowledgements waiting for a member that just died are prompt now (see _handle_activity).
            actions.append(StartFlushTimer(acks_only=True, prompt=True))
        self._added &= new.known
        for newcomer in [n for n in self._adding if n in new.known]:
            del self._adding[newcomer]
            self._added.add(newcomer)
            actions.append(AddOnRightReply(newcomer, self._group))
        return actions

    def _become_alone(self) -> list[Action]:
        assert self.publishers is not None
        own = self._state(self.id)
        self._buffer = []
        self._buffer_bytes = 0
        self._acks_out.clear()
        own.last_pub = own.last_ack = self.next_seq - 1
        own.pending = PendingRun(self.next_seq)
        self._caught_up = True
        for state in self.publishers.values():
            state.pending = PendingRun(state.last_pub + 1)
            state.last_ack = state.last_pub
        return [Confirmed(own.last_pub)] if own.last_pub else []

    def _start_state(self, publishers: dict[str, _Publisher], view: View) -> list[Action]:
        self.publishers = publishers
        own = self._state(self.id)
        self.next_seq = own.last_pub + 1
        self._reported = view.known
        start_after = tuple(sorted((p, s.last_pub) for p, s in publishers.items()))
        return [Joined(tuple(sorted(view.known)), view.version, start_after)]

    # --------------------------------------------------------------- messages

    def _handle_message(self, message: RingMessage) -> list[Action]:
        view = self.view
        assert view is not None
        body = message.body
        if self.publishers is None:
            if isinstance(body, Catchup) and body.joining and message.sender == self._adder:
                return self._adopt_catchup(body, message.sender)
            # Someone inserted between our adder and us may reach us first:
            # what it sends is only meaningful on top of our starting state.
            self._early.append(message)
            return []
        me = view.live.get(self.id)
        if me is None or message.sender != me.left:
            return []  # Hard case 3: not from my left.
        if isinstance(body, Catchup):
            self._lost_from_left = False
            return self._handle_catchup(body)
        if not body.entries or self._lost_from_left:
            return []
        if self._has_gap(body.entries):
            self._lost_from_left = True  # hard case 7: its Catchup follows
            return []
        return self._handle_activity(body.entries)

    def _has_gap(self, entries: list[PublisherActivity]) -> bool:
        """Does an entry start past what this member holds of its publisher (frames lost on the link)?
        Entries are followed in order: the link layer merges consecutive Activities, so one message
        may carry several entries of one publisher, each continuing the last."""
        assert self.publishers is not None
        expected: dict[str, int] = {}  # publisher -> the first sequence number the next entry may start past
        for entry in entries:
            if not entry.pubs:
                continue
            publisher = entry.publisher
            last = entry.first_seq + len(entry.pubs) - 1
            if publisher not in expected:
                state = self.publishers.get(publisher)
                if self._owns(publisher):
                    pending = state.pending if state is not None else None
                    expected[publisher] = pending.first_seq if pending is not None and len(pending) else last + 1
                else:
                    expected[publisher] = (state.last_pub if state is not None else 0) + 1
            if last >= expected[publisher] and entry.first_seq > expected[publisher]:
                return True
            expected[publisher] = max(expected[publisher], last + 1)
        return False

    def _adopt_catchup(self, catchup: Catchup, sender: str) -> list[Action]:
        view = self.view
        assert view is not None
        publishers = {
            s.publisher: _Publisher(s.last_pub, s.last_ack, _run(s.pending_first_seq, s.pending))
            for s in catchup.publishers
            if s.publisher in view.known
        }
        actions = self._start_state(publishers, view)
        me = view.live[self.id]
        self._caught_up = me.left == sender
        if me.right != self.id:
            # The right neighbour may have dropped what the adder sent it
            # before we were inserted: our state covers all of it.
            actions.append(self._catchup_to_right(joining=False))
        early, self._early = self._early, []
        for message in early:
            actions += self._handle_message(message)
        return actions + self._next_write()

    def _handle_catchup(self, catchup: Catchup) -> list[Action]:
        assert self.publishers is not None and self.view is not None
        left_states = {s.publisher: s for s in catchup.publishers}
        entries: list[PublisherActivity] = []
        for publisher in sorted(set(self.publishers) | set(left_states)):
            if publisher not in self.view.known:
                continue
            left = left_states.get(publisher)
            if self._owns(publisher):
                state = self._state(publisher)
                state.last_ack = left.last_ack if left else 0
                if state.last_ack > state.last_pub:
                    raise ProtocolViolation(f"left acknowledged {publisher} past what its owner knows")
                if left and left.pending:
                    entries.append(PublisherActivity(publisher, left.pending_first_seq, left.pending))
            elif left is not None:
                acked = left.pending_first_seq - 1 if left.pending else left.last_pub
                entries.append(PublisherActivity(publisher, left.pending_first_seq, left.pending, acked))
        self._caught_up = True
        actions = self._handle_activity(entries)
        # Acknowledgements in flight may have died with the members between
        # us and our left (hard case 6): re-issue what we owe but have not
        # seen come back. Others pass it on; it dies when it returns to us.
        reissued = [
            PublisherActivity(p, state.acked_through() + 1, [], state.acked_through())
            for p, state in sorted(self.publishers.items())
            if self._owns(p) and state.acked_through() > state.last_ack
        ]
        if reissued and not self._alone():
            actions.append(self._send(Activity(reissued)))
        return actions

    def _handle_activity(self, entries: list[PublisherActivity]) -> list[Action]:
        assert self.publishers is not None and self.view is not None
        known = self.view.known
        out: list[PublisherActivity] = []
        actions: list[Action] = []
        acks_were_waiting = bool(self._acks_out)  # then a flush is already due (see below)
        prompt_was_due = acks_were_waiting and self._acks_for_the_dead()
        for entry in entries:
            publisher = entry.publisher
            if publisher not in known:
                continue  # erased: nothing of it is in flight any more
            state = self._state(publisher)
            pubs = entry.pubs
            last = entry.first_seq + len(pubs) - 1
            if self._owns(publisher):
                if pubs and last > state.last_pub:
                    raise ProtocolViolation(f"{publisher}#{last} reached its owner, which knows only {state.last_pub}")
                returned = 0
                pending = state.pending
                if pubs and len(pending) and last >= pending.first_seq:
                    if entry.first_seq > pending.first_seq:
                        raise ProtocolViolation(f"{publisher}#{pending.first_seq} skipped on its way round")
                    returned = min(last, pending.end_seq - 1)
                    pending.drop_through(returned)
                if entry.acked_through > state.last_ack:
                    state.last_ack = entry.acked_through  # retired: it went all the way round
                if returned:
                    self._defer_ack(publisher, returned)
                    if publisher == self.id:
                        actions.append(Confirmed(returned))
                continue
            first_new = state.last_pub + 1
            fresh: list[bytes] = []
            if pubs and last >= first_new:
                if entry.first_seq > first_new:
                    raise ProtocolViolation(f"hole: {publisher}#{first_new} missing before #{entry.first_seq}")
                fresh = pubs if entry.first_seq == first_new else pubs[first_new - entry.first_seq :]
                state.pending.append(first_new, fresh)
                state.last_pub = last
                actions.append(Deliver(publisher, first_new, fresh))
            ack = entry.acked_through
            if ack > state.last_ack:
                if ack > state.last_pub:
                    raise ProtocolViolation(f"{publisher} acknowledged through {ack} past #{state.last_pub}")
                state.last_ack = ack
                state.pending.drop_through(ack)
            # An acknowledgement is passed on even when it is not news here:
            # a re-issued one must reach its owner to be retired.
            if fresh:
                out.append(PublisherActivity(publisher, first_new, fresh, ack))
            elif ack:
                self._defer_ack(publisher, ack)
        if self._alone():
            self._acks_out.clear()
        elif out:
            actions.append(self._send(Activity(self._take_acks(out))))
        elif self._acks_out and not self._buffer:
            # A flush is due whenever acknowledgements wait: the buffer's (a non-empty buffer has one
            # armed), or this one. Whatever sends them, a flush or an Activity from here, takes them all.
            # Those of a dead member's publications are prompt: its erasure, which reports its death to
            # the application (a queue's promotion waits for it), waits for them to go round.
            prompt = self._acks_for_the_dead()
            if not acks_were_waiting or (prompt and not prompt_was_due):
                actions.append(StartFlushTimer(acks_only=True, prompt=prompt))
        return actions + self._next_write()

    def _acks_for_the_dead(self) -> bool:
        """Whether an acknowledgement waiting to go right is of a publisher no longer live."""
        live = self.view.live if self.view is not None else {}
        return any(publisher not in live for publisher in self._acks_out)

    def _defer_ack(self, publisher: str, through: int) -> None:
        if through > self._acks_out.get(publisher, 0):
            self._acks_out[publisher] = through

    def _take_acks(self, entries: list[PublisherActivity]) -> list[PublisherActivity]:
        """`entries` (going right) with every acknowledgement waiting: merged into a publisher's entry,
        or an entry of its own. A merged one never acknowledges past the entry's publications, which
        the receiver takes first."""
        waiting = self._acks_out
        if not waiting:
            return entries
        merged = []
        for entry in entries:
            ack = waiting.pop(entry.publisher, 0)
            if ack > entry.acked_through:
                entry = PublisherActivity(entry.publisher, entry.first_seq, entry.pubs, ack)
            merged.append(entry)
        merged += [PublisherActivity(p, through + 1, [], through) for p, through in waiting.items()]
        waiting.clear()
        return merged

    # ---------------------------------------------------------------- helpers

    def _owns(self, publisher: str) -> bool:
        assert self.view is not None
        if publisher == self.id:
            return True
        me = self.view.live.get(self.id)
        return me is not None and publisher in me.aliases

    def _state(self, publisher: str) -> _Publisher:
        assert self.publishers is not None
        state = self.publishers.get(publisher)
        if state is None:
            state = self.publishers[publisher] = _Publisher()
        return state

    def _alone(self) -> bool:
        assert self.view is not None
        me = self.view.live.get(self.id)
        return me is None or me.right == self.id

    def _leaving(self) -> bool:
        return any(intent.kind == "leave" for intent in self._intents)

    def _send(self, body: Activity | Catchup) -> SendRight:
        view = self.view
        assert view is not None
        right = view.live[self.id].right
        return SendRight(RingMessage(self.group_name, self.id, right, view.version, body), view.nodes[right])

    def _catchup_to_right(self, joining: bool) -> SendRight:
        assert self.publishers is not None
        states = [
            PublisherState(p, s.last_pub, s.last_ack, s.pending.first_seq, s.pending.bodies())
            for p, s in sorted(self.publishers.items())
        ]
        return self._send(Catchup(states, joining))

    def _leave_done(self, group: Group) -> list[Action]:
        actions: list[Action] = []
        if self.view is not None and self.publishers is not None and not self._alone():
            # Tell the ring: the right neighbour re-reads the table and the
            # notice travels round, so the left learns to send it a Catchup.
            right = self.view.live[self.id].right
            notice = RingMessage(self.group_name, self.id, right, group.version, Activity())
            actions.append(SendRight(notice, self.view.nodes[right]))
        return actions + self._stop("left")

    def _stop(self, reason: str, rejoin: bool = False) -> list[Action]:
        abandoned = next((intent for intent in self._intents if intent.kind == "abandon"), None)
        if abandoned is not None:
            reason, rejoin = abandoned.reason, True
        self.stopped = Stopped(reason, rejoin)
        self._intents = []
        return [self.stopped]

    def _expect_no_io(self) -> None:
        if self._awaiting is not None:
            raise ProtocolViolation(f"input while a group {self._awaiting} is outstanding")


def _run(first_seq: int, bodies: list[bytes]) -> PendingRun:
    run = PendingRun(first_seq)
    run.append(first_seq, list(bodies))
    return run
