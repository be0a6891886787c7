"""The queues of one node: which replicas it runs, kept in step with the coordinator.

Responsible for: starting a replica (master or mirror) for every queue record
that names this node, refreshing replicas when their record changes and
stopping those no longer placed here, all from the coordinator's Watch of
queue records (and one listing at start); compare-and-set updates of queue
records on behalf of replicas (promotion, synchronised mirrors); routing dead
letters to their queue's master.
Guarantees: at most one replica per queue on a node; a record update is
computed from the latest record and retried on a conflict, so concurrent
updates from several replicas never lose one another.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol

import grpc

from ringq import tracing
from services.coordinator.client import CoordinatorClient
from services.coordinator.convert import queue_from_proto
from services.coordinator.metadata import QueueRecord
from services.disk_monitor import DiskMonitor
from services.gm.member import MemberEvent, MemberShell
from services.queue.master import Publish, QueueError, QueueMaster
from services.queue.metrics import QueueMetrics
from services.queue.replica import QueueReplica
from services.queue.replica_core import ReplicaTimers

log = logging.getLogger("ringq.queues")
QueueKey = tuple[str, str]
# A replica that stopped is recreated after this long, doubling up to the maximum while it keeps stopping.
RECREATE_AFTER_S = 0.5
RECREATE_AFTER_MAX_S = 30.0


def queue_dir_name(record: QueueRecord) -> str:
    """The directory name of a queue incarnation's files: a digest of its vhost, name and GM group,
    so no name or record field ever becomes (part of) a path, whatever it holds and however long."""
    identity = json.dumps([record.vhost, record.name, record.gm_group]).encode()
    return "q-" + hashlib.sha256(identity).hexdigest()[:32]


class QueueNode(Protocol):
    """What the manager needs from its node."""

    id: str
    disk: DiskMonitor

    def new_member(self, group: str, events: Callable[[MemberEvent], None]) -> MemberShell: ...


class QueueManager:
    """Runs this node's queue replicas."""

    def __init__(
        self, node: QueueNode, coordinator: CoordinatorClient, data_dir: str = "data", recovery_wait_s: float = 30.0
    ) -> None:
        self.node = node
        self.data_dir = data_dir
        self.timers = ReplicaTimers(recovery_wait_ms=int(recovery_wait_s * 1000))
        self._recreate_after: dict[QueueKey, float] = {}
        self._started_at: dict[QueueKey, float] = {}
        self.node_id = node.id
        self.coordinator = coordinator
        self.replicas: dict[QueueKey, QueueReplica] = {}
        self._starting: dict[QueueKey, asyncio.Future[QueueReplica | None]] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        # Where every queue's master is (placed here or not) and the version of the record that named it, as
        # the record watch last said, and an event set (then replaced) whenever a master moves.
        self.masters: dict[QueueKey, tuple[str, int]] = {}
        self._master_moved = asyncio.Event()
        self.forward_publish: Callable[[QueueRecord, list[Publish]], Awaitable[None]] | None = None
        # Set once every queue the first full listing placed here has had its replica started (joined to its
        # group, or given up on and left to recreate): until then the node's health says NOT_SERVING.
        self.listed = asyncio.Event()
        # The vhost of each GM group a replica here was started for (metrics name queues by vhost and name).
        self._group_vhosts: dict[str, str] = {}
        self.metrics = (
            QueueMetrics(self.node_id, self._masters, lambda group: self._group_vhosts.get(group, ""))
            if tracing.metrics_enabled()
            else None
        )

    def _masters(self) -> Iterator[tuple[str, str, QueueMaster]]:
        for replica in list(self.replicas.values()):
            if replica.master is not None:
                yield replica.record.vhost, replica.record.name, replica.master

    async def start(self) -> None:
        self._spawn(self._follow_records())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for replica in list(self.replicas.values()):
            await replica.stop()

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Future[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --------------------------------------------------------------- records

    async def _follow_records(self) -> None:
        revision = 0
        while True:
            try:
                if revision == 0:
                    for record in await self.coordinator.list_queues():
                        await self.ensure(record)
                    self.listed.set()
                async for event in self.coordinator.watch(["queue"], revision):
                    revision = event.revision
                    if event.resync:
                        revision = 0
                        break
                    if event.deleted:
                        await self._drop_key(event.key)
                    else:
                        await self.ensure(queue_from_proto(event.queue))
            except grpc.aio.AioRpcError as error:
                log.info("the coordinator's queue watch was interrupted (%s): resuming", error.code().name)
            await asyncio.sleep(0.2)

    async def forget(self, key: str) -> None:
        """The queue of record key `key` was deleted: stop its replica here and forget everything kept for it."""
        await self._drop_key(key)

    async def _drop_key(self, key: str) -> None:
        """The queue was deleted: stop its replica here and forget everything kept for it."""
        for queue_key, replica in list(self.replicas.items()):
            if replica.record.key == key:
                del self.replicas[queue_key]
                self._group_vhosts.pop(replica.record.gm_group, None)
                for kept in (self.masters, self._started_at, self._recreate_after):
                    kept.pop(queue_key, None)
                await replica.stop()

    async def ensure(self, record: QueueRecord) -> QueueReplica | None:
        """Run a replica of `record` here if it names this node; returns it (None if not placed here)."""
        key = (record.vhost, record.name)
        self._note_master(key, record.master, record.version)
        placed_here = self.node_id == record.master or self.node_id in record.mirrors
        replica = self.replicas.get(key)
        if replica is not None:
            if placed_here and replica.record.gm_group == record.gm_group:
                replica.on_record(record)
                return replica
            del self.replicas[key]
            await replica.stop()
            if not placed_here:
                return None
        if not placed_here:
            return None
        starting = self._starting.get(key)
        if starting is not None:
            return await asyncio.shield(starting)
        future: asyncio.Future[QueueReplica | None] = asyncio.get_running_loop().create_future()
        self._starting[key] = future
        try:
            replica = QueueReplica(self, record)
            self._group_vhosts[record.gm_group] = record.vhost
            log.info("queue %s: a replica starts on %s (record version %d)", record.name, self.node_id, record.version)
            self._started_at[key] = asyncio.get_running_loop().time()
            await replica.start()
            self.replicas[key] = replica
            future.set_result(replica)
            return replica
        except Exception as error:
            log.warning("queue %s: replica did not start: %r; trying again", record.name, error)
            future.set_result(None)
            self._recreate_later(record)
            return None
        finally:
            del self._starting[key]

    def _note_master(self, key: QueueKey, master: str, version: int) -> None:
        known = self.masters.get(key)
        if known is not None and version < known[1]:
            return  # an older record than the one known
        self.masters[key] = (master, version)
        if known is None or known[0] != master:
            self._master_moved.set()
            self._master_moved = asyncio.Event()

    async def master_moved(self, vhost: str, name: str, master: str, version: int = 0) -> str:
        """Return (the new master) once the records say the queue's master is no longer `master`, in a record
        at least as new as `version` (the one that named `master`): a caller that read a newer record from the
        coordinator than the watch has brought here yet must not take the watch's older master for a move."""
        key = (vhost, name)
        while True:
            known = self.masters.get(key)
            if known is not None and known[0] != master and known[1] >= version:
                return known[0]
            await self._master_moved.wait()

    def replica_stopped(self, replica: QueueReplica) -> None:
        """A replica stopped by itself: recreate it (with back-off) if the record still places it here."""
        key = (replica.record.vhost, replica.record.name)
        if self.replicas.get(key) is not replica:
            return
        del self.replicas[key]
        self._recreate_later(replica.record)

    def _recreate_later(self, record: QueueRecord) -> None:
        key = (record.vhost, record.name)
        loop = asyncio.get_running_loop()
        if loop.time() - self._started_at.get(key, 0.0) > RECREATE_AFTER_MAX_S:
            self._recreate_after.pop(key, None)  # it ran a good while: start the back-off over
        delay = self._recreate_after.get(key, RECREATE_AFTER_S)
        self._recreate_after[key] = min(delay * 2, RECREATE_AFTER_MAX_S)
        self._spawn(self._recreate(record, delay))

    async def _recreate(self, record: QueueRecord, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            current = await self.coordinator.get_queue(record.vhost, record.name)
        except grpc.aio.AioRpcError as error:
            log.info("queue %s: not recreated yet (%s)", record.name, error.code().name)
            self._recreate_later(record)
            return
        if await self.ensure(current) is not None:
            log.info("queue %s: its replica on %s was recreated", record.name, self.node_id)

    def local(self, vhost: str, name: str) -> QueueReplica | None:
        return self.replicas.get((vhost, name))

    # ------------------------------------------------------------ ReplicaHost

    def new_member(self, group: str, events: Callable[[MemberEvent], None]) -> MemberShell:
        return self.node.new_member(group, events)

    def disk_alarm(self) -> str:
        """Why persistent publishes are blocked on this node ("" while its disk has room)."""
        return self.node.disk.reason()

    def queue_dir(self, record: QueueRecord) -> str:
        """Where this node keeps `record`'s messages: per queue incarnation (its GM group)."""
        return os.path.join(self.data_dir, "queues", queue_dir_name(record))

    async def update_record(
        self, record: QueueRecord, change: Callable[[QueueRecord], QueueRecord | None]
    ) -> QueueRecord:
        while True:
            current = await self.coordinator.get_queue(record.vhost, record.name)
            updated = change(current)
            if updated is None:
                return current
            try:
                return await self.coordinator.update_queue(updated, current.version)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.ABORTED:
                    raise

    async def delete_record(self, record: QueueRecord, still: Callable[[QueueRecord], bool]) -> None:
        """Delete `record`'s queue if `still(current record)` (compare-and-set; asked again on a conflict)."""
        while True:
            try:
                current = await self.coordinator.get_queue(record.vhost, record.name)
                if not still(current):
                    return
                await self.coordinator.delete_queue(record.vhost, record.name, current.version)
                return
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    return
                if error.code() != grpc.StatusCode.ABORTED:
                    raise

    async def dead_letter(self, vhost: str, queue: str, items: list[Publish]) -> None:
        """Publish dead letters to their queue (at least once: retried until confirmed)."""
        for attempt in range(50):
            try:
                record = await self.coordinator.get_queue(vhost, queue)
                replica = self.local(vhost, queue)
                if replica is not None and replica.is_master:
                    await replica.publish_in_order(items)
                elif self.forward_publish is not None:
                    await self.forward_publish(record, items)
                return
            except (grpc.aio.AioRpcError, QueueError, ConnectionError) as error:
                log.warning("dead letters for %s not delivered yet (%r), retrying", queue, error)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(min(0.1 * (attempt + 1), 2.0))
        log.error("gave up dead-lettering %d messages to %s", len(items), queue)
