"""One queue replica's decisions, as a pure state machine: master, mirror, promotion, recovery,
what a confirm waits for, and what a failing disk does.

What a confirm promises
-----------------------
A publisher's confirm for message m is sent only when all of these hold:
1. every live member of the queue's GM group delivered the report that enqueued m (the ring
   confirmed it), so every live mirror holds m;
2. for a persistent message of a durable queue: the master's log holds m on disk (a flush that
   began after m was appended completed), and so does the log of every *required* mirror, that is
   every mirror the record lists as synchronised plus every mirror that said it is synchronised and
   is not marked yet (a dead mirror stays required until the master struck it from the record);
3. the master has at least `ha-min-synchronised` synchronised mirrors alive (default 1 for a queue
   its policy mirrors on two or more nodes). Below that floor steps still complete (consumers are
   served) but confirms are held, with an event, until the floor is met again.
So every replica the record lists as master or synchronised mirror holds every confirmed persistent
message on disk, and with the floor met there are always two copies of a confirmed message.

What recovery promises
----------------------
A replica that starts (a node restart, a replica recreated) first *looks* for a serving master:
one whose depth report carries the record's `master_epoch`. If it hears one it becomes its mirror,
keeping its log only if that log is a prefix of the master's history (same epoch). If none serves
it *claims* (durability.py): it puts the position of its log's intact prefix in the record, flagged
if the log is damaged, and waits until every replica the record lists has claimed (or the recovery
wait ends). The claimant whose intact log goes furthest takes the queue by compare-and-set, raising
`master_epoch`; the others become its mirrors, catching up from their own logs where they are a
prefix of the winner's, starting over otherwise. A damaged log never beats an intact one that knows
more, and a winner with a damaged log rewrites what it salvaged into a fresh log. A confirmed
message is lost only if every replica the record listed lost it.

Every change of master is a compare-and-set on the record that raises `master_epoch` by one from the
epoch the replica saw: two replicas never master the same epoch, and a replica that cannot reach the
coordinator (a partition's minority) cannot become master.

The hard cases
--------------
1. A mirror's announcements (sync request, synchronised) go to the master member of the moment;
   a mirror that joined before its master, or whose master changed, repeats them when it first hears
   the new master, or the queue would run short of a mirror for good (a wiring mirror was never
   marked synchronised when it joined first).
2. A mirror whose disk fails leaves the synchronised set once (an event, not a loop), keeps mirroring
   in memory, waits for its disk (the shell retries with back-off) and, once it writes again,
   writes what it holds into a fresh log and is synchronised again. A master whose disk fails holds
   the confirms that wait for it, refuses persistent publishes with a clear status, and on recovery
   writes what it holds into its log before anything is confirmed.
3. A member recorded dead is struck from the record only if its node has no other live member in
   the group: a replica recreated on that node must not be struck for its predecessor's death.
4. A step completes (deliveries handed out, confirms sent) strictly in the order steps were decided,
   whoever asked for them and whether or not they are still waiting: a publisher that goes away
   never strands the deliveries its step decided.
5. A starting replica may hear reports before it decides whom to follow; it applies them to what it
   restored (a sync reconciles everything later), but writes nothing to its log until synchronised.
6. The eldest live synchronised mirror promotes itself when the master dies. Its node may be down but
   not yet recorded dead: every later death (while the master is gone and the record names no newer
   master) makes each mirror look again, or two live synchronised mirrors would wait for ever.
7. A promoted master inherits messages its predecessor may never have confirmed: one held back for a
   mirror whose disk had failed and that the record still listed (the predecessor could not reach the
   coordinator to strike it), say. Its publisher sends it again, and the answer, DUPLICATE, is a
   confirm: it waits for the new master's own log and for every required mirror's log to hold the new
   master's first broadcast (a listed mirror flushes when it first hears a new master, then says
   Persisted). A listed mirror whose disk failed says Desynchronised again to the new master, which
   strikes it, or the confirms would wait for that disk.
8. A promoted master may die before any report of its epoch reaches a mirror (a link cut, then its
   crash): the mirrors still follow the old epoch, and the record names a master none of them will
   hear. A mirror that sees the recorded master's node without a live member after one of its members
   died looks again, and the eldest live synchronised mirror takes over from the recorded epoch.
   Nothing of the dead master's epoch can be missing from it: whatever that master confirmed or
   delivered went round the ring, through this mirror, and so would have brought its epoch here. (Before,
   the queue waited until the dead master's node came back and recovered from its log.)
9. A listed synchronised node counts towards promotion only through the member that is its synchronised
   mirror. A replica restarted on that node may join before the old member's death is seen (the record
   still lists the node): it holds no claim to the queue and never promotes, so a mirror that deferred
   to it would wait for good. A mirror counts a member born since it joined only once it heard it say
   Synchronised, and a promotion lists such a node as a mirror but not as synchronised.
10. Record updates run concurrently, so they may land out of order: a mirror that said Desynchronised and
   then Synchronised (its disk failed and came back) may see the unmark of its first word land after the
   mark of its second. The master remembers each mirror's last word, and marks again a mirror whose last
   word was Synchronised when the record lists it unmarked.

Invariants (checked by tests/sim after every step)
--------------------------------------------------
- One master per epoch; a replica is master only of the epoch the record gave it.
- Steps complete in decision order; a confirm is never released for a step whose conditions above
  do not hold.
- A mirror says it is synchronised only at a depth report equal to its own, and, for a durable
  queue, only once its log holds everything it holds.

The shell contract
------------------
Each input method returns effects, to be carried out in list order; log effects (AppendToLog,
WriteLog, FlushLog, DiscardLog) in that order among themselves as well, each flush reported back
with `on_log_flushed` or `on_disk_failed`. `Broadcast.first_seq` is the GM sequence number the
member will give the first report: the member numbers its broadcasts 1, 2, ... in call order, and
every broadcast it makes goes through this core. No clock, socket, file or thread here: the time is
passed in (`now_ms`), and `next_wakeup_ms` says when to call `tick`.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.coordinator import queue_arguments
from services.coordinator.metadata import QueueRecord
from services.coordinator.policies import min_synchronised
from services.coordinator.stream_groups import is_stream_group
from services.queue.contents import QueueContents
from services.queue.durability import (
    Claim,
    Position,
    elect,
    election_due,
    keeps_log,
    log_changes,
    persistent_holdings,
)
from services.queue.master import (
    Delivery,
    Publish,
    PublishOutcome,
    QueueError,
    QueueLimits,
    QueueMaster,
    Settlement,
    Step,
)
from services.queue.message_table import MessageTable
from services.queue.mirror import QueueMirror
from services.queue.ops import (
    Deliver,
    Depth,
    Desynchronised,
    Discard,
    Enqueue,
    Message,
    MirrorSays,
    Noticed,
    Persisted,
    Report,
    Requeue,
    Settle,
    SyncBatch,
    Synchronised,
    SyncRequest,
    Transaction,
    Undecodable,
    unpacked,
)

MAX_EVENTS = 32
# Reports a mirror applies as they are (the bulk of them), and what mirrors say to the master.
_PLAIN_CHANGES: frozenset[type] = frozenset({Enqueue, Deliver, Settle, Requeue, Discard, Transaction})
_MIRROR_SAYS: frozenset[type] = frozenset({SyncRequest, Synchronised, Desynchronised, Persisted, Noticed})
# The publish window's least size, in messages (`may_publish`).
PUBLISH_WINDOW_MIN = 256
# While consumers are behind (ready messages wait), the window shrinks by their number, down to this.
PUBLISH_WINDOW_BEHIND = 64
# How often a replica that waited out the recovery wait looks at the election again.
RECOVERY_RECHECK_MS = 500


def node_of(member: str) -> str:
    """The node hosting a GM member (member ids are NODE.HEX)."""
    return member.rsplit(".", 1)[0]


# --------------------------------------------------------------------------- values


class Role(enum.Enum):
    JOINING = "joining"  # its GM member is joining the queue's group
    LOOKING = "looking for its master"  # joined; listening for a serving master's depth report
    RECOVERING = "recovering"  # no master serves: it claimed, and waits for the election
    MIRROR = "mirror"
    MASTER = "master"
    STOPPED = "stopped"


class LogState(enum.Enum):
    NONE = "no log"  # transient queue, or a mirror not synchronised yet
    WRITING = "writing"  # a mirror's holdings are being written; synchronised once flushed
    KEEPING = "keeping"  # appending every persistent change
    FAILED = "failed"  # the disk failed; the shell retries it


@dataclass(frozen=True, slots=True)
class QueueEvent:
    """One noteworthy thing that happened to a replica of the queue."""

    time_ms: int
    kind: str
    node: str
    detail: str


@dataclass(frozen=True, slots=True)
class LogRecovery:
    """What a durable replica's log held at start: its messages (salvage included), the claim it
    makes (its intact prefix's position, damage), and a description of each damaged region."""

    messages: tuple[Message, ...] = ()
    claim: Claim = field(default_factory=Claim)
    damage: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicaTimers:
    """The core's timers, in milliseconds."""

    depth_report_interval_ms: int = 1000
    look_for_master_ms: int = 2500
    recovery_wait_ms: int = 30_000


# --------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Broadcast `reports` on the queue's group; the member numbers them from `first_seq`.
    With `confirmed`, call `on_ring_confirmed` once every live member delivered them."""

    reports: tuple[Report | MirrorSays, ...]
    first_seq: int
    confirmed: bool


@dataclass(frozen=True, slots=True)
class AppendToLog:
    """Append to this replica's log: `enqueued` messages, then removals of `removed` ids (ids the
    log does not hold are ignored), then the mark `position` (if any)."""

    enqueued: tuple[Message, ...]
    removed: tuple[int, ...]
    position: Position | None


@dataclass(frozen=True, slots=True)
class WriteLog:
    """Make this replica's log hold exactly `messages` (persistent, id order) and mark `position`:
    by appending the difference to the log there is, or (`fresh`, or if the difference cannot be
    appended in id order) by starting a new one."""

    messages: tuple[Message, ...]
    position: Position
    fresh: bool


@dataclass(frozen=True, slots=True)
class FlushLog:
    """Make everything appended so far durable, then call `on_log_flushed(flush_id)`
    (or `on_disk_failed`)."""

    flush_id: int


@dataclass(frozen=True, slots=True)
class DiscardLog:
    """Close and delete this replica's log: it starts over."""


