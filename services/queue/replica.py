"""One queue's replica on a node: its master or a mirror, and the GM member that links them.

Responsible for: running the pure queue core (master.py / mirror.py) against
real I/O. The master turns each client request into a Step and broadcasts the
Step's reports on the queue's GM group with confirmation; only when the ring
confirms (every live member holds the reports) does it answer publishers,
hand deliveries to consumers and forward dead letters. A mirror applies the
master's reports and tells the master when it wants a sync or is
synchronised. When the master's GM member dies, the eldest synchronised
mirror promotes itself (the ring reports the death only after every message
of the dead master was delivered, so no report is lost or applied twice).

Durable queues: the disks' part (logs, waiting for the mirrors' disks,
recovery without the master) is the mixin in services/queue/replica_disks.py,
after the rules of services/queue/durability.py.

Guarantees: a confirm is sent only for a message every live replica holds;
a delivery reaches a consumer only once every live replica knows it was
delivered, so after a failover it comes back with the redelivered flag;
steps are broadcast in the order they were decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ringq import tracing
from services.coordinator.metadata import QueueRecord
from services.gm.member import MemberEvent, MemberShell
from services.gm.messages import Deliver as GmDeliver
from services.gm.messages import Joined, MembersChanged, Stopped
from services.queue import traces, wire
from services.queue.durability import (
    PersistedWaits,
    Position,
    persist_reports,
)
from services.queue.group_commit import GroupCommitter
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
from services.queue.message_log import FileMessageLog
from services.queue.mirror import QueueMirror
from services.queue.ops import (
    Depth,
    Desynchronised,
    Enqueue,
    MirrorSays,
    Persisted,
    Report,
    Settle,
    Synchronised,
    SyncRequest,
)
from services.queue.replica_disks import ReplicaDisks, ReplicaHost, node_of, replace_record

log = logging.getLogger("ringq.queue")
DEPTH_REPORT_SECONDS = 1.0


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Consumer:
    tag: str
    deliveries: asyncio.Queue[Delivery | None] = field(default_factory=asyncio.Queue)


class QueueReplica(ReplicaDisks):
    """The replica of `record` on this node."""

    def __init__(self, host: ReplicaHost, record: QueueRecord) -> None:
        self.host = host
        self.record = record
        self.limits = QueueLimits.from_definition(
            record.policy_definition, record.arguments.get("x-single-active-consumer") == "true"
        )
        self.master: QueueMaster | None = None
        self.mirror: QueueMirror | None = None
        # Durable queues: the master keeps persistent messages in a log on disk
        # and confirms them only once a group commit made them durable.
        self.log: FileMessageLog | None = None
        self.committer: GroupCommitter | None = None
        # The epoch of the master's term: this replica's own as master, as a mirror
        # the one its master's depth reports carry; and, as a mirror, the master
        # member and sequence number of the last report applied.
        self.epoch = 0
        self.applied_from = ""
        self.applied_seq = 0
        self._said_persisted = ("", 0)  # (master, through_seq) last said
        # Master of a durable queue: what its mirrors' disks hold; mirrors that said they
        # are synchronised and are not marked so in the record yet (with their marking).
        self.persisted_waits: PersistedWaits[asyncio.Future[None]] = PersistedWaits()
        self.announced: dict[str, asyncio.Future[None]] = {}
        self._last_persistent_seq = 0
        # A mirror's log from before a restart, kept while its master is away.
        self.recovered_log: FileMessageLog | None = None
        self.recovering = False
        self.log_backlog: list[Report] | None = None
        self._log_start: asyncio.Future[None] | None = None
        if record.master == host.node_id:
            self.master = QueueMaster(record.name, self._recover(), self.limits, self.epoch)
        else:
            # Exists before the GM member joins: the master's reports may arrive
            # as soon as it has (its member id is filled in then).
            self.mirror = QueueMirror(record.name, "")
            self.recovered_log = self._previous_log()
        self.member: MemberShell | None = None
        self.members: set[str] = set()
        self.consumers: dict[str, Consumer] = {}
        self.status = "starting"
        # Recent noteworthy events (an inconsistent mirror, ...), newest last.
        self.events: deque[str] = deque(maxlen=10)
        self._last_confirm: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._stopped = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def is_master(self) -> bool:
        return self.master is not None

    # ---------------------------------------------------------------- start

    async def start(self) -> None:
        if self.master is not None:
            await self._claim_master()
        elif self.recovered_log is None:
            await self._forget_earlier_life()  # joins as a new, empty mirror
        member = self.host.new_member(self.record.gm_group, self._on_member_event)
        self.member = member
        if tracing.enabled():
            member.ring_observer = traces.ring_hop_observer(self.record.name, self.host.node_id)
        joined = asyncio.ensure_future(member.joined.wait())
        stopped = asyncio.ensure_future(member.wait_stopped())
        await asyncio.wait({joined, stopped}, return_when=asyncio.FIRST_COMPLETED)
        joined.cancel()
        stopped.cancel()
        if not member.joined.is_set():
            raise ConnectionError(f"queue {self.record.name}: could not join its group")
        if self.mirror is not None:
            self.mirror.member = member.id
            if self.recovered_log is not None and not self._master_in_group():
                await self._wait_for_master()
            else:
                await self._start_mirroring()
        else:
            self.status = "running"
            if self.committer is not None:
                await self.committer.commit()  # this term's mark
            self._spawn(self._depth_reports())

    async def _forget_earlier_life(self) -> None:
        """A mirror starts empty, whatever the record remembers of an earlier life."""
        node = self.host.node_id
        self._discard_previous_log()

        def unsynchronised(record: QueueRecord) -> QueueRecord | None:
            if node not in record.synchronised_mirrors and node not in record.recovery_positions:
                return None
            synced = tuple(m for m in record.synchronised_mirrors if m != node)
            positions = {n: p for n, p in record.recovery_positions.items() if n != node}
            return replace_record(record, synchronised_mirrors=synced, recovery_positions=positions)

        await self._update(unsynchronised)

    async def _start_mirroring(self) -> None:
        if self.recovered_log is not None:
            await self._forget_earlier_life()
        mirror = self.mirror
        member = self.member
        assert mirror is not None and member is not None
        self.status = "mirror" if self.replicates_messages else "mirror (replication wiring: no messages)"
        automatic = self.record.policy_definition.get("ha-sync-mode", "manual") == "automatic"
        if not self.replicates_messages:
            self._say(Synchronised(member.id))  # wiring: holding the queue is all a mirror is asked to
        elif automatic:
            self._say(mirror.request_sync())

    async def stop(self) -> None:
        self._abandon_persisted_waits("the replica stopped")
        for consumer in self.consumers.values():
            consumer.deliveries.put_nowait(None)
        for task in self._tasks:
            task.cancel()
        if self.log is not None:
            self.log.close()
        if self.member is not None and self.member.stopped is None:
            self.member.leave()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.member.wait_stopped(), 3.0)
        self._stopped.set()

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Future[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------- master: requests

    def _require_master(self) -> QueueMaster:
        if self.master is None:
            raise QueueError("UNAVAILABLE", f"queue {self.record.name!r} has no master on this node ({self.status})")
        return self.master

    async def publish(self, items: list[Publish]) -> list[PublishOutcome]:
        return await self.publish_in_order(items)

    def publish_in_order(self, items: list[Publish]) -> asyncio.Future[list[PublishOutcome]]:
        """Decide on `items` now, so batches are taken in the order this is called
        (a publisher's seqs must not overtake each other); the future completes
        once the replicas hold them."""
        step, outcomes = self._require_master().publish(items, now_ms())
        done = self._carry_out(step)  # broadcast queued now, in decision order

        async def confirmed() -> list[PublishOutcome]:
            await done
            return outcomes

        return asyncio.ensure_future(confirmed())

    async def consume(self, tag: str, prefetch: int, priority: int) -> Consumer:
        master = self._require_master()
        consumer = Consumer(tag)
        self.consumers[tag] = consumer
        try:
            step = master.consume(tag, prefetch, priority)
        except QueueError:
            del self.consumers[tag]
            raise
        self._spawn(self._carry_out(step))
        return consumer

    async def cancel(self, tag: str) -> None:
        consumer = self.consumers.pop(tag, None)
        if consumer is None or self.master is None:
            return
        with contextlib.suppress(QueueError):
            await self._carry_out(self.master.cancel(tag))

    async def settle(self, tag: str, delivery_tag: int, multiple: bool, kind: str) -> None:
        """Settle one delivery (a unary Settle); returns once the ring confirmed it."""
        step, error = self._require_master().settle(tag, [Settlement(delivery_tag, multiple, kind)])
        await self._carry_out(step)
        if error is not None:
            raise error

    def settle_now(self, tag: str, settlements: list[Settlement]) -> QueueError | None:
        """Settle a run of deliveries from a consume stream in one step, without
        waiting for the ring (the consumer does not need to know when an ack is
        replicated: an ack lost with a crashed master means a redelivery, flagged).
        Returns the error of the first unknown delivery tag, if any."""
        step, error = self._require_master().settle(tag, settlements)
        self._spawn(self._carry_out(step))
        return error

    async def get(self, no_ack: bool) -> Delivery | None:
        step, delivery = self._require_master().get(no_ack)
        await self._carry_out(step)
        return delivery

    async def purge(self) -> int:
        step, count = self._require_master().purge()
        await self._carry_out(step)
        return count

    def sync_unsynchronised(self) -> None:
        """ringqctl sync_queue: send every unsynchronised mirror what it lacks,
        batch by batch, while the queue keeps serving."""
        master = self._require_master()
        if not self.replicates_messages:
            return  # replication wiring: mirrors hold no messages, there is nothing to sync
        view = self.member.core.view if self.member is not None else None
        for member_id in view.live if view is not None else ():
            node = node_of(member_id)
            unsynchronised = node in self.record.mirrors and node not in self.record.synchronised_mirrors
            if unsynchronised and member_id not in master.syncing:
                master.start_sync(member_id, 0)  # everything: a mirror skips what it has
                self._spawn(self._sync(member_id))

    def cancel_syncs(self) -> None:
        """ringqctl cancel_sync_queue."""
        master = self._require_master()
        for target in master.syncing:
            master.cancel_sync(target)

    # --------------------------------------------------- master: carrying out

    def _carry_out(self, step: Step) -> Awaitable[None]:
        """Queue the step's reports for broadcast now, in the order steps are
        decided (mirrors must apply them in that order), and return what
        completes the step: waiting for the ring's confirmation, then acting."""
        member = self.member
        assert member is not None
        previous = self._last_confirm
        confirmed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last_confirm = confirmed
        # Appended now, in decision order; made durable alongside the broadcast.
        durable = (
            asyncio.ensure_future(self.committer.commit())
            if self._persist(step) and self.committer is not None
            else None
        )
        sent: Awaitable[tuple[int, int]] | None = None
        failure: Exception | None = None
        if tracing.enabled():
            traces.enqueued(self.record.name, self.host.node_id, self.record.gm_group, step.reports)
        if step.reports and self.replicates_messages:
            try:
                sent = member.broadcast_now([wire.encode(r) for r in step.reports], confirmed=True)
            except ConnectionAbortedError as error:
                failure = error
        return self._complete(step, previous, confirmed, durable, sent, failure, time.monotonic())

    async def _complete(
        self,
        step: Step,
        previous: asyncio.Future[None] | None,
        confirmed: asyncio.Future[None],
        durable: asyncio.Future[None] | None,
        sent: Awaitable[tuple[int, int]] | None,
        failure: Exception | None,
        started: float,
    ) -> None:
        try:
            if failure is not None:
                raise failure
            if sent is not None:
                _, last_seq = await sent
                if durable is not None:
                    await self._mirrors_hold(last_seq)
            elif previous is not None:
                await asyncio.shield(previous)  # nothing new: wait for what came before
            if durable is not None:
                await durable
            if previous is not None and not previous.done():
                # Hand over in decision order: an earlier step may still wait for the disk (its
                # acks are logged) while this one does not; its deliveries carry lower tags.
                await asyncio.wait([previous])
        except BaseException as error:
            if not confirmed.done():
                confirmed.set_exception(ConnectionAbortedError(f"queue {self.record.name}: {error!r}"))
                confirmed.exception()  # retrieved: nobody else may wait on it
            raise
        confirmed.set_result(None)
        if self.host.metrics is not None and sent is not None:
            self.host.metrics.step_done(
                self.record.name,
                self.record.gm_group,
                published=sum(1 for r in step.reports if isinstance(r, Enqueue)),
                delivered=len(step.deliveries),
                acked=sum(len(r.ids) for r in step.reports if isinstance(r, Settle)),
                ring_ms=(time.monotonic() - started) * 1000,
            )
        if tracing.enabled():
            traces.confirmed(self.record.name, self.host.node_id, step.reports)
            traces.delivered(self.record.name, self.host.node_id, step.deliveries)
        for delivery in step.deliveries:
            consumer = self.consumers.get(delivery.consumer)
            if consumer is not None:
                consumer.deliveries.put_nowait(delivery)
        dead: dict[str, list[Publish]] = {}
        for letter in step.dead_letters:
            headers = {**letter.message.headers, "x-death-reason": letter.reason, "x-death-queue": self.record.name}
            dead.setdefault(letter.target, []).append(Publish(letter.message.body, headers=headers))
        for target, items in dead.items():
            self._spawn(self.host.dead_letter(self.record.vhost, target, items))
        self._arm_expiry()

    def _arm_expiry(self) -> None:
        master = self.master
        if master is None:
            return
        due = master.next_expiry_ms()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if due is not None:
            delay = max(0.0, (due - now_ms()) / 1000)
            self._timer = asyncio.get_running_loop().call_later(delay, self._expire_due)

    def _expire_due(self) -> None:
        self._timer = None
        if self.master is not None:
            self._spawn(self._carry_out(self.master.expire(now_ms())))

    async def _depth_reports(self) -> None:
        while True:
            await asyncio.sleep(DEPTH_REPORT_SECONDS)
            # Always: a synchronised mirror that diverged (a failed operation on
            # it) finds out at the next depth report and re-syncs.
            master = self.master
            if master is not None and self.record.mirrors and self.replicates_messages:
                await self._carry_out(master.depth_report())

    async def _sync(self, target: str) -> None:
        master = self.master
        while master is not None and target in master.syncing:
            await self._carry_out(master.sync_next(target))

    # -------------------------------------------------------- the GM member

    def _on_member_event(self, event: MemberEvent) -> None:
        if isinstance(event, Joined):
            self.members = set(event.members)
        elif isinstance(event, MembersChanged):
            self.members |= set(event.births)
            self.members -= set(event.deaths)
            if self.recovering and any(node_of(m) == self.record.master for m in event.births):
                self._spawn(self._end_recovery("the master came back"))
            if event.deaths:
                self._spawn(self._after_deaths(set(event.deaths)))
        elif isinstance(event, GmDeliver):
            if self.member is not None and event.publisher == self.member.id:
                return  # our own reports, applied when decided
            appended = False
            for index, body in enumerate(event.bodies):
                appended |= self._on_report(event.publisher, body, event.first_seq + index)
            if appended:
                self._mirror_log_commit()
        elif isinstance(event, Stopped):
            self.status = f"stopped: {event.reason}"
            self._abandon_persisted_waits(self.status)
            for consumer in self.consumers.values():
                consumer.deliveries.put_nowait(None)

    def _on_report(self, publisher: str, body: bytes, seq: int) -> bool:
        """Apply one report; True if it appended to this mirror's log."""
        try:
            report = wire.decode(body)
        except ValueError as error:
            log.warning("queue %s: dropping a malformed report from %s: %s", self.record.name, publisher, error)
            return False
        if isinstance(report, SyncRequest | Synchronised | Desynchronised | Persisted):
            if self.master is not None:
                self._from_mirror(report)
            return False
        # Only a master sends reports (mirrors send SyncRequest / Synchronised),
        # and a new master exists only after the ring delivered all of the old one's.
        if self.mirror is not None:
            return self._mirror_applies(report, publisher, seq)
        if self.master is None:
            log.warning("queue %s: a %s came before this replica was ready", self.record.name, type(report).__name__)
        return False

    def _mirror_applies(self, report: Report, publisher: str, seq: int) -> bool:
        mirror = self.mirror
        assert mirror is not None
        if isinstance(report, Depth):
            self.epoch = report.epoch
        self.applied_from, self.applied_seq = publisher, seq
        said = mirror.apply(report)
        appended = False
        if self.log_backlog is not None:
            self.log_backlog.append(report)  # a new log is being written: it follows
        elif self.log is not None:
            appended = persist_reports(self.log, (report,))
        for one in said:
            if isinstance(one, Desynchronised):
                self._drop_log()
            if isinstance(one, Synchronised) and self.record.durable and self.replicates_messages:
                self._start_mirror_log(one)
            else:
                self._say(one)
        if tracing.enabled():
            traces.mirror_applied(self.record.name, self.host.node_id, self.record.gm_group, report)
        return appended

    def _from_mirror(self, said: MirrorSays) -> None:
        master = self.master
        assert master is not None
        if isinstance(said, Persisted):
            if self.member is not None and said.master == self.member.id:
                self.persisted_waits.persisted(node_of(said.member), said.through_seq)
                self._release_persisted()
            return
        if isinstance(said, SyncRequest):
            master.start_sync(said.member, said.below_id)
            self._spawn(self._sync(said.member))
            return
        node = node_of(said.member)
        if isinstance(said, Desynchronised):
            event = f"mirror on {node} was inconsistent and is re-syncing"
            log.warning("queue %s: %s", self.record.name, event)
            self.events.append(event)

            def unmark(record: QueueRecord) -> QueueRecord | None:
                if node not in record.synchronised_mirrors:
                    return None
                synced = tuple(m for m in record.synchronised_mirrors if m != node)
                return replace_record(record, synchronised_mirrors=synced)

            self._spawn(self._update(unmark))
            return

        def mark(record: QueueRecord) -> QueueRecord | None:
            if node not in record.mirrors or node in record.synchronised_mirrors:
                return None
            return replace_record(record, synchronised_mirrors=(*record.synchronised_mirrors, node))

        if self.log is None or not self.replicates_messages:
            self._spawn(self._update(mark))
            return
        # Durable: from now on its disk is required for confirms; it is marked once its
        # disk also holds every persistent change confirmed before.
        if node not in self.announced:
            held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.announced[node] = held
            self.persisted_waits.wait(self._last_persistent_seq, held, only=(node,))
            self._release_persisted()
            self._spawn(self._mark_when_held(node, held, mark))

    def _say(self, said: MirrorSays) -> None:
        member = self.member
        if member is not None and member.stopped is None:
            self._spawn(_quietly(member.broadcast([wire.encode(said)], confirmed=False)))

    async def _update(self, change: Callable[[QueueRecord], QueueRecord | None]) -> None:
        self.on_record(await self.host.update_record(self.record, change))

    def on_record(self, record: QueueRecord) -> None:
        """The coordinator's record changed (its Watch): keep the newest version."""
        if record.version <= self.record.version:
            return
        master_moved = record.master != self.record.master
        self.record = record
        if self.recovering and master_moved and record.master != self.host.node_id:
            self._spawn(self._end_recovery(f"{record.master} took the queue"))
        self._release_persisted()  # a mirror struck from the synchronised ones no longer holds confirms back

    async def _after_deaths(self, deaths: set[str]) -> None:
        """A member died: if it was the master, the eldest synchronised mirror takes over."""
        master_died = any(node_of(d) == self.record.master for d in deaths)
        dead_nodes = {node_of(d) for d in deaths}
        if self.master is not None:
            for node in dead_nodes:
                self.persisted_waits.forget(node)
                held = self.announced.pop(node, None)
                if held is not None and not held.done():
                    held.cancel()

            def drop_mirrors(record: QueueRecord) -> QueueRecord | None:
                if not dead_nodes & set(record.mirrors):
                    return None
                mirrors = tuple(m for m in record.mirrors if m not in dead_nodes)
                synced = tuple(m for m in record.synchronised_mirrors if m not in dead_nodes)
                return replace_record(record, mirrors=mirrors, synchronised_mirrors=synced)

            await self._update(drop_mirrors)
            return
        if not master_died or self.mirror is None:
            return
        await self._promote_if_eldest(dead_nodes)

    async def _promote_if_eldest(self, dead_nodes: set[str]) -> None:
        record = self.record
        view = self.member.core.view if self.member is not None else None
        live_nodes = {node_of(m) for m in (view.live if view is not None else self.members)}
        candidates = [m for m in record.mirrors if m in record.synchronised_mirrors and m in live_nodes]
        promote_unsynchronised = (
            record.policy_definition.get("ha-promote-on-failure", "when-synced") == "always"
            or not self.replicates_messages  # wiring: messages were never replicated, the queue goes on
        )
        if not candidates and promote_unsynchronised:
            candidates = [m for m in record.mirrors if m in live_nodes]
        if not candidates:
            self.status = "unavailable: no synchronised mirror to promote (ha-promote-on-failure is when-synced)"
            log.warning("queue %s: %s", record.name, self.status)
            return
        if candidates[0] != self.host.node_id:
            return
        mirror = self.mirror
        assert mirror is not None
        synced = mirror.synchronised
        if not synced and not promote_unsynchronised:
            # The record says synchronised, this replica knows better: never promote
            # a replica that may lack messages unless the policy says always.
            self.status = "unavailable: this mirror is not synchronised (ha-promote-on-failure is when-synced)"
            log.warning("queue %s: %s", record.name, self.status)
            return

        def promote(current: QueueRecord) -> QueueRecord | None:
            mirrors = tuple(m for m in current.mirrors if m != self.host.node_id and m not in dead_nodes)
            synchronised = tuple(m for m in current.synchronised_mirrors if m in mirrors)
            return replace_record(current, master=self.host.node_id, mirrors=mirrors, synchronised_mirrors=synchronised)

        await self._log_started()
        self.epoch += 1
        self.master, step = mirror.promote(self.limits, self.epoch)
        self.mirror = None
        self.persisted_waits = PersistedWaits()
        if self.record.durable:
            # A synchronised mirror's log holds what it holds; another starts one now.
            if self.log is None:
                self._write_holdings_to_new_log(self.master.contents, Position(self.epoch, 0))
            else:
                self.log.append_mark(Position(self.epoch, 0).mark())
            assert self.committer is not None
            await self.committer.commit()
        if not self.replicates_messages:
            self.status = "running (replication wiring: promoted empty, the old master's messages are lost)"
        else:
            self.status = "running" if synced else "running (promoted unsynchronised: messages may be lost)"
        log.info("queue %s: promoted on %s (%s)", record.name, self.host.node_id, self.status)
        await self._update(promote)
        await self._carry_out(step)
        self._spawn(self._depth_reports())


async def _quietly(call: Awaitable[object]) -> None:
    with contextlib.suppress(Exception):
        await call
