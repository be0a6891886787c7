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

Guarantees: a confirm is sent only for a message every live replica holds;
a delivery reaches a consumer only once every live replica knows it was
delivered, so after a failover it comes back with the redelivered flag;
steps are broadcast in the order they were decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from ringq import tracing
from ringq.v1 import queue_replication_pb2
from services.coordinator.metadata import QueueRecord
from services.gm.member import MemberEvent, MemberShell
from services.gm.messages import Deliver as GmDeliver
from services.gm.messages import Joined, MembersChanged, Stopped
from services.queue import traces, wire
from services.queue.contents import QueueContents
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
from services.queue.metrics import QueueMetrics
from services.queue.mirror import QueueMirror
from services.queue.ops import Desynchronised, Discard, Enqueue, Settle, Synchronised, SyncRequest

log = logging.getLogger("ringq.queue")
DEPTH_REPORT_SECONDS = 1.0


def node_of(member: str) -> str:
    """The node hosting a GM member (member ids are NODE.HEX)."""
    return member.rsplit(".", 1)[0]


def now_ms() -> int:
    return int(time.time() * 1000)


class ReplicaHost(Protocol):
    """What a replica needs from its node."""

    node_id: str
    metrics: QueueMetrics | None

    def new_member(self, group: str, events: Callable[[MemberEvent], None]) -> MemberShell: ...

    async def update_record(
        self, record: QueueRecord, change: Callable[[QueueRecord], QueueRecord | None]
    ) -> QueueRecord: ...

    async def dead_letter(self, vhost: str, queue: str, bodies: list[Publish]) -> None: ...

    def queue_dir(self, record: QueueRecord) -> str: ...


@dataclass
class Consumer:
    tag: str
    deliveries: asyncio.Queue[Delivery | None] = field(default_factory=asyncio.Queue)


