"""What a queue replica (services/queue/replica.py) needs from the node hosting it, and what it hands
a consumer.

Responsible for: the contract between a replica and its node (services/queue/manager.py implements it):
creating the replica's GM member, compare-and-set updates and deletes of its queue record, dead letters, where
its log lives, the node's disk alarm, and hearing that the replica stopped (so that it is recreated).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from services.coordinator.metadata import QueueRecord
from services.gm.member import MemberEvent, MemberShell
from services.queue.master import Delivery, Publish
from services.queue.metrics import QueueMetrics
from services.queue.replica_core import ReplicaTimers

if TYPE_CHECKING:
    from services.queue.replica import QueueReplica


class ReplicaHost(Protocol):
    """What a replica needs from its node."""

    node_id: str
    metrics: QueueMetrics | None
    timers: ReplicaTimers

    def new_member(self, group: str, events: Callable[[MemberEvent], None]) -> MemberShell: ...

    async def update_record(
        self, record: QueueRecord, change: Callable[[QueueRecord], QueueRecord | None]
    ) -> QueueRecord: ...

    async def delete_record(self, record: QueueRecord, still: Callable[[QueueRecord], bool]) -> None: ...

    async def dead_letter(self, vhost: str, queue: str, bodies: list[Publish]) -> None: ...

    def queue_dir(self, record: QueueRecord) -> str: ...

    def disk_alarm(self) -> str: ...

    def replica_stopped(self, replica: QueueReplica) -> None:
        """The replica stopped by itself (its member was recorded dead, it lost the queue)."""
        ...


@dataclass
class Consumer:
    """A consumer's deliveries, in delivery order, a step's at a time (one queue item for each step that
    delivered to it, not one for each message); None ends its stream."""

    tag: str
    deliveries: asyncio.Queue[list[Delivery] | None] = field(default_factory=asyncio.Queue)
    # Taken off the queue by its Consume stream and not sent yet (the rest of a run over one response's caps).
    taken: collections.deque[Delivery] = field(default_factory=collections.deque)

    def discard_unsent(self) -> None:
        """Drop every delivery not sent yet (the next master delivers them again) and end the stream."""
        self.taken.clear()
        while not self.deliveries.empty():
            self.deliveries.get_nowait()
        self.deliveries.put_nowait(None)