@dataclass(frozen=True, slots=True)
class WatchDisk:
    """The disk failed: try writing a fresh log with back-off until it works, then call `on_disk_writable`."""


@dataclass(frozen=True, slots=True)
class UpdateRecord:
    """Compare-and-set the queue's record: `change` maps the current record to the new one (None:
    leave it); retry on a conflict; hand the record as it ends up to `on_record`."""

    change: Callable[[QueueRecord], QueueRecord | None]
    purpose: str


@dataclass(frozen=True, slots=True)
class DeleteRecord:
    """Delete the queue's record if `still` holds for it as it is now (compare-and-set on its version;
    re-read and asked again on a conflict); every replica then stops as for any deleted queue."""

    still: Callable[[QueueRecord], bool]
    purpose: str


@dataclass(frozen=True, slots=True)
class CompleteStep:
    """Step `step_id` (decided at `decided_ms`) is done: hand out its deliveries, publish its dead
    letters; with `confirmed`, answer its publishes now, else they wait for a ReleaseConfirms."""

    step_id: int
    step: Step
    decided_ms: int
    confirmed: bool


@dataclass(frozen=True, slots=True)
class ReleaseConfirms:
    """Answer the publishes of these completed steps (the floor is met again)."""

    step_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AbandonSteps:
    """These steps will never complete here (this replica stopped being master): fail their callers."""

    step_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class EndConsumers:
    """This replica stopped being master: end every consumer's stream (they resume elsewhere)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Noted:
    """An event worth the node's log."""

    event: QueueEvent


@dataclass(frozen=True, slots=True)
class Stop:
    """This replica is done (its GM member stopped, or it lost the queue): leave the group."""

    reason: str


Effect = (
    Broadcast
    | AppendToLog
    | WriteLog
    | FlushLog
    | DiscardLog
    | WatchDisk
    | UpdateRecord
    | DeleteRecord
    | CompleteStep
    | ReleaseConfirms
    | AbandonSteps
    | EndConsumers
    | Noted
    | Stop
)


def describe(effect: Effect) -> str:
    """One line for a debug log or a simulation trace."""
    if isinstance(effect, Broadcast):
        kinds = ", ".join(type(report).__name__ for report in effect.reports[:8])
        more = f" and {len(effect.reports) - 8} more" if len(effect.reports) > 8 else ""
        return f"Broadcast #{effect.first_seq}: {kinds}{more}"
    if isinstance(effect, CompleteStep):
        step = effect.step
        return f"CompleteStep {effect.step_id}: {len(step.deliveries)} deliveries, confirmed={effect.confirmed}"
    if isinstance(effect, UpdateRecord | DeleteRecord):
        return f"{type(effect).__name__}: {effect.purpose}"
    if isinstance(effect, AppendToLog):
        return f"AppendToLog: +{len(effect.enqueued)} -{len(effect.removed)} mark={effect.position}"
    if isinstance(effect, WriteLog):
        return f"WriteLog: {len(effect.messages)} messages at {effect.position}, fresh={effect.fresh}"
    return repr(effect)[:200]


@dataclass(slots=True)
class _Pending:
    """A decided step, waiting to complete."""

    step_id: int
    step: Step
    last_seq: int  # its last report's GM sequence number (0: nothing broadcast)
    persistent_seq: int  # its last persistent enqueue's (0: none): what mirrors' disks must hold
    flush_id: int  # the flush its persistent enqueues wait for (0: none)
    publishes: bool
    decided_ms: int
    messages: int  # how many messages it publishes


@dataclass
class _MasterState:
    """What only a master keeps."""

    core: QueueMaster
    pending: deque[_Pending] = field(default_factory=deque)
    ring_confirmed_through: int = 0
    persisted_through: dict[str, int] = field(default_factory=dict)  # node -> its log holds my reports to here
    # Mirrors that said they are synchronised and are not marked in the record yet: node -> the
    # report their disk must hold first (the last persistent one decided when they said so).
    announced: dict[str, int] = field(default_factory=dict)
    marking: set[str] = field(default_factory=set)
    # Mirror members whose last word to this master was Synchronised (not Desynchronised): if the record
    # lists one's node unmarked while it lives (an unmark of its earlier word landed after the mark), it is
    # marked again. Members, not nodes: a replica restarted on the node has said nothing yet (hard case 9).
    said_synchronised: set[str] = field(default_factory=set)
    held_confirms: list[int] = field(default_factory=list)
    last_persistent_seq: int = 0
    # The GM sequence number the mark of this master's log names (its last report that changed the log): its
    # depth reports carry it, so that a mirror synchronised at one marks its equal log equally.
    log_mark_seq: int = 0
    syncing: set[str] = field(default_factory=set)  # targets with a sync batch in flight
    next_depth_ms: int = 0
    # The GM sequence number and value of the last depth report, and whether a member was born since: a
    # depth report that would repeat the last one to the same synchronised mirrors is not sent.
    last_depth_seq: int = 0
    last_depth: tuple[int, int] | None = None
    depth_owed: bool = True
    below_floor: bool = False
    persistent_changes_seen: int = 0  # the contents' counter as of the last step carried out
    # A master that took over its predecessor's messages (promotion): its first broadcast's GM sequence
    # number and the flush of its own log that holds them. A confirm of a persistent duplicate (a message
    # decided before, perhaps by the predecessor, perhaps never confirmed) waits for that flush and for
    # every required mirror's log to hold this master's reports through that broadcast (hard case 7).
    inherited_seq: int = 0
    inherited_flush: int = 0
    publishing: int = 0  # the messages of the publish steps in `pending`: the publish window's fill


# --------------------------------------------------------------------------- the core


