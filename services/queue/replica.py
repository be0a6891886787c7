"""One queue's replica on a node: the asyncio shell around services/queue/replica_core.py.

Responsible for: feeding the pure core its inputs (client requests, the GM member's events, the
coordinator's record, the disk's answers, the time) and carrying out the effects it returns, in
order: broadcasts on the queue's GM group, the log (services/queue/replica_log.py), record
updates, and handing results to clients (publish outcomes, deliveries to consumers' queues, dead
letters). Every decision is the core's; this file only does I/O.

Guarantees: effects are carried out in the order the core emitted them; a step's deliveries reach
their consumer whatever became of the request that decided them (a publisher that went away strands
nothing), and are handed out before the step's publishes are answered; a GM broadcast is numbered as
the core expects, or the replica stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from operator import attrgetter

import grpc

from ringq import tracing
from services import failpoints
from services.coordinator.metadata import QueueRecord
from services.gm.member import MemberEvent, MemberShell
from services.gm.messages import Deliver as GmDeliver
from services.gm.messages import Joined, MembersChanged, Stopped
from services.queue import traces, wire
from services.queue.master import Delivery, Publish, PublishOutcome, QueueError, QueueMaster, Settlement
from services.queue.message_table import MessageTable
from services.queue.ops import MirrorSays, Report, Undecodable
from services.queue.replica_core import (
    AbandonSteps,
    AppendToLog,
    Broadcast,
    CompleteStep,
    DeleteRecord,
    DiscardLog,
    Effect,
    EndConsumers,
    FlushLog,
    Noted,
    QueueEvent,
    ReleaseConfirms,
    ReplicaCore,
    Stop,
    UpdateRecord,
    WatchDisk,
    WriteLog,
    describe,
)
from services.queue.replica_host import Consumer, ReplicaHost
from services.queue.replica_log import ReplicaLog

log = logging.getLogger("ringq.queue")
# A stopped replica's messages are freed this many chunks (of 64 ids) at a time, one slice a loop turn.
FREE_SLICE_CHUNKS = 256


def _free_in_slices(table: MessageTable) -> None:
    """Free `table`'s messages a slice at a time, each in its own turn of the running loop (at once if
    none runs), so that deleting a deep queue never stops the loop for long."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        table.release(len(table))
        return
    if not table.release(FREE_SLICE_CHUNKS):
        loop.call_soon(_free_in_slices, table)


# A delivery's consumer tag (a step's deliveries go to each consumer's stream a run at a time).
_consumer_of = attrgetter("consumer")
_QUIET_EVENTS = {"promoted", "recovered", "min_synchronised_restored", "disk_recovered"}


def now_ms() -> int:
    return int(time.time() * 1000)


