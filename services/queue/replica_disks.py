"""A queue replica's disks: its message log, what the master waits for from its mirrors' logs,
and recovery after a restart without the master (the rules are in services/queue/durability.py).

Responsible for: the durable half of services/queue/replica.py, as a mixin of QueueReplica. A
durable queue's master logs its persistent changes and, before confirming them, waits for every
synchronised mirror's Persisted report; a mirror starts its log once synchronised and reports how
far it is durable after each group commit; a replica that comes back with a log while its master's
node does not waits for it, then the replica whose log knows most recovers the queue.

Guarantees: every replica the coordinator's record lists as master or synchronised mirror holds
every confirmed persistent message on its disk; a replica that recovers a queue is a synchronised
one with the furthest position among those that came back (any one under
ha-promote-on-failure always), and takes over only by compare-and-set on the record; nothing that
waits on a mirror's disk is left waiting once the master's member stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from services.coordinator.metadata import QueueRecord
from services.gm.member import MemberEvent, MemberShell
from services.queue.contents import QueueContents
from services.queue.durability import (
    PersistedWaits,
    Position,
    append_enqueues,
    contents_from_log,
    elect,
    persist_reports,
    persistent_holdings,
)
from services.queue.group_commit import GroupCommitter
from services.queue.master import Publish, QueueLimits, QueueMaster, Step
from services.queue.message_log import FileMessageLog
from services.queue.metrics import QueueMetrics
from services.queue.mirror import QueueMirror
from services.queue.ops import Message, MirrorSays, Persisted, Report, Synchronised

log = logging.getLogger("ringq.queue")
# Messages a newly synchronised mirror writes into its new log between two turns of the event loop
# (a 100,000-message queue written at once held a mirror's loop, and so the ring, for 0.6 s).
HOLDINGS_CHUNK = 2_000


def node_of(member: str) -> str:
    """The node hosting a GM member (member ids are NODE.HEX)."""
    return member.rsplit(".", 1)[0]


def replace_record(record: QueueRecord, **changes: object) -> QueueRecord:
    return replace(record, **changes)  # type: ignore[arg-type]


class ReplicaHost(Protocol):
    """What a replica needs from its node."""

    node_id: str
    metrics: QueueMetrics | None
    # How long a restarted replica waits for its queue's master before the replica that knows most takes over.
    recovery_wait_s: float

    def new_member(self, group: str, events: Callable[[MemberEvent], None]) -> MemberShell: ...

    async def update_record(
        self, record: QueueRecord, change: Callable[[QueueRecord], QueueRecord | None]
    ) -> QueueRecord: ...

    async def dead_letter(self, vhost: str, queue: str, bodies: list[Publish]) -> None: ...

    def queue_dir(self, record: QueueRecord) -> str: ...


class ReplicaDisks:
    """The durable half of QueueReplica (see the module docstring); QueueReplica sets the state."""

    host: ReplicaHost
    record: QueueRecord
    limits: QueueLimits
    master: QueueMaster | None
    mirror: QueueMirror | None
    member: MemberShell | None
    members: set[str]
    status: str
    events: deque[str]
    log: FileMessageLog | None
    committer: GroupCommitter | None
    epoch: int
    applied_from: str
    applied_seq: int
    _said_persisted: tuple[str, int]
    persisted_waits: PersistedWaits[asyncio.Future[None]]
    announced: dict[str, asyncio.Future[None]]
    _last_persistent_seq: int
    recovered_log: FileMessageLog | None
    recovering: bool
    # While a newly synchronised mirror writes its new log: the reports applied meanwhile, in order.
    log_backlog: list[Report] | None
    _log_start: asyncio.Future[None] | None
    _tasks: set[asyncio.Future[None]]

    if TYPE_CHECKING:  # QueueReplica's, used here

        def _spawn(self, coroutine: Awaitable[None]) -> None: ...

        def _say(self, said: MirrorSays) -> None: ...

        async def _update(self, change: Callable[[QueueRecord], QueueRecord | None]) -> None: ...

        async def _start_mirroring(self) -> None: ...

        def _carry_out(self, step: Step) -> Awaitable[None]: ...

        async def _depth_reports(self) -> None: ...

        def on_record(self, record: QueueRecord) -> None: ...

    @property
    def replicates_messages(self) -> bool:
        """False for replication "wiring": mirrors keep the queue itself available (one is promoted,
        empty, when the master dies) but hold no messages; the master broadcasts no reports."""
        return self.record.replication != "wiring"

    def _open_log(self, fresh: bool) -> list[tuple[int, bytes]]:
        path = self.host.queue_dir(self.record)
        if fresh:
            shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
        self.log = FileMessageLog(path)
        self.committer = GroupCommitter(self.log)
        return self.log.recover()

    def _recover(self) -> QueueContents | None:
        """A durable queue's master starts from its log: every message it ever
        confirmed and did not see settled; its term is one more than the log's."""
        if not self.record.durable:
            return None
        self._open_log(fresh=False)
        assert self.log is not None
        self.epoch = Position.decode(self.log.mark()).epoch + 1
        self.log.append_mark(Position(self.epoch, 0).mark())
        contents = contents_from_log(self.log)
        if contents.messages:
            log.info("queue %s: recovered %d messages from disk", self.record.name, len(contents.messages))
        return contents

    def _previous_log(self) -> FileMessageLog | None:
        """A durable queue's mirror: the log it kept before a restart, if any."""
        if not self.record.durable:
            return None
        path = self.host.queue_dir(self.record)
        if not os.path.isdir(path):
            return None
        previous = FileMessageLog(path)
        if not previous.mark():
            previous.close()  # never synchronised: knows nothing worth keeping
            return None
        return previous

    def _discard_previous_log(self) -> None:
        if self.recovered_log is not None:
            self.recovered_log.close()
            self.recovered_log = None
            shutil.rmtree(self.host.queue_dir(self.record), ignore_errors=True)

    def _persist(self, step: Step) -> bool:
        """Append the step's persistent changes to the log; True if there were any."""
        return self.log is not None and persist_reports(self.log, step.reports)

    def _write_holdings_to_new_log(self, contents: QueueContents, position: Position) -> None:
        """Start this replica's own log with what it holds (a mirror once synchronised, a promoted
        mirror that had none); the caller commits it."""
        self._open_log(fresh=True)
        assert self.log is not None
        append_enqueues(self.log, persistent_holdings(contents.messages))
        self.log.append_mark(position.mark())

    def _start_mirror_log(self, said: Synchronised) -> None:
        """A mirror of a durable queue just became synchronised: write what it holds into a new log, a
        chunk at a time so the event loop (and the ring) keeps going; the reports applied meanwhile
        wait in `log_backlog` and follow in order; then say it is synchronised."""
        mirror = self.mirror
        assert mirror is not None
        holdings = persistent_holdings(mirror.contents.messages)
        self.log_backlog = []
        task = asyncio.ensure_future(self._write_mirror_log(holdings, said))
        self._log_start = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_mirror_log(self, holdings: list[Message], said: Synchronised) -> None:
        path = self.host.queue_dir(self.record)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
        new_log = FileMessageLog(path)
        written = False
        try:
            for start in range(0, len(holdings), HOLDINGS_CHUNK):
                append_enqueues(new_log, holdings[start : start + HOLDINGS_CHUNK])
                await asyncio.sleep(0)
                if self.mirror is None or not self.mirror.synchronised:
                    return  # promoted meanwhile (the promotion waits for this), or desynchronised
            persist_reports(new_log, self.log_backlog or ())
            new_log.append_mark(Position(self.epoch, self.applied_seq).mark())
            written = True
        finally:
            self.log_backlog = None
            if not written:
                new_log.close()
                shutil.rmtree(path, ignore_errors=True)
        self.log, self.committer = new_log, GroupCommitter(new_log)
        await self._synchronised_on_disk(said)

    async def _log_started(self) -> None:
        """Wait for a new mirror log being written (a promotion needs to know whether there is one)."""
        if self._log_start is not None and not self._log_start.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._log_start)

    def _drop_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None
            self.committer = None
            shutil.rmtree(self.host.queue_dir(self.record), ignore_errors=True)

    async def _claim_master(self) -> None:
        """A master starting from the record: check it still is the master (a replica that came
        back while this node was away may have recovered the queue) and end any recovery."""
        node = self.host.node_id

        def claim(record: QueueRecord) -> QueueRecord | None:
            if record.master != node or not record.recovery_positions:
                return None
            return replace_record(record, recovery_positions={})

        await self._update(claim)
        if self.record.master != node:
            if self.log is not None:
                self.log.close()
                self.log = None
            raise ConnectionAbortedError(f"queue {self.record.name}: {self.record.master} recovered it meanwhile")

    def _master_in_group(self) -> bool:
        view = self.member.core.view if self.member is not None else None
        live = view.live if view is not None else self.members
        return not self.record.master or any(node_of(m) == self.record.master for m in live)

    def _live_nodes(self) -> set[str]:
        view = self.member.core.view if self.member is not None else None
        return {node_of(m) for m in (view.live if view is not None else self.members)}

    async def _wait_for_master(self) -> None:
        """Came back with a log while the master's node is away: say how far the log goes,
        then wait for the master; if it does not come, the replica that knows most takes over."""
        assert self.recovered_log is not None
        node = self.host.node_id
        position = Position.decode(self.recovered_log.mark()).encode()

        def register(record: QueueRecord) -> QueueRecord | None:
            if record.recovery_positions.get(node) == position:
                return None
            return replace_record(record, recovery_positions={**record.recovery_positions, node: position})

        self.recovering = True
        await self._update(register)
        self.status = f"recovering: waiting for the master on {self.record.master} (this log is at {position})"
        log.warning("queue %s: %s", self.record.name, self.status)
        self._spawn(self._recover_if_master_stays_away())

    async def _recover_if_master_stays_away(self) -> None:
        node = self.host.node_id
        while self.recovering:
            await asyncio.sleep(self.host.recovery_wait_s)
            if not self.recovering:
                return
            record = await self.host.update_record(self.record, lambda current: None)  # the latest
            self.on_record(record)
            if not self.recovering:
                return
            winner = elect(
                record.recovery_positions,
                record.synchronised_mirrors,
                record.mirrors,
                self._live_nodes(),
                promote_unsynchronised=record.policy_definition.get("ha-promote-on-failure") == "always",
            )
            if winner is None:
                self.status = (
                    f"unavailable: the master on {record.master} has not come back and no replica the record "
                    "lists as synchronised has (ha-promote-on-failure is when-synced)"
                )
            elif winner == node:
                await self._recover_from_own_log(record.master)
            else:
                self.status = f"recovering: {winner} knows most and recovers the queue"

    async def _recover_from_own_log(self, absent_master: str) -> None:
        """This replica knows most: it becomes the master with what its log holds."""
        recovered = self.recovered_log
        assert recovered is not None
        node = self.host.node_id

        def take(record: QueueRecord) -> QueueRecord | None:
            if record.master != absent_master or node not in record.recovery_positions:
                return None  # the master came back, or another replica took over
            mirrors = tuple(m for m in record.mirrors if m != node)
            return replace_record(record, master=node, mirrors=mirrors, synchronised_mirrors=(), recovery_positions={})

        await self._update(take)
        if self.record.master != node:
            return  # on_record ends the recovery
        self.recovering = False
        self.recovered_log = None
        self.log = recovered
        self.committer = GroupCommitter(recovered)
        self.epoch = Position.decode(recovered.mark()).epoch + 1
        recovered.append_mark(Position(self.epoch, 0).mark())
        await self.committer.commit()
        contents = contents_from_log(recovered)
        self.master = QueueMaster(self.record.name, contents, self.limits, self.epoch)
        self.mirror = None
        self.status = f"running (recovered from this node's log: the master on {absent_master} did not come back)"
        log.warning("queue %s: %s, %d messages", self.record.name, self.status, len(contents.messages))
        await self._carry_out(self.master.depth_report())
        self._spawn(self._depth_reports())

    async def _end_recovery(self, why: str) -> None:
        """The master came back or another replica recovered the queue: start over as an empty mirror."""
        if not self.recovering:
            return
        self.recovering = False
        log.info("queue %s: recovery over (%s): this replica starts over as a mirror", self.record.name, why)
        await self._start_mirroring()

    async def _synchronised_on_disk(self, said: Synchronised) -> None:
        """A mirror of a durable queue says it is synchronised once its disk holds what it holds."""
        await self._commit_mirror_log(self.applied_from, self.applied_seq)
        if self.mirror is not None and self.mirror.synchronised:
            self._say(said)

    def _mirror_log_commit(self) -> None:
        """Mark how far the log goes, make it durable, then tell the master."""
        if self.log is None:
            return
        self.log.append_mark(Position(self.epoch, self.applied_seq).mark())
        self._spawn(self._commit_mirror_log(self.applied_from, self.applied_seq))

    async def _commit_mirror_log(self, master: str, through_seq: int) -> None:
        committer = self.committer
        if committer is None:
            return
        try:
            await committer.commit()
        except Exception as error:  # the disk failed here and not on the master: re-sync
            self._disk_failed(error)
            return
        member = self.member
        said_master, said_through = self._said_persisted
        if member is not None and self.committer is committer and (master != said_master or through_seq > said_through):
            self._said_persisted = (master, through_seq)
            self._say(Persisted(member.id, master, through_seq))

    def _disk_failed(self, error: Exception) -> None:
        mirror = self.mirror
        if mirror is None or self.log is None:
            return
        event = f"this mirror's log failed ({error!r}): it starts over and re-syncs"
        log.error("queue %s: %s", self.record.name, event)
        self.events.append(event)
        self._drop_log()
        for said in mirror.start_over():
            self._say(said)

    async def _mark_when_held(
        self, node: str, held: asyncio.Future[None], mark: Callable[[QueueRecord], QueueRecord | None]
    ) -> None:
        try:
            await held
            await self._update(mark)
        except ConnectionAbortedError:
            return  # this master stopped: nobody is marked by it any more
        finally:
            if self.announced.get(node) is held:
                del self.announced[node]
            self.persisted_waits.drop(held)
            self._release_persisted()

    def _required_disks(self) -> set[str]:
        """The mirrors whose disks a persistent change must be on before it is confirmed."""
        if self.log is None or not self.replicates_messages:
            return set()
        return (set(self.record.synchronised_mirrors) | set(self.announced)) - {self.host.node_id}

    async def _mirrors_hold(self, seq: int) -> None:
        """Wait until every required mirror's disk holds this master's reports up to `seq`."""
        if not self.persisted_waits.holds(seq, self._required_disks()):
            held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.persisted_waits.wait(seq, held)
            try:
                await held
            finally:
                self.persisted_waits.drop(held)
        self._last_persistent_seq = max(self._last_persistent_seq, seq)

    def _abandon_persisted_waits(self, why: str) -> None:
        for held in self.persisted_waits.take_all():
            if not held.done():
                held.set_exception(ConnectionAbortedError(f"queue {self.record.name}: {why}"))

    def _release_persisted(self) -> None:
        for held in self.persisted_waits.release(self._required_disks()):
            if not held.done():
                held.set_result(None)