class ReplicaCore:
    """The replica of `record` on `node` (see the module docstring)."""

    def __init__(self, node: str, record: QueueRecord, now_ms: int, timers: ReplicaTimers | None = None) -> None:
        self.node = node
        self.record = record
        self.timers = timers or ReplicaTimers()
        self.role = Role.JOINING
        self.member = ""
        self.live: set[str] = set()
        self.next_seq = 1  # the GM sequence number of this member's next broadcast
        self.epoch = record.master_epoch  # the epoch of the master this replica serves or follows
        self.limits = self._limits(record)
        self.master: _MasterState | None = None
        self.mirror: QueueMirror | None = None
        self.master_member = ""  # the member whose reports a mirror applies
        self.applied_seq = 0
        # The last of the master's reports that added or removed a persistent message here: a mirror's
        # log mark, so that it equals the master's for equal logs (durability.py compares marks).
        self._log_change_seq = 0
        self.events: deque[QueueEvent] = deque(maxlen=MAX_EVENTS)
        self.unavailable = ""  # why the queue cannot be served, when it cannot
        # The log (durable queues).
        self.log = LogState.NONE
        self.log_claim = Claim()
        self.log_damaged = False
        self.restored: tuple[Message, ...] = ()
        self.next_flush_id = 1
        self.flushed_through = 0
        # A mirror's flush -> the master member whose reports it covers, and the last of them: a flush
        # issued under one master and done under the next says nothing of the new one's numbering.
        self._flush_seqs: dict[int, tuple[str, int]] = {}
        self._synchronised_flush = 0  # a mirror says it is synchronised once this flush is done
        self._said_persisted = ("", 0)
        self._persisted_owed = False  # a new master heard: flush, then say how far this log holds its reports
        self._notices: list[tuple[str, str]] = []  # (kind, detail) for the master, once this mirror hears it
        # Looking and recovering.
        self.look_until_ms = 0
        self.recovery_until_ms = 0
        self.claimed = False
        self.expected_winner: tuple[str, Claim] | None = None
        self.recovery_recheck_ms = 0
        self._taking_over = False
        self._take_from_epoch = 0  # the record's epoch when this replica tried to take the queue
        self._promoting_from: int | None = None  # the record's epoch this mirror asked to take over from
        self._dead_nodes: set[str] = set()  # nodes this replica saw a member of die
        # Members born since this replica joined that it has not heard say Synchronised: a restarted
        # replica on a node the record lists as synchronised is not that node's synchronised mirror.
        self._unproven: set[str] = set()
        self._keep_existing_log = False  # a mirror that kept its log appends to it once synchronised
        self._next_step_id = 1
        self._started_ms = now_ms

    # ------------------------------------------------------------------- views

    @property
    def durable(self) -> bool:
        return self.record.durable

    @property
    def replicates_messages(self) -> bool:
        """False for replication "wiring": mirrors hold no messages; only depth reports travel."""
        return self.record.replication != "wiring"

    @property
    def is_master(self) -> bool:
        return self.role is Role.MASTER

    def live_nodes(self) -> set[str]:
        return {node_of(member) for member in self.live}

    def synchronised_live(self) -> list[str]:
        """The mirrors the record lists as synchronised that have a live member now."""
        live = self.live_nodes()
        return [node for node in self.record.synchronised_mirrors if node in live and node != self.node]

    def floor(self) -> int:
        return min_synchronised(self.record.policy_definition)

    def status(self) -> str:
        """What users see: the role, and what holds the queue up, if anything."""
        if self.unavailable:
            return f"unavailable: {self.unavailable}"
        if self.role is Role.MASTER:
            assert self.master is not None
            notes = []
            if self.log is LogState.FAILED:
                notes.append("its disk failed: persistent messages are refused until it writes again")
            if self.master.below_floor:
                notes.append(
                    f"below ha-min-synchronised ({len(self.synchronised_live())} of {self.floor()} "
                    "synchronised mirrors): confirms are held"
                )
            if not self.replicates_messages:
                notes.append("replication wiring: messages are not mirrored")
            return "running" + (f" ({'; '.join(notes)})" if notes else "")
        if self.role is Role.MIRROR:
            assert self.mirror is not None
            if self.log is LogState.FAILED:
                return "mirror (its disk failed: not synchronised until it writes again)"
            return "mirror (synchronised)" if self.mirror.synchronised else "mirror (not synchronised)"
        if self.role is Role.RECOVERING:
            waiting = self._claims_missing()
            where = f"this log is at {self.log_claim.encode()}"
            if self.expected_winner is not None:
                return f"recovering: {self.expected_winner[0]} knows most and recovers the queue ({where})"
            if waiting:
                return f"recovering: waiting for {', '.join(waiting)} to report their logs ({where})"
            return f"recovering ({where})"
        return str(self.role.value)

    def next_wakeup_ms(self) -> int | None:
        """When `tick` has something to do next."""
        times: list[int] = []
        if self.role is Role.MASTER:
            assert self.master is not None
            if not self._depth_known_to_all():
                times.append(self.master.next_depth_ms)
            expiry = self.master.core.next_expiry_ms()
            if expiry is not None:
                times.append(expiry)
        elif self.role is Role.LOOKING:
            times.append(self.look_until_ms)
        elif self.role is Role.RECOVERING and not self._taking_over:
            times.append(max(self.recovery_until_ms, self.recovery_recheck_ms))
        return min(times) if times else None

    # ------------------------------------------------------------------- start

    def start(self, recovery: LogRecovery | None) -> list[Effect]:
        """The replica's log as recovered (None: a transient queue, or no log); the shell joins the group next."""
        effects: list[Effect] = []
        if recovery is not None:
            for message in recovery.messages:
                # It may have been delivered before the restart: it comes back flagged redelivered.
                message.delivery_count = max(message.delivery_count, 1)
            self.restored = recovery.messages
            self.log_claim = recovery.claim
            self.log_damaged = recovery.claim.damaged
            self.log = LogState.KEEPING
            for damage in recovery.damage:
                effects += self._event(self._started_ms, "log_damaged", f"this node's log is damaged: {damage}")
        return effects

    def on_joined(self, member: str, members: Sequence[str], now_ms: int) -> list[Effect]:
        self.member = member
        self.live = set(members)
        if self.role is not Role.JOINING:
            return []
        record = self.record
        fresh = record.master == self.node and record.master_epoch == 0 and not self.restored
        if fresh and self.log_claim.position == Position():
            self.role = Role.RECOVERING  # nobody ever served it: claim it straight away
            self._taking_over = True
            self._take_from_epoch = 0
            return [UpdateRecord(self._first_claim, "claim a new queue")]
        self.role = Role.LOOKING
        self.look_until_ms = now_ms + self.timers.look_for_master_ms
        return []

    def _first_claim(self, current: QueueRecord) -> QueueRecord | None:
        if current.master != self.node or current.master_epoch != 0:
            return None
        return replace(current, master_epoch=1, recovery_positions={})

    # ------------------------------------------------------------------- the group

    def on_members_changed(self, births: Sequence[str], deaths: Sequence[str], now_ms: int) -> list[Effect]:
        self.live |= set(births)
        self.live -= set(deaths)
        self._dead_nodes |= {node_of(dead) for dead in deaths}
        self._unproven = (self._unproven | set(births)) & self.live
        effects: list[Effect] = []
        if self.role is Role.MASTER:
            assert self.master is not None
            if births:
                self.master.next_depth_ms = now_ms  # a newcomer learns who serves at once
                self.master.depth_owed = True
            effects += self._strike_dead_mirrors(deaths)
            effects += self._check_floor(now_ms)
            effects += self._complete_ready(now_ms)
            effects += self._depth_if_due(now_ms)
        elif self.role is Role.MIRROR:
            if deaths and self._master_gone(deaths):
                # Also when the master died earlier: the mirror that was to promote may have died since.
                effects += self._promote_if_eldest(now_ms)
        elif self.role is Role.RECOVERING:
            effects += self._recover_if_due(now_ms)
        return effects

    def _master_gone(self, deaths: Sequence[str]) -> bool:
        """The master this mirror follows is dead (in `deaths` or before them)."""
        if self.master_member:
            return self.master_member not in self.live
        return (
            any(node_of(dead) == self.record.master for dead in deaths) and self.record.master not in self.live_nodes()
        )

    def on_member_stopped(self, reason: str, now_ms: int) -> list[Effect]:
        """The GM member stopped (recorded dead, left, a protocol violation): this replica is done."""
        if self.role is Role.STOPPED:
            return []
        return self._stop(f"its group member stopped: {reason}", now_ms)

    def on_reports(
        self, publisher: str, first_seq: int, reports: Sequence[Report | MirrorSays | Undecodable], now_ms: int
    ) -> list[Effect]:
        """Reports delivered by the ring (another member's broadcasts, consecutive from `first_seq`).
        Only a master broadcasts Reports; mirrors broadcast what they say to it. A mirror that cannot read
        one of its master's reports (`Undecodable`) may lack a change: it starts over and re-syncs."""
        if publisher == self.member:
            return []  # our own, applied when decided
        if self.role is Role.MIRROR and publisher == self.master_member and self.replicates_messages:
            return self._mirror_applies_run(first_seq, reports, now_ms)
        effects: list[Effect] = []
        changed_log = False
        for index, report in enumerate(reports):
            if isinstance(report, SyncRequest | Synchronised | Desynchronised | Persisted | Noticed):
                if self.role is Role.MASTER:
                    effects += self._from_mirror(report, now_ms)
                elif isinstance(report, Synchronised):
                    self._unproven.discard(report.member)
                continue
            if isinstance(report, Undecodable) and (self.role is not Role.MIRROR or publisher != self.master_member):
                continue  # it might be a mirror's: only the master this mirror follows is heard unread
            if self.role in (Role.LOOKING, Role.RECOVERING) and not self._taking_over:
                effects += self._found_master(publisher, report, now_ms)
            if self.role is not Role.MIRROR:
                continue
            if publisher != self.master_member:
                if self.master_member in self.live:
                    continue  # not from the master this mirror follows (a deposed one stops by itself)
                effects += self._new_master_heard(publisher, self._epoch_of(report), now_ms)
            elif isinstance(report, Depth):
                self.epoch = max(self.epoch, report.epoch)
            changed, said = self._mirror_applies(first_seq + index, report, now_ms)
            changed_log |= changed
            effects += said
        if changed_log:
            effects += self._mirror_flush()
        elif self._persisted_owed and self.role is Role.MIRROR and self.log is LogState.KEEPING:
            effects += self._flush_for_master()
        self._persisted_owed = False
        return effects

    def _mirror_applies_run(
        self, first_seq: int, reports: Sequence[Report | MirrorSays | Undecodable], now_ms: int
    ) -> list[Effect]:
        """The common case, kept cheap (it runs for every message on every mirror): a run of reports from
        the master this mirror follows. Plain changes are applied to the contents directly, the persistent
        ones gathered for the log; anything else (a depth report, a sync batch) takes the full path."""
        mirror = self.mirror
        assert mirror is not None
        contents = mirror.contents
        logging = self.log in (LogState.WRITING, LogState.KEEPING)
        effects: list[Effect] = []
        enqueued: list[Message] = []
        removed: list[int] = []
        changed_log = False
        seq = first_seq - 1
        for report in reports:
            seq += 1
            kind = type(report)
            if kind in _PLAIN_CHANGES:
                # A transaction's changes are applied here together, within this one ring message.
                changes: tuple[Any, ...] = report.changes if kind is Transaction else (report,)  # type: ignore[union-attr]
                if not logging:
                    contents.apply_changes(changes)
                elif contents.apply_changes(changes, enqueued, removed):
                    self._log_change_seq = seq
                continue
            if kind in _MIRROR_SAYS:
                continue  # said to the master, not by it
            if enqueued or removed:  # what came before goes to the log before what this report causes
                effects.append(AppendToLog(tuple(enqueued), tuple(removed), None))
                enqueued, removed, changed_log = [], [], True
            if isinstance(report, Depth):
                self.epoch = max(self.epoch, report.epoch)
            changed, said = self._mirror_applies(seq, report, now_ms)  # type: ignore[arg-type]
            changed_log |= changed
            effects += said
            contents = mirror.contents  # an inconsistent mirror starts over with new contents
            logging = self.log in (LogState.WRITING, LogState.KEEPING)
        self.applied_seq = max(self.applied_seq, seq)
        if enqueued or removed:
            effects.append(AppendToLog(tuple(enqueued), tuple(removed), None))
            changed_log = True
        if changed_log and self.log in (LogState.WRITING, LogState.KEEPING):
            effects += self._mirror_flush()
        return effects

    def _epoch_of(self, report: Report | Undecodable) -> int:
        return report.epoch if isinstance(report, Depth) else max(self.epoch, self.record.master_epoch)

    def on_ring_confirmed(self, through_seq: int, now_ms: int) -> list[Effect]:
        """Every live member delivered this member's broadcasts up to `through_seq`."""
        if self.master is None:
            return []
        self.master.ring_confirmed_through = max(self.master.ring_confirmed_through, through_seq)
        return self._complete_ready(now_ms)

    # ------------------------------------------------------------------- the disk

    def on_log_flushed(self, flush_id: int, now_ms: int) -> list[Effect]:
        self.flushed_through = max(self.flushed_through, flush_id)
        effects: list[Effect] = []
        if self.role is Role.MASTER:
            return self._complete_ready(now_ms)
        if self.role is Role.MIRROR and self.mirror is not None and self.log is not LogState.FAILED:
            if self.log is LogState.WRITING and flush_id >= self._synchronised_flush:
                self.log = LogState.KEEPING
                if self.mirror.synchronised:
                    effects += self._say(Synchronised(self.member))
            master = self.master_member
            done = [seq for fid, (of, seq) in self._flush_seqs.items() if fid <= flush_id and of == master]
            covered = max(done, default=0)
            self._flush_seqs = {fid: entry for fid, entry in self._flush_seqs.items() if fid > flush_id}
            if self.log is LogState.KEEPING and covered and self.mirror.synchronised:
                effects += self._say_persisted(covered)
        return effects

    def on_disk_failed(self, reason: str, now_ms: int) -> list[Effect]:
        """A write or flush of this replica's log failed (disk full, read-only, failing fsync)."""
        if self.log is LogState.FAILED or self.role is Role.STOPPED:
            return []
        self.log = LogState.FAILED
        effects: list[Effect] = [WatchDisk()]
        if self.role is Role.MASTER:
            effects += self._event(
                now_ms,
                "disk_failed",
                f"the master's disk failed ({reason}): confirms of persistent messages wait, "
                "persistent publishes are refused",
            )
            return effects
        effects += self._event(
            now_ms,
            "disk_failed",
            f"this mirror's disk failed ({reason}): it leaves the synchronised mirrors until it writes again",
        )
        mirror = self.mirror
        if mirror is not None:
            was_synchronised, mirror.synchronised = mirror.synchronised, False
            self._synchronised_flush = 0
            if was_synchronised and self.role is Role.MIRROR:
                effects += self._say(Desynchronised(self.member))
        return effects

    def on_disk_writable(self, now_ms: int) -> list[Effect]:
        """The shell's retries found the disk writable again (a fresh log is open, empty)."""
        if self.log is not LogState.FAILED:
            return []
        effects: list[Effect] = []
        if self.role is Role.MASTER:
            assert self.master is not None
            self.log = LogState.KEEPING
            effects += self._event(now_ms, "disk_recovered", "the master's disk writes again: confirms resume")
            holdings = tuple(persistent_holdings(self.master.core.contents.messages))
            effects.append(WriteLog(holdings, Position(self.epoch, self.next_seq - 1), fresh=True))
            self.master.log_mark_seq = self.next_seq - 1
            effects += self._flush()
            return effects
        self.log = LogState.NONE
        effects += self._event(
            now_ms, "disk_recovered", "this mirror's disk writes again: it rejoins the synchronised mirrors"
        )
        if self.mirror is not None and self.mirror.synchronised and self.role is Role.MIRROR:
            effects += self._start_mirror_log(fresh=True)
        return effects

    # ------------------------------------------------------------------- the record

    def on_record(self, record: QueueRecord, now_ms: int) -> list[Effect]:
        """The coordinator's record as it is now (a Watch event or a compare-and-set's result)."""
        if record.version <= self.record.version:
            return []
        previous, self.record = self.record, record
        effects: list[Effect] = []
        if record.policy_definition != previous.policy_definition:
            self.limits = self._limits(record)
            if self.master is not None:
                effects += self._carry_out(self.master.core.set_limits(self.limits), now_ms)
        if self.role is Role.MASTER:
            if record.master != self.node or record.master_epoch != self.epoch:
                return effects + self._stop(
                    f"{record.master} is the queue's master now (epoch {record.master_epoch})", now_ms
                )
            assert self.master is not None
            self.master.marking.clear()  # what was being marked is marked now, or is tried again
            effects += self._marked(now_ms)
            effects += self._check_floor(now_ms)
            return effects + self._complete_ready(now_ms)
        if self.role is Role.RECOVERING:
            took = record.master == self.node and record.master_epoch > self._take_from_epoch
            if self._taking_over and took:
                return effects + self._become_master_from_log(now_ms)
            self._taking_over = False  # a newer record that does not make this replica master: decide again
            if record.master_epoch > previous.master_epoch and record.master != self.node:
                return effects + self._follow_new_master(now_ms)
            return effects + self._recover_if_due(now_ms)
        if self.role is Role.MIRROR:
            promoting_from = self._promoting_from
            if promoting_from is not None and record.master == self.node and record.master_epoch == promoting_from + 1:
                return effects + self._become_master_by_promotion(now_ms)
            if record.master_epoch > self.epoch and record.master != self.node:
                self._promoting_from = None
            effects += self._announce_if_unmarked(previous)
            if record.master_epoch > previous.master_epoch and self._recorded_master_died_unheard():
                effects += self._promote_if_eldest(now_ms)  # it died before this record came (hard case 8)
        return effects

    def _announce_if_unmarked(self, previous: QueueRecord) -> list[Effect]:
        """The record lists this mirror again without marking it (it was struck while cut off and
        placed back): a synchronised mirror says so again, or the master would never mark it."""
        mirror = self.mirror
        record, node = self.record, self.node
        listed_unmarked = node in record.mirrors and node not in record.synchronised_mirrors
        was_listed_unmarked = node in previous.mirrors and node not in previous.synchronised_mirrors
        if mirror is None or not listed_unmarked or was_listed_unmarked or not self.master_member:
            return []
        if mirror.synchronised and self.log in (LogState.NONE, LogState.KEEPING):
            return self._say(Synchronised(self.member))
        return []

    # ------------------------------------------------------------------- time

    def tick(self, now_ms: int) -> list[Effect]:
        effects: list[Effect] = []
        if self.role is Role.MASTER:
            assert self.master is not None
            if (expiry := self.master.core.next_expiry_ms()) is not None and expiry <= now_ms:
                effects += self._carry_out(self.master.core.expire(now_ms), now_ms)
            effects += self._depth_if_due(now_ms)
        elif self.role is Role.LOOKING and now_ms >= self.look_until_ms:
            effects += self._claim(now_ms)
        elif self.role is Role.RECOVERING:
            effects += self._recover_if_due(now_ms)
        return effects

    # ------------------------------------------------------------------- requests (master)

    def _require_master(self) -> QueueMaster:
        if self.master is None or self.role is not Role.MASTER:
            raise QueueError("UNAVAILABLE", f"queue {self.record.name!r} has no master on this node ({self.status()})")
        return self.master.core

    def _refuse_unless_two_copies(self) -> None:
        """A stream's group takes sends only with its mirror synchronised and alive (stream_groups.py)."""
        if is_stream_group(self.record.name) and not self.synchronised_live():
            raise QueueError(
                "UNAVAILABLE",
                f"stream group {self.record.name!r} has no synchronised mirror alive: it takes no sends, so the "
                "stream never holds a message in one copy only; its producer moves to the next group",
            )

    def _refuse_persistent_if_disk_failed(self, items: list[Publish]) -> None:
        if self.log is LogState.FAILED and any(item.persistent for item in items):
            raise QueueError(
                "RESOURCE_EXHAUSTED",
                f"queue {self.record.name!r}: the disk of its master on {self.node} failed; persistent messages are "
                "refused until it writes again",
            )

    def publish(self, items: list[Publish], now_ms: int) -> tuple[int, list[PublishOutcome], list[Effect]]:
        master = self._require_master()
        self._refuse_persistent_if_disk_failed(items)
        self._refuse_unless_two_copies()
        step, outcomes = master.publish(items, now_ms)
        state = self.master
        inherited = state is not None and state.inherited_seq > 0  # only a promoted master's duplicates wait
        vouches = inherited and any(
            o is PublishOutcome.DUPLICATE and i.persistent for i, o in zip(items, outcomes, strict=True)
        )
        step_id, effects = self._carry_out_step(
            step, now_ms, publishes=True, messages=len(items), vouches_for_earlier=vouches
        )
        return step_id, outcomes, effects

    def may_publish(self) -> bool:
        """Whether a publish request may be decided now; while not, the shell leaves it unread (gRPC's flow
        control then holds its publisher back).

        The publish window: while every consumer of the queue is bounded by a prefetch, the messages of
        publish steps in flight (decided, not complete) stay under half the consumers' combined prefetch,
        and at least PUBLISH_WINDOW_MIN. A step completes in decision order, so an acknowledgement's step,
        and the deliveries it makes room for, waits behind every publish in flight: with more in flight
        than the consumers' credit covers, consumers wait on their acknowledgements' round trip while the
        queue grows, and every message waits longer for its delivery (issue 13, W2: 5 s of saturated
        publishing built 4,000 ready messages behind a consumer holding its full prefetch, p99 640 ms; with
        this window none built up, p99 80-87 ms in three runs; at 70 % of the prefetch the backlog came
        back in one run of three, p99 427 ms). Without consumers, or with one that takes without limit,
        there is no window: nothing waits on the round trip.

        While consumers are behind, the window shrinks by the ready messages, to PUBLISH_WINDOW_BEHIND at
        least (about one publish request in flight). Ready messages with prefetch-bound consumers mean every
        consumer that may take them (the active one, with single active consumer) holds its full prefetch:
        each acknowledgement then waits behind the publishes in flight, and a backlog that a short stall of
        the consumer built drained slowly at full publishing (issue 13, W2, 24 runs each: p99 median 81 ms,
        8 runs over 100 ms and up to 489 ms; with the shrinking window median 54 ms, at most 98 ms).

        Not a limit on the queue: a backlog still grows while consumers are slower than publishers, and
        publishers go on, slower (W1 with a stalled consumer attached: 54,000 to 56,000 confirmed msgs/s
        with the full window, 40,000 with this one)."""
        state = self.master
        if state is None or self.role is not Role.MASTER:
            return True  # publish() answers
        prefetch = state.core.combined_prefetch()
        if prefetch is None:
            return True
        window = max(PUBLISH_WINDOW_MIN, prefetch // 2) - len(state.core.contents)
        return state.publishing < max(PUBLISH_WINDOW_BEHIND, window)

    def commit(
        self, consumer: str, settlements: list[Settlement], items: list[Publish], now_ms: int
    ) -> tuple[int, list[PublishOutcome], list[Effect]]:
        """A transaction (services/queue/master.py `commit`): one Transaction report, so every replica
        applies all of it or none, even if this master dies while broadcasting it; answered, like a
        publish, once what a confirm promises holds for all of it."""
        master = self._require_master()
        self._refuse_persistent_if_disk_failed(items)
        if items:
            self._refuse_unless_two_copies()
        step, outcomes = master.commit(consumer, settlements, items, now_ms)
        step_id, effects = self._carry_out_step(step, now_ms, publishes=True, messages=len(items))
        return step_id, outcomes, effects

    def consume(self, tag: str, prefetch: int, priority: int, now_ms: int) -> list[Effect]:
        return self._carry_out(self._require_master().consume(tag, prefetch, priority), now_ms)

    def cancel(self, tag: str, now_ms: int) -> list[Effect]:
        master = self._require_master()
        effects = self._carry_out(master.cancel(tag), now_ms)
        if self.record.auto_delete and not master.consumer_tags:
            effects += self._delete_auto_deleted(now_ms)
        return effects

    def _delete_auto_deleted(self, now_ms: int) -> list[Effect]:
        """An auto-delete queue whose last consumer went is deleted (RabbitMQ's rule: it had one, since
        only a cancel gets here), unless a new master took it meanwhile."""
        epoch = self.record.master_epoch

        def still(current: QueueRecord) -> bool:
            return current.master_epoch == epoch and current.auto_delete

        return [
            *self._event(now_ms, "deleted", "auto-delete queue: its last consumer went"),
            DeleteRecord(still, "delete the auto-delete queue: its last consumer went"),
        ]

    def settle(
        self, tag: str, settlements: list[Settlement], now_ms: int
    ) -> tuple[int, QueueError | None, list[Effect]]:
        step, error = self._require_master().settle(tag, settlements)
        step_id, effects = self._carry_out_step(step, now_ms, publishes=False)
        return step_id, error, effects

    def get(self, no_ack: bool, now_ms: int) -> tuple[int, Delivery | None, list[Effect]]:
        step, delivery = self._require_master().get(no_ack)
        step_id, effects = self._carry_out_step(step, now_ms, publishes=False)
        return step_id, delivery, effects

    def purge(self, now_ms: int) -> tuple[int, int, list[Effect]]:
        step, count = self._require_master().purge()
        step_id, effects = self._carry_out_step(step, now_ms, publishes=False)
        return step_id, count, effects

    def sync_unsynchronised(self, now_ms: int) -> list[Effect]:
        """ringqctl sync_queue: send every unsynchronised mirror what it lacks, batch by batch."""
        master = self._require_master()
        if not self.replicates_messages:
            return []
        effects: list[Effect] = []
        synchronised = set(self.record.synchronised_mirrors)
        for member in sorted(self.live):
            node = node_of(member)
            if node in self.record.mirrors and node not in synchronised and member not in master.syncing:
                master.start_sync(member, 0)
                effects += self._next_sync_batch(member, now_ms)
        return effects

    def cancel_syncs(self) -> None:
        master = self._require_master()
        for target in master.syncing:
            master.cancel_sync(target)

    # ------------------------------------------------------------------- master: steps

    def _carry_out(self, step: Step, now_ms: int) -> list[Effect]:
        return self._carry_out_step(step, now_ms, publishes=False)[1]

    def _carry_out_step(
        self, step: Step, now_ms: int, *, publishes: bool, messages: int = 0, vouches_for_earlier: bool = False
    ) -> tuple[int, list[Effect]]:
        """Queue the step's broadcast and log writes now, in decision order; it completes later.
        `vouches_for_earlier`: its confirms cover persistent messages decided before (duplicates), which
        this master may have inherited: they wait for the inherited barrier too (hard case 7)."""
        state = self.master
        assert state is not None
        step_id = self._next_step_id
        self._next_step_id += 1
        effects: list[Effect] = []
        last_seq = persistent_seq = 0
        _pack(step)
        if step.reports and self.replicates_messages:
            last = step.reports[-1]
            if self.durable and isinstance(last, Depth):  # a depth report ends the steps that send one
                changed = step.last_log_change >= 0
                mark = self.next_seq + step.last_log_change if changed else state.log_mark_seq
                step.reports[-1] = replace(last, log_mark_seq=mark)
            effects.append(Broadcast(tuple(step.reports), self.next_seq, confirmed=True))
            self.next_seq += len(step.reports)
            last_seq = self.next_seq - 1
        flush_id = 0
        contents = state.core.contents
        if self.durable and contents.persistent_changes != state.persistent_changes_seen:
            # Every change of the master's contents comes through here, step by step: only a step that
            # added or removed a persistent message has anything for the log (one pass over its reports).
            state.persistent_changes_seen = contents.persistent_changes
            first = last_seq - len(step.reports) + 1
            enqueued: list[Message] = []
            removed: list[int] = []
            for index, report in enumerate(step.reports):
                for change in unpacked(report):
                    if isinstance(change, Enqueue):
                        if change.message.persistent:
                            enqueued.append(change.message)
                            persistent_seq = first + index if last_seq else 0
                    elif isinstance(change, Settle | Discard):
                        removed.extend(change.ids)
            if enqueued:
                state.last_persistent_seq = max(state.last_persistent_seq, persistent_seq)
            if last_seq:
                state.log_mark_seq = first + step.last_log_change
            if self.log is LogState.KEEPING:
                position = Position(self.epoch, first + step.last_log_change) if last_seq else None
                effects.append(AppendToLog(tuple(enqueued), tuple(removed), position))
                effects += self._flush()
                flush_id = self.next_flush_id - 1 if enqueued else 0
            elif self.log is LogState.FAILED and enqueued:
                flush_id = self.next_flush_id  # the flush that follows the disk's recovery
        if vouches_for_earlier and state.inherited_seq:
            persistent_seq = max(persistent_seq, state.inherited_seq)
            flush_id = max(flush_id, state.inherited_flush)
        state.pending.append(_Pending(step_id, step, last_seq, persistent_seq, flush_id, publishes, now_ms, messages))
        state.publishing += messages
        return step_id, effects + self._complete_ready(now_ms)

    def _flush(self) -> list[Effect]:
        flush_id = self.next_flush_id
        self.next_flush_id += 1
        return [FlushLog(flush_id)]

    def _required_disks(self) -> set[str]:
        """The mirrors whose logs must hold a persistent message before it is confirmed."""
        if not (self.durable and self.replicates_messages) or self.master is None:
            return set()
        return (set(self.record.synchronised_mirrors) | set(self.master.announced)) - {self.node}

    def _step_ready(self, pending: _Pending) -> bool:
        state = self.master
        assert state is not None
        if pending.last_seq and state.ring_confirmed_through < pending.last_seq:
            return False
        if pending.flush_id and self.flushed_through < pending.flush_id:
            return False
        if pending.persistent_seq:
            through = state.persisted_through
            if any(through.get(node, 0) < pending.persistent_seq for node in self._required_disks()):
                return False
        return True

    def _complete_ready(self, now_ms: int) -> list[Effect]:
        """Complete every step at the head that may complete, in decision order."""
        state = self.master
        if state is None or self.role is not Role.MASTER:
            return []
        effects: list[Effect] = []
        while state.pending and self._step_ready(state.pending[0]):
            pending = state.pending.popleft()
            state.publishing -= pending.messages
            confirm = not (pending.publishes and (state.below_floor or state.held_confirms))
            if pending.publishes and not confirm:
                state.held_confirms.append(pending.step_id)
            step = pending.step
            effects.append(CompleteStep(pending.step_id, step, pending.decided_ms, confirm))
            effects += self._continue_syncs(step, now_ms)
        effects += self._marked(now_ms)
        return effects

    def _continue_syncs(self, step: Step, now_ms: int) -> list[Effect]:
        """A sync batch completed: send the target its next one."""
        state = self.master
        assert state is not None
        effects: list[Effect] = []
        for report in step.reports:
            if isinstance(report, SyncBatch) and report.target in state.syncing:
                state.syncing.discard(report.target)
                effects += self._next_sync_batch(report.target, now_ms)
        return effects

    def _next_sync_batch(self, target: str, now_ms: int) -> list[Effect]:
        state = self.master
        assert state is not None
        if target not in state.core.syncing or target in state.syncing:
            return []
        step = state.core.sync_next(target)
        if target in state.core.syncing:
            state.syncing.add(target)  # the next batch goes once this one completes
        return self._carry_out(step, now_ms)

    def _depth_if_due(self, now_ms: int) -> list[Effect]:
        state = self.master
        if state is None or now_ms < state.next_depth_ms or self._depth_known_to_all():
            return []
        state.next_depth_ms = now_ms + self.timers.depth_report_interval_ms
        if len(self.live) <= 1:
            return []  # alone: nobody to tell
        state.depth_owed = False
        state.last_depth = self._current_depth()
        state.last_depth_seq = self.next_seq
        if not self.replicates_messages:
            depth = Depth(0, self.epoch)  # wiring: only who serves, no messages to compare
            effects: list[Effect] = [Broadcast((depth,), self.next_seq, confirmed=False)]
            self.next_seq += 1
            return effects
        return self._carry_out(state.core.depth_report(), now_ms)

    def _current_depth(self) -> tuple[int, int]:
        assert self.master is not None
        depth = self.master.core.contents.depth if self.replicates_messages else 0
        return depth, self.epoch

    def _depth_known_to_all(self) -> bool:
        """True if a depth report now would tell nobody anything: the last thing this master broadcast was a
        depth report of the same depth and epoch, no member was born since, and every other live member's
        node is a synchronised mirror in the record (an unsynchronised one needs reports to say it is
        synchronised at; a newcomer needs one to find its master). An idle queue then sends nothing and sets
        no timer; its first change makes the next report due again."""
        state = self.master
        assert state is not None
        if state.depth_owed or state.last_depth_seq != self.next_seq - 1 or state.last_depth != self._current_depth():
            return False
        synchronised = set(self.record.synchronised_mirrors)
        return all(node_of(member) in synchronised for member in self.live if member != self.member)

    # ------------------------------------------------------------------- master: mirrors

    def _from_mirror(self, said: MirrorSays, now_ms: int) -> list[Effect]:
        state = self.master
        assert state is not None
        node = node_of(said.member)
        if isinstance(said, Persisted):
            if said.master != self.member:
                return []
            state.persisted_through[node] = max(state.persisted_through.get(node, 0), said.through_seq)
            return self._complete_ready(now_ms)
        if isinstance(said, Noticed):
            return self._event(now_ms, said.kind, said.detail, node=node)
        if isinstance(said, SyncRequest):
            if not self.replicates_messages:
                return []
            state.core.start_sync(said.member, said.below_id, said.have)
            state.syncing.discard(said.member)
            return self._next_sync_batch(said.member, now_ms)
        if isinstance(said, Desynchronised):
            state.announced.pop(node, None)
            state.said_synchronised.discard(said.member)
            effects = self._event(
                now_ms,
                "mirror_desynchronised",
                f"the mirror on {node} left the synchronised mirrors and re-syncs",
                node=node,
            )
            effects.append(UpdateRecord(_unmark(node), f"unmark {node}"))
            return effects + self._complete_ready(now_ms)
        # Synchronised: marked in the record once its disk (durable queues) holds what was decided before;
        # from now on its disk is required for confirms.
        state.said_synchronised.add(said.member)
        if node == self.node or node in self.record.synchronised_mirrors:
            return []
        state.announced.setdefault(node, state.last_persistent_seq if self.durable else 0)
        return self._marked(now_ms)

    def _marked(self, now_ms: int) -> list[Effect]:
        """Mark announced mirrors the record lists, once their disks hold what they must; forget those
        the record marks. (A mark the record was not ready for is tried again at its next change.)"""
        state = self.master
        if state is None:
            return []
        effects: list[Effect] = []
        record = self.record
        for member in state.said_synchronised & self.live:
            node = node_of(member)  # listed, unmarked: an unmark landed after the mark of its later Synchronised
            if node in record.mirrors and node not in record.synchronised_mirrors and node not in state.announced:
                state.announced[node] = state.last_persistent_seq if self.durable else 0
        for node, seq in list(state.announced.items()):
            if node in record.synchronised_mirrors:
                del state.announced[node]
                state.marking.discard(node)
            elif node in record.mirrors and node not in state.marking and state.persisted_through.get(node, 0) >= seq:
                state.marking.add(node)
                effects.append(UpdateRecord(_mark(node), f"mark {node} synchronised"))
        return effects

    def _strike_dead_mirrors(self, deaths: Sequence[str]) -> list[Effect]:
        state = self.master
        assert state is not None
        live = self.live_nodes()
        gone = {node_of(dead) for dead in deaths} - live - {self.node}
        state.said_synchronised -= set(deaths)
        for node in gone:
            state.persisted_through.pop(node, None)
            state.announced.pop(node, None)
            state.marking.discard(node)
        if not gone:
            return []

        def strike(record: QueueRecord) -> QueueRecord | None:
            if not gone & set(record.mirrors):
                return None
            mirrors = tuple(m for m in record.mirrors if m not in gone)
            synchronised = tuple(m for m in record.synchronised_mirrors if m not in gone)
            return replace(record, mirrors=mirrors, synchronised_mirrors=synchronised)

        return [UpdateRecord(strike, f"strike {', '.join(sorted(gone))} (members recorded dead)")]

    def _check_floor(self, now_ms: int) -> list[Effect]:
        state = self.master
        if state is None or self.role is not Role.MASTER:
            return []
        floor = self.floor()
        have = len(self.synchronised_live())
        effects: list[Effect] = []
        if have < floor and not state.below_floor:
            state.below_floor = True
            effects += self._event(
                now_ms,
                "below_min_synchronised",
                f"{have} synchronised mirror(s) alive, ha-min-synchronised is {floor}: confirms are held",
            )
        elif have >= floor and state.below_floor:
            state.below_floor = False
            effects += self._event(
                now_ms, "min_synchronised_restored", f"{have} synchronised mirror(s) alive: confirms resume"
            )
        if not state.below_floor and state.held_confirms:
            effects.append(ReleaseConfirms(tuple(state.held_confirms)))
            state.held_confirms = []
        return effects

    # ------------------------------------------------------------------- mirror

    def _found_master(self, publisher: str, report: Report | Undecodable, now_ms: int) -> list[Effect]:
        """A starting replica hears a serving master (only masters broadcast reports): it follows it,
        keeping its log only if that log is a prefix of the master's history."""
        epoch = self._epoch_of(report)
        own = self.log_claim
        usable = bool(self.restored) and not self.log_damaged and self.log is not LogState.FAILED
        winner = self.expected_winner
        if winner is not None and node_of(publisher) == winner[0]:
            keep = usable and keeps_log(own, winner[1])
        else:
            keep = usable and own.position.epoch == epoch
        return self._become_mirror(publisher, epoch, keep_log=keep, now_ms=now_ms)

    def _become_mirror(self, master_member: str, epoch: int, *, keep_log: bool, now_ms: int) -> list[Effect]:
        """Follow `master_member` (empty: whoever serves first) as a mirror."""
        effects: list[Effect] = []
        if self.claimed:
            self.claimed = False
            effects.append(UpdateRecord(_unclaim(self.node), "withdraw this replica's claim"))
        self.role = Role.MIRROR
        self.unavailable = ""
        self.expected_winner = None
        self.epoch = max(self.epoch, epoch)
        self.mirror = QueueMirror(self.record.name, self.member)
        keep_log = keep_log and self.replicates_messages
        if keep_log:
            self.mirror.contents.restore(self.restored)
        elif self.durable and self.log is not LogState.FAILED and (self.restored or self.log is LogState.KEEPING):
            effects.append(DiscardLog())
        if self.log is not LogState.FAILED:
            self.log = LogState.NONE  # written to again once synchronised
        self._keep_existing_log = keep_log
        self.restored = ()
        if not master_member:
            self.master_member = ""
            return effects
        return effects + self._new_master_heard(master_member, epoch, now_ms)

    def _new_master_heard(self, master_member: str, epoch: int, now_ms: int) -> list[Effect]:
        """Announce this mirror to a master it has not spoken to yet (hard case 1)."""
        self.master_member = master_member
        self.epoch = max(self.epoch, epoch)
        self.unavailable = ""
        self._said_persisted = ("", 0)
        self._log_change_seq = 0  # marks count in the new master's numbering
        mirror = self.mirror
        assert mirror is not None
        effects: list[Effect] = []
        for kind, detail in self._notices:
            effects += self._say(Noticed(self.member, kind, detail))
        self._notices = []
        if not self.replicates_messages:
            mirror.synchronised = True
            return effects + self._say(Synchronised(self.member))
        # Still synchronised with a new master only if the record says so: a promotion keeps the mirrors
        # the old master had marked (they hold what it held); a recovery from a log marks none.
        listed = self.node in self.record.synchronised_mirrors
        if mirror.synchronised and listed and self.log is not LogState.FAILED and self.log is not LogState.WRITING:
            # Its log holds what the predecessor decided; the new master needs to hear so before it confirms
            # a duplicate of any of it (hard case 7): a flush once the new master's first reports are applied.
            self._persisted_owed = self.log is LogState.KEEPING
            return effects + self._say(Synchronised(self.member))
        if listed and self.log is LogState.FAILED:
            # It left the synchronised mirrors when its disk failed, and the old master died before the record
            # said so: it says so again, or the new master would hold confirms for its disk (hard case 7).
            effects += self._say(Desynchronised(self.member))
        if not listed and (mirror.synchronised or mirror.contents.messages):
            # What it holds came from another master's history: checked, and caught up, by a full sync.
            mirror.contents.unverify()
            if self.log in (LogState.WRITING, LogState.KEEPING):
                self.log = LogState.NONE
                self._keep_existing_log = True
        mirror.synchronised = False
        automatic = self.record.policy_definition.get("ha-sync-mode", "manual") == "automatic"
        if automatic or mirror.sync_requested:
            effects += self._say(mirror.request_sync())
        return effects

    def _mirror_applies(self, seq: int, report: Report | Undecodable, now_ms: int) -> tuple[bool, list[Effect]]:
        """Apply one of the master's reports; (did the log change, effects)."""
        mirror = self.mirror
        assert mirror is not None
        if not self.replicates_messages:
            return False, []
        self.applied_seq = seq
        if isinstance(report, Undecodable):
            return False, self._mirror_starts_over(
                f"this mirror could not read a report of the master ({report.detail}) and re-syncs", now_ms
            )
        before = mirror.contents.persistent_changes
        said = mirror.apply(report)
        changed = False
        effects: list[Effect] = []
        if mirror.contents.persistent_changes != before and not isinstance(report, SyncBatch):
            self._log_change_seq = seq  # as the master marks it (a sync batch changes nothing there)
        if self.log in (LogState.WRITING, LogState.KEEPING) and mirror.contents.persistent_changes != before:
            enqueued, removed = log_changes((report,))
            effects.append(AppendToLog(tuple(enqueued), tuple(removed), None))
            changed = True
        for one in said:
            if isinstance(one, Desynchronised):
                effects += self._event(
                    now_ms, "mirror_desynchronised", "this mirror found it differs from the master and re-syncs"
                )
                effects += self._mirror_forgets_log()
                changed = False
                effects += self._say(one)
            elif isinstance(one, Synchronised):
                if not self.durable:
                    effects += self._say(one)
                elif self.log is not LogState.FAILED:  # else it says so once its disk writes again
                    # It holds what the master held at this depth report, whatever brought it here (a sync's
                    # batches change no mark): its log is marked as the master's is, or a log that holds
                    # everything would claim the last change this mirror saw (none, after a sync) and lose
                    # a recovery to a shorter log.
                    if isinstance(report, Depth):
                        self._log_change_seq = max(self._log_change_seq, report.log_mark_seq)
                    effects += self._start_mirror_log(fresh=not self._keep_existing_log)
                    changed = False
            else:
                effects += self._say(one)
        return changed, effects

    def _mirror_starts_over(self, detail: str, now_ms: int) -> list[Effect]:
        """This mirror may differ from the master in a way no depth shows (a report it could not read):
        it forgets its contents and its log, leaves the synchronised mirrors if it was one, and re-syncs
        from nothing."""
        mirror = self.mirror
        assert mirror is not None
        effects = self._event(now_ms, "mirror_desynchronised", detail) + self._mirror_forgets_log()
        for one in mirror.start_over():
            effects += self._say(one)
        return effects

    def _mirror_forgets_log(self) -> list[Effect]:
        """A mirror that starts over keeps no log of what it held: the next one is written fresh."""
        self._keep_existing_log = False
        if self.log not in (LogState.WRITING, LogState.KEEPING):
            return []
        self.log = LogState.NONE
        return [DiscardLog()]

    def _start_mirror_log(self, *, fresh: bool) -> list[Effect]:
        """A durable mirror became synchronised: its log is made to hold what it holds, then it says so."""
        mirror = self.mirror
        assert mirror is not None
        holdings = tuple(persistent_holdings(mirror.contents.messages))
        self.log = LogState.WRITING
        self._keep_existing_log = False
        effects: list[Effect] = [WriteLog(holdings, Position(self.epoch, self._log_change_seq), fresh)]
        effects += self._flush()
        self._synchronised_flush = self.next_flush_id - 1
        self._flush_seqs[self._synchronised_flush] = (self.master_member, self.applied_seq)
        return effects

    def _mirror_flush(self) -> list[Effect]:
        """After a batch of reports that changed the log: mark how far it goes, make it durable."""
        return [AppendToLog((), (), Position(self.epoch, self._log_change_seq)), *self._flush_for_master()]

    def _flush_for_master(self) -> list[Effect]:
        """A flush that, once done, tells the master this log holds its reports through the last applied."""
        effects = self._flush()
        self._flush_seqs[self.next_flush_id - 1] = (self.master_member, self.applied_seq)
        return effects

    def _say_persisted(self, through_seq: int) -> list[Effect]:
        said_master, said_through = self._said_persisted
        if said_master == self.master_member and through_seq <= said_through:
            return []
        self._said_persisted = (self.master_member, through_seq)
        return self._say(Persisted(self.member, self.master_member, through_seq))

    def _say(self, said: MirrorSays) -> list[Effect]:
        if not self.member or self.role is Role.STOPPED:
            return []
        effect = Broadcast((said,), self.next_seq, confirmed=False)
        self.next_seq += 1
        return [effect]

    # ------------------------------------------------------------------- promotion

    def _promote_if_eldest(self, now_ms: int) -> list[Effect]:
        record = self.record
        mirror = self.mirror
        assert mirror is not None
        if record.master_epoch != self.epoch and not self._recorded_master_died_unheard():
            return []  # a newer master is recorded already: this mirror follows it once it hears it
        live = self.live_nodes()
        # A listed synchronised node counts only through a member that is its synchronised mirror, not a
        # replica restarted there since (hard case 9): that one holds no claim to the queue.
        proven = {node_of(member) for member in self.live - self._unproven}
        candidates = [m for m in record.mirrors if m in record.synchronised_mirrors and m in proven]
        promote_unsynchronised = (
            record.policy_definition.get("ha-promote-on-failure", "when-synced") == "always"
            or not self.replicates_messages
        )
        if not candidates and promote_unsynchronised:
            candidates = [m for m in record.mirrors if m in live]
        if not candidates:
            self.unavailable = "no synchronised mirror to promote (ha-promote-on-failure is when-synced)"
            return self._event(now_ms, "unavailable", self.unavailable)
        if candidates[0] != self.node:
            return []
        if not mirror.synchronised and not promote_unsynchronised:
            self.unavailable = "this mirror is not synchronised (ha-promote-on-failure is when-synced)"
            return self._event(now_ms, "unavailable", self.unavailable)
        old_master, epoch, me = record.master, record.master_epoch, self.node

        def promote(current: QueueRecord) -> QueueRecord | None:
            if current.master != old_master or current.master_epoch != epoch:
                return None
            mirrors = tuple(m for m in current.mirrors if m != me and m in live)
            synchronised = tuple(m for m in current.synchronised_mirrors if m in mirrors and m in proven)
            return replace(
                current,
                master=me,
                master_epoch=epoch + 1,
                mirrors=mirrors,
                synchronised_mirrors=synchronised,
                recovery_positions={},
            )

        self._promoting_from = epoch
        return [UpdateRecord(promote, f"promote the mirror on {me} (the master on {old_master} died)")]

    def _recorded_master_died_unheard(self) -> bool:
        """The record names a newer master than the one this mirror follows, this mirror never heard it (no
        report of its epoch came), and its node has no live member since one of its members died: it died
        before its first report came round the ring (hard case 8)."""
        record = self.record
        return (
            record.master_epoch > self.epoch
            and record.master != self.node
            and record.master in self._dead_nodes
            and record.master not in self.live_nodes()
        )

    def _become_master_by_promotion(self, now_ms: int) -> list[Effect]:
        mirror = self.mirror
        assert mirror is not None
        self._promoting_from = None
        self.epoch = self.record.master_epoch
        synchronised = mirror.synchronised
        core, step = mirror.promote(self.limits, self.epoch)
        effects = self._become_master(core, now_ms)
        if self.durable:
            if self.log in (LogState.KEEPING, LogState.WRITING):
                effects.append(AppendToLog((), (), Position(self.epoch, self.next_seq - 1)))
                effects += self._flush()
            elif self.log is not LogState.FAILED:
                self.log = LogState.KEEPING
                effects.append(
                    WriteLog(
                        tuple(persistent_holdings(core.contents.messages)),
                        Position(self.epoch, self.next_seq - 1),
                        fresh=True,
                    )
                )
                effects += self._flush()
            state = self.master
            assert state is not None
            if self.log is not LogState.FAILED:
                state.log_mark_seq = self.next_seq - 1
            if self.replicates_messages:  # the barrier of hard case 7: this master's next broadcast, its flush
                state.inherited_seq = self.next_seq
                state.inherited_flush = self.next_flush_id - (self.log is not LogState.FAILED)
        detail = "promoted" if synchronised else "promoted unsynchronised: messages may be lost"
        if not self.replicates_messages:
            detail = "promoted empty (replication wiring): the old master's messages are lost"
        effects += self._event(
            now_ms, "promoted", f"the mirror on {self.node} became the master (epoch {self.epoch}): {detail}"
        )
        return effects + self._carry_out(step, now_ms)

    def _become_master(self, core: QueueMaster, now_ms: int) -> list[Effect]:
        """Serve the queue (the record names this node master of `self.epoch`); the caller broadcasts a depth report."""
        self.role = Role.MASTER
        self.unavailable = ""
        self.mirror = None
        self.expected_winner = None
        self.master_member = self.member
        self._notices = []
        state = self.master = _MasterState(core, next_depth_ms=now_ms + self.timers.depth_report_interval_ms)
        state.persistent_changes_seen = core.contents.persistent_changes
        state.below_floor = len(self.synchronised_live()) < self.floor()
        if not state.below_floor or self.record.master_epoch <= 1:
            return []  # a new queue's mirrors catch up within a depth report: nothing worth an event
        return self._event(
            now_ms,
            "below_min_synchronised",
            f"{len(self.synchronised_live())} synchronised mirror(s) alive, ha-min-synchronised is "
            f"{self.floor()}: confirms are held",
        )

    # ------------------------------------------------------------------- recovery

    def _claim(self, now_ms: int) -> list[Effect]:
        """No serving master was heard: say how far this replica's log goes, wait for the election."""
        self.role = Role.RECOVERING
        self.claimed = True
        self.recovery_until_ms = now_ms + self.timers.recovery_wait_ms
        claim, node, epoch = self.log_claim.encode(), self.node, self.record.master_epoch

        def register(current: QueueRecord) -> QueueRecord | None:
            if current.master_epoch != epoch or current.recovery_positions.get(node) == claim:
                return None  # somebody took the queue meanwhile: this replica follows it instead
            return replace(current, recovery_positions={**current.recovery_positions, node: claim})

        return [UpdateRecord(register, f"claim the queue: this log is at {claim}")]

    def _claims(self) -> dict[str, Claim]:
        return {node: Claim.decode(text) for node, text in self.record.recovery_positions.items()}

    def _claims_missing(self) -> list[str]:
        claims = self.record.recovery_positions
        return [n for n in (self.record.master, *self.record.synchronised_mirrors) if n and n not in claims]

    def _recover_if_due(self, now_ms: int) -> list[Effect]:
        if self._taking_over or self.role is not Role.RECOVERING or not self.claimed:
            return []
        record = self.record
        claims = self._claims()
        if self.node not in claims:
            return []  # our claim is not in the record yet
        waited = now_ms >= self.recovery_until_ms
        if waited:
            self.recovery_recheck_ms = now_ms + RECOVERY_RECHECK_MS
        live = self.live_nodes()
        if not election_due(claims, record.master, record.synchronised_mirrors, live, waited_enough=waited):
            return []
        promote_unsynchronised = record.policy_definition.get("ha-promote-on-failure") == "always"
        live = self.live_nodes()
        winner = elect(
            claims,
            record.master,
            record.synchronised_mirrors,
            record.mirrors,
            live,
            promote_unsynchronised=promote_unsynchronised,
        )
        if winner is None:
            self.unavailable = (
                "no replica the record lists as master or synchronised mirror has come back "
                "(ha-promote-on-failure is when-synced)"
            )
            return []
        self.unavailable = ""
        if winner != self.node:
            self.expected_winner = (winner, claims[winner])
            return []
        me, epoch = self.node, record.master_epoch
        transient = not self.durable or bool(record.exclusive_owner)  # exclusive queues never outlive their node
        if transient and epoch > 0:  # epoch 0: a new queue, never served yet
            return self._delete_transient(epoch, now_ms)

        def take(current: QueueRecord) -> QueueRecord | None:
            current_claims = {n: Claim.decode(t) for n, t in current.recovery_positions.items()}
            if current.master_epoch != epoch or me not in current_claims:
                return None
            if (
                elect(
                    current_claims,
                    current.master,
                    current.synchronised_mirrors,
                    current.mirrors,
                    live,
                    promote_unsynchronised=promote_unsynchronised,
                )
                != me
            ):
                return None
            newest = max((c.position.epoch for c in current_claims.values()), default=0)
            mirrors = tuple(dict.fromkeys(m for m in (current.master, *current.mirrors) if m and m != me))
            return replace(
                current,
                master=me,
                master_epoch=max(current.master_epoch, newest) + 1,
                mirrors=mirrors,
                synchronised_mirrors=(),
                recovery_positions={},
            )

        self._taking_over = True
        self._take_from_epoch = epoch
        return [UpdateRecord(take, f"recover the queue from this node's log ({self.log_claim.encode()})")]

    def _delete_transient(self, epoch: int, now_ms: int) -> list[Effect]:
        """A transient queue that no master serves and whose replicas all started again (none kept
        running with its messages, or it would have been promoted) is gone, as in RabbitMQ: the
        winner of the election deletes its record, guarded by the epoch it saw, instead of taking it."""
        me = self.node

        def still(current: QueueRecord) -> bool:
            return current.master_epoch == epoch and me in current.recovery_positions

        self._taking_over = True
        return [
            *self._event(now_ms, "deleted", "transient queue: every replica restarted and its messages are gone"),
            DeleteRecord(still, "delete the transient queue: no replica kept its messages"),
        ]

    def _become_master_from_log(self, now_ms: int) -> list[Effect]:
        self._taking_over = False
        self.claimed = False
        self.epoch = self.record.master_epoch
        contents = QueueContents()
        contents.restore(self.restored)
        self.restored = ()
        core = QueueMaster(self.record.name, contents, self.limits, self.epoch)
        effects = self._become_master(core, now_ms)
        if self.durable and self.log is not LogState.FAILED:
            position = Position(self.epoch, 0)
            if self.log_damaged or self.log is LogState.NONE:  # a damaged log is read-only; or there is none
                effects.append(WriteLog(tuple(persistent_holdings(contents.messages)), position, fresh=True))
                self.log_damaged = False
            else:
                effects.append(AppendToLog((), (), position))
            self.log = LogState.KEEPING
            effects += self._flush()
        if contents.messages or self.record.master_epoch > 1:
            effects += self._event(
                now_ms,
                "recovered",
                f"recovered from this node's log: {len(contents.messages)} messages "
                f"(the log was at {self.log_claim.encode()})",
            )
        return effects + self._carry_out(core.depth_report(), now_ms)

    def _follow_new_master(self, now_ms: int) -> list[Effect]:
        """Another replica took the queue: follow it (once it is heard), keeping this log only if it is
        a prefix of the winner's."""
        self.claimed = False  # the winner cleared every claim
        self._taking_over = False
        winner = self.expected_winner
        keep = winner is not None and winner[0] == self.record.master and keeps_log(self.log_claim, winner[1])
        keep = keep and bool(self.restored) and self.log is not LogState.FAILED
        return self._become_mirror("", self.record.master_epoch, keep_log=keep, now_ms=now_ms)

    # ------------------------------------------------------------------- helpers

    def on_stopped(self) -> list[MessageTable]:
        """The shell stopped this replica for good (its queue deleted, it moved, its node stops) and has
        failed every caller still waiting: let go of the master's and mirror's state now, and hand the
        shell the messages they held, to free a slice at a time. A stopped replica is still referred to
        by its GM member's callbacks, a cycle: its messages were freed only when a full collection
        reached it, the event loop stopped meanwhile (88-111 ms on each node, 2 s after a 250,000-message
        queue was deleted, in the next workload); freed at once, they stopped it for 28-100 ms."""
        tables: list[MessageTable] = []
        held = [self.master.core.contents] if self.master is not None else []
        held += [self.mirror.contents] if self.mirror is not None else []
        for contents in held:
            if all(contents.messages is not table for table in tables):  # a promoted mirror's are its master's
                tables.append(contents.messages)
        self.role = Role.STOPPED
        self.master = None
        self.mirror = None
        return tables

    def _stop(self, reason: str, now_ms: int) -> list[Effect]:
        effects: list[Effect] = []
        if self.master is not None:
            pending = tuple(p.step_id for p in self.master.pending) + tuple(self.master.held_confirms)
            if pending:
                effects.append(AbandonSteps(pending, reason))
            effects.append(EndConsumers(reason))
        self.role = Role.STOPPED
        self.master = None
        self.mirror = None
        self.unavailable = ""
        return [*effects, Stop(reason)]

    def _event(self, now_ms: int, kind: str, detail: str, node: str = "") -> list[Effect]:
        event = QueueEvent(now_ms, kind, node or self.node, detail)
        if self.role is Role.MIRROR and not node and self.master_member:
            self.events.append(event)
            return [Noted(event), *self._say(Noticed(self.member, kind, detail))]
        self.events.append(event)
        if self.role is not Role.MASTER and not node:
            self._notices.append((kind, detail))
        return [Noted(event)]

    @staticmethod
    def _limits(record: QueueRecord) -> QueueLimits:
        return QueueLimits.from_definition(
            queue_arguments.effective_definition(record.policy_definition, record.arguments),
            queue_arguments.single_active_consumer(record.arguments),
        )


def _pack(step: Step) -> None:
    """Make a step of several plain changes (a publish request's enqueues and the deliveries they made, an
    ack and the deliveries it made room for) one Transaction report: one ring message instead of one a
    change, applied whole by every replica as the step was decided, its enqueues sent packed
    (services/queue/wire.py). Steps with anything else (a depth report, a sync batch) stay as they are."""
    reports = step.reports
    if len(reports) > 1 and all(type(report) in _PLAIN_CHANGES for report in reports):
        changes: list[Any] = []
        for report in reports:
            changes += unpacked(report)
        step.reports = [Transaction(tuple(changes))]
        step.last_log_change = 0 if step.last_log_change >= 0 else -1


def _mark(node: str) -> Callable[[QueueRecord], QueueRecord | None]:
    def mark(record: QueueRecord) -> QueueRecord | None:
        if node not in record.mirrors or node in record.synchronised_mirrors:
            return None
        return replace(record, synchronised_mirrors=(*record.synchronised_mirrors, node))

    return mark


def _unmark(node: str) -> Callable[[QueueRecord], QueueRecord | None]:
    def unmark(record: QueueRecord) -> QueueRecord | None:
        if node not in record.synchronised_mirrors:
            return None
        return replace(record, synchronised_mirrors=tuple(m for m in record.synchronised_mirrors if m != node))

    return unmark


def _unclaim(node: str) -> Callable[[QueueRecord], QueueRecord | None]:
    def unclaim(record: QueueRecord) -> QueueRecord | None:
        if node not in record.recovery_positions:
            return None
        return replace(record, recovery_positions={n: c for n, c in record.recovery_positions.items() if n != node})

    return unclaim
