"""A mirror of a queue: applies the master's reports, knows when it is synchronised,
and becomes the master when promoted.

Responsible for: applying reports (contents.py), detecting synchronisation
by depth as RabbitMQ does (a mirror holding as many messages, ready plus
pending acknowledgement, as the master at the same point of the master's
report stream holds exactly the same ones, since it can only lack the oldest),
asking for a sync and absorbing sync batches while the queue keeps working,
and promotion.

Guarantees: `synchronised` is set only at a Depth report whose depth equals
this mirror's, once no message restored from its log is left unchecked by a
sync, and cleared if a later Depth report disagrees (a failed
operation on this replica: the inconsistent-error rule, it re-syncs); on
promotion every message pending acknowledgement goes back to the queue as
redelivered (its consumer was attached to the dead master), and the new
master carries on with ids after the highest it knows.
"""

from __future__ import annotations

from services.queue.contents import QueueContents
from services.queue.master import QueueLimits, QueueMaster, Step
from services.queue.ops import (
    Depth,
    Desynchronised,
    MirrorSays,
    Report,
    Requeue,
    SyncBatch,
    SyncDone,
    Synchronised,
    SyncRequest,
)

# A sync request names what the mirror holds already in at most this many id ranges (else none).
MAX_HELD_RANGES = 4096


class QueueMirror:
    """One mirror of the queue `name`, as the GM member `member`."""

    def __init__(self, name: str, member: str, contents: QueueContents | None = None) -> None:
        self.name = name
        self.member = member
        self.contents = contents if contents is not None else QueueContents()
        self.synchronised = False
        self.sync_requested = False

    def apply(self, report: Report) -> list[MirrorSays]:
        """Apply one report of the master; returns what to tell the master, if anything."""
        if isinstance(report, SyncBatch) and report.target != self.member:
            return []  # another mirror's sync: this one holds what it holds
        self.contents.apply(report)
        if isinstance(report, Depth):
            # Equal depths prove equal contents only for a mirror that can lack nothing but the oldest
            # messages: one still holding messages restored from its log that no sync batch has covered
            # yet could match the master's depth with different ones (found by tests/sim, seed 626).
            in_sync = self.contents.depth == report.depth and not self.contents.restored
            if not self.member:
                return []  # not joined yet: its announcement would name nobody; the next report counts
            if in_sync and not self.synchronised:
                self.synchronised = True
                self.sync_requested = False
                return [Synchronised(self.member)]
            if not in_sync and self.synchronised:
                # The inconsistent-error rule: something failed here that did not
                # fail on the master. Start over from nothing and re-sync fully.
                return self.start_over()
        elif isinstance(report, SyncDone) and report.target == self.member:
            self.sync_requested = False
        return []

    def start_over(self) -> list[MirrorSays]:
        """Something failed on this replica that did not fail on the master (its disk):
        the inconsistent-error rule, as for a depth that disagrees: forget everything, re-sync."""
        was_synchronised, self.synchronised = self.synchronised, False
        self.contents = QueueContents()
        self.sync_requested = True
        said: list[MirrorSays] = [Desynchronised(self.member)] if was_synchronised else []
        return [*said, SyncRequest(self.member, 0)]

    def request_sync(self) -> SyncRequest:
        """Ask for every message older than the first this mirror received live, naming those
        it holds already (restored from its log)."""
        self.sync_requested = True
        below_id = self.contents.first_enqueued_id
        held = self.contents.held_ranges(below_id, MAX_HELD_RANGES) if self.contents.restored else ()
        return SyncRequest(self.member, below_id, held)

    def promote(self, limits: QueueLimits, epoch: int) -> tuple[QueueMaster, Step]:
        """Become the master of term `epoch`: requeue what was pending acknowledgement, announce the depth."""
        master = QueueMaster(self.name, self.contents, limits, epoch)
        step = Step()
        pending = tuple(sorted(self.contents.unacked))
        if pending:
            requeue = Requeue(pending)
            self.contents.apply(requeue)
            step.reports.append(requeue)
        depth = Depth(self.contents.depth, epoch)
        self.contents.apply(depth)
        step.reports.append(depth)
        return master, step