class QueueReplica:
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
        if record.master == host.node_id:
            self.master = QueueMaster(record.name, self._recover(), self.limits)
        else:
            # Exists before the GM member joins: the master's reports may arrive
            # as soon as it has (its member id is filled in then).
            self.mirror = QueueMirror(record.name, "")
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
    def replicates_messages(self) -> bool:
        """False for replication "wiring": mirrors keep the queue itself available (one is promoted,
        empty, when the master dies) but hold no messages; the master broadcasts no reports."""
        return self.record.replication != "wiring"

    @property
    def is_master(self) -> bool:
        return self.master is not None

    # ------------------------------------------------------------ durability

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
        confirmed and did not see settled. They may have been delivered before
        the restart, so they come back counted as delivered once."""
        if not self.record.durable:
            return None
        contents = QueueContents()
        for _, payload in self._open_log(fresh=False):
            message = wire.message_from_proto(queue_replication_pb2.ReplicatedMessage.FromString(payload))
            message.delivery_count = max(message.delivery_count, 1)
            contents.apply(Enqueue(message))
        if contents.messages:
            log.info("queue %s: recovered %d messages from disk", self.record.name, len(contents.messages))
        return contents

    def _persist(self, step: Step) -> bool:
        """Append the step's persistent changes to the log; True if there were any."""
        if self.log is None:
            return False
        appended = False
        for report in step.reports:
            if isinstance(report, Enqueue) and report.message.persistent:
                self.log.append_enqueue(report.message.id, wire.message_to_proto(report.message).SerializeToString())
                appended = True
            elif isinstance(report, Settle | Discard):
                self.log.append_remove(report.ids)
                appended = True
        return appended

    def _snapshot_to_new_log(self) -> None:
        """A promoted mirror of a durable queue starts its own log with what it holds."""
        if not self.record.durable or self.master is None:
            return
        self._open_log(fresh=True)
        assert self.log is not None
        messages = self.master.contents.messages
        for message_id in sorted(messages):
            message = messages[message_id]
            if message.persistent:
                self.log.append_enqueue(message_id, wire.message_to_proto(message).SerializeToString())
        self.log.flush()

    # ---------------------------------------------------------------- start

    async def start(self) -> None:
        if self.mirror is not None:
            # A mirror starts empty, whatever the record remembers of an earlier life.
            node = self.host.node_id

            def unsynchronised(record: QueueRecord) -> QueueRecord | None:
                if node not in record.synchronised_mirrors:
                    return None
                synced = tuple(m for m in record.synchronised_mirrors if m != node)
                return _replace_record(record, synchronised_mirrors=synced)

            await self._update(unsynchronised)
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
            self.status = "mirror" if self.replicates_messages else "mirror (replication wiring: no messages)"
            automatic = self.record.policy_definition.get("ha-sync-mode", "manual") == "automatic"
            if not self.replicates_messages:
                self._say(Synchronised(member.id))  # wiring: holding the queue is all a mirror is asked to
            elif automatic:
                self._say(self.mirror.request_sync())
        else:
            self.status = "running"
            self._spawn(self._depth_reports())

    async def stop(self) -> None:
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
                await sent
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
            if event.deaths:
                self._spawn(self._after_deaths(set(event.deaths)))
        elif isinstance(event, GmDeliver):
            if self.member is not None and event.publisher == self.member.id:
                return  # our own reports, applied when decided
            for body in event.bodies:
                self._on_report(event.publisher, body)
        elif isinstance(event, Stopped):
            self.status = f"stopped: {event.reason}"
            for consumer in self.consumers.values():
                consumer.deliveries.put_nowait(None)

    def _on_report(self, publisher: str, body: bytes) -> None:
        try:
            report = wire.decode(body)
        except ValueError as error:
            log.warning("queue %s: dropping a malformed report from %s: %s", self.record.name, publisher, error)
            return
        if isinstance(report, SyncRequest | Synchronised | Desynchronised):
            if self.master is not None:
                self._from_mirror(report)
            return
        # Only a master sends reports (mirrors send SyncRequest / Synchronised),
        # and a new master exists only after the ring delivered all of the old one's.
        if self.mirror is not None:
            for said in self.mirror.apply(report):
                self._say(said)
            if tracing.enabled():
                traces.mirror_applied(self.record.name, self.host.node_id, self.record.gm_group, report)
        elif self.master is None:
            log.warning("queue %s: a %s came before this replica was ready", self.record.name, type(report).__name__)

    def _from_mirror(self, said: SyncRequest | Synchronised | Desynchronised) -> None:
        master = self.master
        assert master is not None
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
                return _replace_record(record, synchronised_mirrors=synced)

            self._spawn(self._update(unmark))
            return

        def mark(record: QueueRecord) -> QueueRecord | None:
            if node not in record.mirrors or node in record.synchronised_mirrors:
                return None
            return _replace_record(record, synchronised_mirrors=(*record.synchronised_mirrors, node))

        self._spawn(self._update(mark))

    def _say(self, said: SyncRequest | Synchronised | Desynchronised) -> None:
        member = self.member
        if member is not None and member.stopped is None:
            self._spawn(_quietly(member.broadcast([wire.encode(said)], confirmed=False)))

    async def _update(self, change: Callable[[QueueRecord], QueueRecord | None]) -> None:
        self.record = await self.host.update_record(self.record, change)

    def on_record(self, record: QueueRecord) -> None:
        """The coordinator's record changed (its Watch): keep the newest version."""
        if record.version > self.record.version:
            self.record = record

    async def _after_deaths(self, deaths: set[str]) -> None:
        """A member died: if it was the master, the eldest synchronised mirror takes over."""
        master_died = any(node_of(d) == self.record.master for d in deaths)
        dead_nodes = {node_of(d) for d in deaths}
        if self.master is not None:

            def drop_mirrors(record: QueueRecord) -> QueueRecord | None:
                if not dead_nodes & set(record.mirrors):
                    return None
                mirrors = tuple(m for m in record.mirrors if m not in dead_nodes)
                synced = tuple(m for m in record.synchronised_mirrors if m not in dead_nodes)
                return _replace_record(record, mirrors=mirrors, synchronised_mirrors=synced)

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
            return _replace_record(
                current, master=self.host.node_id, mirrors=mirrors, synchronised_mirrors=synchronised
            )

        self.master, step = mirror.promote(self.limits)
        self.mirror = None
        await asyncio.to_thread(self._snapshot_to_new_log)
        if not self.replicates_messages:
            self.status = "running (replication wiring: promoted empty, the old master's messages are lost)"
        else:
            self.status = "running" if synced else "running (promoted unsynchronised: messages may be lost)"
        log.info("queue %s: promoted on %s (%s)", record.name, self.host.node_id, self.status)
        await self._update(promote)
        await self._carry_out(step)
        self._spawn(self._depth_reports())


def _replace_record(record: QueueRecord, **changes: object) -> QueueRecord:
    return replace(record, **changes)  # type: ignore[arg-type]


async def _quietly(call: Awaitable[object]) -> None:
    with contextlib.suppress(Exception):
        await call