class QueueReplica:
    """The replica of `record` on this node."""

    def __init__(self, host: ReplicaHost, record: QueueRecord) -> None:
        self.host = host
        self.core = ReplicaCore(host.node_id, record, now_ms(), host.timers)
        core = self.core
        self.disk = (
            ReplicaLog(
                host.queue_dir(record),
                lambda flush_id: self._feed(lambda now: core.on_log_flushed(flush_id, now)),
                lambda reason: self._feed(lambda now: core.on_disk_failed(reason, now)),
                lambda: self._feed(core.on_disk_writable),
            )
            if record.durable
            else None
        )
        self.member: MemberShell | None = None
        self.consumers: dict[str, Consumer] = {}
        self._waiters: dict[int, tuple[asyncio.Future[object], object]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due: int | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self.serving = asyncio.Event()  # set while this replica is the queue's master
        self._to_do: deque[Effect] = deque()
        self._executing = False
        self.stopped = False
        self._room: asyncio.Future[None] | None = None  # publishers waiting for the publish window

    # ---------------------------------------------------------------- views (QueueService)

    @property
    def record(self) -> QueueRecord:
        return self.core.record

    @property
    def is_master(self) -> bool:
        return self.core.is_master

    @property
    def master(self) -> QueueMaster | None:
        return self.core.master.core if self.core.master is not None and self.core.is_master else None

    @property
    def status(self) -> str:
        return self.core.status()

    @property
    def events(self) -> list[QueueEvent]:
        return list(self.core.events)

    # ---------------------------------------------------------------- life

    async def start(self) -> None:
        recovery = await asyncio.to_thread(self.disk.open) if self.disk is not None else None
        self._execute(self.core.start(recovery))
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
            self.stop_now()
            raise ConnectionError(f"queue {self.record.name}: could not join its group")

    async def stop(self) -> None:
        self.stop_now()
        member = self.member
        if member is not None and member.stopped is None:
            member.leave()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(member.wait_stopped(), 3.0)

    def stop_now(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for future, _ in self._waiters.values():
            if not future.done():
                future.set_exception(ConnectionAbortedError(f"queue {self.record.name}: the replica stopped"))
        self._waiters.clear()
        self._open_window()
        for consumer in self.consumers.values():
            consumer.discard_unsent()  # not sent yet: the next master delivers them again
        for task in self._tasks:
            task.cancel()
        if self._timer is not None:
            self._timer.cancel()
        if self.disk is not None:
            self.disk.close()
        for table in self.core.on_stopped():
            _free_in_slices(table)

    def on_record(self, record: QueueRecord) -> None:
        """The coordinator's record changed (its Watch)."""
        if not self.stopped:
            self._execute(self.core.on_record(record, now_ms()))

    # ---------------------------------------------------------------- client requests (the master's)

    async def room_to_publish(self) -> None:
        """Return once a publish request may be decided (replica_core.py `may_publish`, the publish
        window), or the replica stopped (publishing then fails as it should)."""
        while not self.stopped and not self.core.may_publish():
            if self._room is None:
                self._room = asyncio.get_running_loop().create_future()
            await self._room

    def _open_window(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def publish_in_order(self, items: list[Publish]) -> asyncio.Future[list[PublishOutcome]]:
        """Decide on `items` now (a publisher's batches are taken in call order); the future completes
        once they are confirmed. While this node's disk alarm is on, persistent messages of a durable
        queue are refused (RESOURCE_EXHAUSTED, with the reason)."""
        self._refuse_persistent_under_disk_alarm(items)
        step_id, outcomes, effects = self.core.publish(items, now_ms())
        future = self._waiter(step_id, outcomes)
        self._execute(effects)
        return future  # type: ignore[return-value]

    def commit(
        self, consumer: str, settlements: list[Settlement], items: list[Publish]
    ) -> asyncio.Future[list[PublishOutcome]]:
        """Decide a transaction now (QueueError, nothing changed, if it is refused); the future completes
        once all of it is confirmed, as a publish's does."""
        self._refuse_persistent_under_disk_alarm(items)
        step_id, outcomes, effects = self.core.commit(consumer, settlements, items, now_ms())
        future = self._waiter(step_id, outcomes)
        self._execute(effects)
        failpoints.reached("transaction.decided")
        return future  # type: ignore[return-value]

    def _refuse_persistent_under_disk_alarm(self, items: list[Publish]) -> None:
        if self.record.durable and any(item.persistent for item in items):
            alarm = self.host.disk_alarm()
            if alarm:
                raise QueueError("RESOURCE_EXHAUSTED", f"queue {self.record.name!r}: {alarm}; persistent messages wait")

    async def consume(self, tag: str, prefetch: int, priority: int) -> Consumer:
        consumer = Consumer(tag)
        self.consumers[tag] = consumer
        try:
            self._execute(self.core.consume(tag, prefetch, priority, now_ms()))
        except QueueError:
            del self.consumers[tag]
            raise
        return consumer

    async def cancel(self, tag: str) -> None:
        if self.consumers.pop(tag, None) is None or not self.is_master:
            return
        with contextlib.suppress(QueueError):
            self._execute(self.core.cancel(tag, now_ms()))

    async def settle(self, tag: str, delivery_tag: int, multiple: bool, kind: str) -> None:
        """Settle one delivery (a unary Settle); returns once the step completed."""
        step_id, error, effects = self.core.settle(tag, [Settlement(delivery_tag, multiple, kind)], now_ms())
        await self._completed(step_id, effects)
        if error is not None:
            raise error

    def settle_now(self, tag: str, settlements: list[Settlement]) -> QueueError | None:
        """Settle a run of deliveries from a consume stream, without waiting (a lost ack is a redelivery)."""
        _, error, effects = self.core.settle(tag, settlements, now_ms())
        self._execute(effects)
        return error

    async def get(self, no_ack: bool) -> Delivery | None:
        step_id, delivery, effects = self.core.get(no_ack, now_ms())
        await self._completed(step_id, effects)
        return delivery

    async def purge(self) -> int:
        step_id, count, effects = self.core.purge(now_ms())
        await self._completed(step_id, effects)
        return count

    def sync_unsynchronised(self) -> None:
        self._execute(self.core.sync_unsynchronised(now_ms()))

    def cancel_syncs(self) -> None:
        self.core.cancel_syncs()

    async def _completed(self, step_id: int, effects: list[Effect]) -> None:
        """Carry out a step's effects and return once it completed."""
        done = self._waiter(step_id, None)
        self._execute(effects)
        await done

    def _waiter(self, step_id: int, value: object) -> asyncio.Future[object]:
        """A future for step `step_id`'s completion; failed at once if the replica has stopped (a caller still
        holding it, e.g. a publish stream that routed here before, must not wait for ever: it retries)."""
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        if self.stopped:
            future.set_exception(ConnectionAbortedError(f"queue {self.record.name}: the replica stopped"))
        else:
            self._waiters[step_id] = (future, value)
        return future

    # ---------------------------------------------------------------- inputs from the ring and the disk

    def _on_member_event(self, event: MemberEvent) -> None:
        if self.stopped:
            return
        core, now = self.core, now_ms()
        if isinstance(event, Joined):
            assert self.member is not None
            self._execute(core.on_joined(self.member.id, event.members, now))
        elif isinstance(event, MembersChanged):
            self._execute(core.on_members_changed(event.births, event.deaths, now))
        elif isinstance(event, GmDeliver):
            if self.member is not None and event.publisher == self.member.id:
                return  # its own broadcasts, decided here: not worth decoding (the master's every message)
            self._execute(core.on_reports(event.publisher, event.first_seq, self._decoded(event), now))
        elif isinstance(event, Stopped):
            self._execute(core.on_member_stopped(event.reason, now))

    def _decoded(self, event: GmDeliver) -> list[Report | MirrorSays | Undecodable]:
        """The reports in `event`, one for each body (an `Undecodable` for one this node cannot read: the
        core decides what that costs, a mirror of its publisher starts over)."""
        reports = wire.decode_all(event.bodies)
        for report in reports:
            if isinstance(report, Undecodable):
                name, publisher = self.record.name, event.publisher
                log.warning("queue %s: a report from %s this node cannot read: %s", name, publisher, report.detail)
        if tracing.enabled() and not self.is_master:
            for report in reports:
                if not isinstance(report, MirrorSays | Undecodable):
                    traces.mirror_applied(self.record.name, self.host.node_id, self.record.gm_group, report)
        return reports

    def _feed(self, step: Callable[[int], list[Effect]]) -> None:
        """An input from the disk or the clock, given the time."""
        if not self.stopped:
            self._execute(step(now_ms()))

    def _tick(self) -> None:
        self._timer, self._timer_due = None, None
        self._feed(self.core.tick)

    # ---------------------------------------------------------------- effects

    def _execute(self, effects: list[Effect]) -> None:
        """Carry out effects in the order the core emitted them; what carrying one out feeds back into the
        core (a disk failing at once) queues behind what is still to do, never ahead of it."""
        if log.isEnabledFor(logging.DEBUG):
            for effect in effects:
                log.debug("queue %s on %s (%s): %s", self.record.name, self.host.node_id, self.status, describe(effect))
        self._to_do.extend(effects)
        if self._executing:
            return
        self._executing = True
        try:
            while self._to_do:
                effect = self._to_do.popleft()
                if not self.stopped or isinstance(effect, Noted):
                    self._carry_out(effect)
        finally:
            self._executing = False
        if self._room is not None and self.core.may_publish():
            self._open_window()
        if self.core.is_master and not self.stopped:
            self.serving.set()
        else:
            self.serving.clear()
        self._arm()

    def _carry_out(self, effect: Effect) -> None:
        if isinstance(effect, Broadcast):
            self._broadcast(effect)
        elif isinstance(effect, AppendToLog | WriteLog | FlushLog | DiscardLog | WatchDisk):
            if self.disk is not None:
                self.disk.apply(effect)
        elif isinstance(effect, UpdateRecord):
            self._spawn(self._update_record(effect))
        elif isinstance(effect, DeleteRecord):
            self._spawn(self.host.delete_record(self.core.record, effect.still))
        elif isinstance(effect, CompleteStep):
            self._complete(effect)
        elif isinstance(effect, ReleaseConfirms):
            for step_id in effect.step_ids:
                self._resolve(step_id)
        elif isinstance(effect, AbandonSteps):
            for step_id in effect.step_ids:
                future, _ = self._waiters.pop(step_id, (None, None))
                if future is not None and not future.done():
                    future.set_exception(ConnectionAbortedError(f"queue {self.record.name}: {effect.reason}"))
        elif isinstance(effect, EndConsumers):
            for consumer in self.consumers.values():
                consumer.deliveries.put_nowait(None)
        elif isinstance(effect, Noted):
            event = effect.event
            level = logging.INFO if event.kind in _QUIET_EVENTS else logging.WARNING
            log.log(level, "queue %s: %s on %s: %s", self.record.name, event.kind, event.node, event.detail)
        elif isinstance(effect, Stop):
            log.info("queue %s: the replica on %s stops: %s", self.record.name, self.host.node_id, effect.reason)
            self.stop_now()
            self.host.replica_stopped(self)
            member = self.member
            if member is not None and member.stopped is None:
                member.leave()

    def _broadcast(self, effect: Broadcast) -> None:
        member = self.member
        assert member is not None
        if tracing.enabled() and effect.confirmed:
            reports = [r for r in effect.reports if not isinstance(r, MirrorSays)]
            traces.enqueued(self.record.name, self.host.node_id, self.record.gm_group, reports)
        taken = functools.partial(self._broadcast_taken, effect.first_seq, effect.confirmed)
        try:
            member.broadcast_then([wire.encode(r) for r in effect.reports], effect.confirmed, taken)
        except ConnectionAbortedError:
            return  # the member stopped: its Stopped event follows

    def _broadcast_taken(self, expected_first: int, confirmed: bool, first: int, last: int) -> None:
        """A broadcast of ours was numbered `first`..`last` and, if `confirmed`, went round the ring."""
        if first != expected_first:
            log.error("queue %s: broadcast numbered %d, expected %d", self.record.name, first, expected_first)
            self._execute(self.core.on_member_stopped("broadcasts out of step with the ring", now_ms()))
        elif confirmed and not self.stopped:
            self._execute(self.core.on_ring_confirmed(last, now_ms()))

    async def _update_record(self, update: UpdateRecord) -> None:
        try:
            record = await self.host.update_record(self.core.record, update.change)
        except grpc.aio.AioRpcError as error:
            # Nobody awaits this task: an exception raised here was only "never retrieved" at exit. A queue
            # deleted meanwhile is normal (its replicas stop when the record's deletion reaches them);
            # anything else is logged, and the core is not told (it asks again only on its next change).
            level = logging.DEBUG if error.code() == grpc.StatusCode.NOT_FOUND else logging.WARNING
            log.log(
                level,
                "queue %s: record update (%s) failed: %s %s",
                self.record.name,
                update.purpose,
                error.code().name,
                error.details(),
            )
            return
        if not self.stopped:
            self._execute(self.core.on_record(record, now_ms()))

    def _complete(self, effect: CompleteStep) -> None:
        step = effect.step
        # Deliveries first: a waiting consumer's stream then writes before the publisher's confirm does
        # (both wake in this order), so the message reaches its consumer one stream write sooner.
        for tag, deliveries in itertools.groupby(step.deliveries, key=_consumer_of):
            consumer = self.consumers.get(tag)
            if consumer is not None:
                consumer.deliveries.put_nowait(list(deliveries))
        if effect.confirmed:
            self._resolve(effect.step_id)
        if self.host.metrics is not None:
            self.host.metrics.step_completed(self.record.name, self.record.gm_group, step, now_ms() - effect.decided_ms)
        if tracing.enabled():
            traces.confirmed(self.record.name, self.host.node_id, step.reports)
            traces.delivered(self.record.name, self.host.node_id, step.deliveries)
        dead: dict[str, list[Publish]] = {}
        for letter in step.dead_letters:
            headers = {**letter.message.headers, "x-death-reason": letter.reason, "x-death-queue": self.record.name}
            dead.setdefault(letter.target, []).append(Publish(letter.message.body, headers=headers))
        for target, items in dead.items():
            self._spawn(self.host.dead_letter(self.record.vhost, target, items))

    def _resolve(self, step_id: int) -> None:
        future, value = self._waiters.pop(step_id, (None, None))
        if future is not None and not future.done():  # a publisher that went away cancelled its wait
            future.set_result(value)

    def _arm(self) -> None:
        """Call tick when the core asks (the timer is left alone while that time does not change)."""
        wakeup = None if self.stopped else self.core.next_wakeup_ms()
        if wakeup == self._timer_due and (self._timer is not None or wakeup is None):
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_due = wakeup
        if wakeup is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, (wakeup - now_ms()) / 1000), self._tick)

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Future[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
