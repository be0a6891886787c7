"""A queue replica queues each step's broadcast when the step is decided.

Found by the benchmark: publish steps were decided in order but broadcast
later from tasks, so a depth report decided after a publish could reach the
mirrors first; they then saw a depth that disagreed with theirs, declared
themselves inconsistent and re-synced, and a master dying meanwhile left no
promotable mirror.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from services.coordinator.metadata import QueueRecord
from services.queue import wire
from services.queue.master import Publish, Settlement
from services.queue.metrics import QueueMetrics
from services.queue.ops import Depth, Enqueue
from services.queue.replica import QueueReplica


class FakeMember:
    """Records the order broadcasts are queued in; confirms each at once."""

    id = "node1.aaaaaaaaaaaa"
    stopped = None

    def __init__(self) -> None:
        self.queued: list[list[bytes]] = []

    def broadcast_now(self, bodies: list[bytes], confirmed: bool) -> Awaitable[tuple[int, int]]:
        self.queued.append(bodies)

        async def done() -> tuple[int, int]:
            await asyncio.sleep(0)
            return 1, len(bodies)

        return done()


class FakeHost:
    node_id = "node1"
    metrics: QueueMetrics | None = None
    recovery_wait_s = 1.0

    def new_member(self, group: str, events: Callable[[Any], None]) -> Any:
        raise AssertionError("not used")

    async def update_record(
        self, record: QueueRecord, change: Callable[[QueueRecord], QueueRecord | None]
    ) -> QueueRecord:
        return record

    async def dead_letter(self, vhost: str, queue: str, bodies: list[Publish]) -> None:
        pass

    def queue_dir(self, record: QueueRecord) -> str:
        raise AssertionError("transient queue")


def test_broadcasts_keep_the_order_steps_were_decided_in() -> None:
    async def scenario() -> list[type]:
        replica = QueueReplica(FakeHost(), QueueRecord("/", "q", master="node1", gm_group="queue.x"))
        member = FakeMember()
        replica.member = member  # type: ignore[assignment]
        master = replica.master
        assert master is not None
        confirmed = replica.publish_in_order([Publish(b"one")])  # decided first
        depth = replica._carry_out(master.depth_report())  # decided second
        await asyncio.gather(confirmed, depth)
        return [type(wire.decode(bodies[0])) for bodies in member.queued]

    assert asyncio.run(scenario()) == [Enqueue, Depth]


class SlowCommitter:
    """A group commit that takes a while (a disk): only steps that logged something wait for it."""

    async def commit(self) -> None:
        await asyncio.sleep(0.05)


class FakeLog:
    def __init__(self) -> None:
        self.live: set[int] = set()

    def append_enqueue(self, message_id: int, data: bytes) -> None:
        self.live.add(message_id)

    def append_remove(self, ids: tuple[int, ...]) -> int:
        removed = self.live.intersection(ids)
        self.live -= removed
        return len(removed)

    def append_mark(self, mark: bytes) -> None:
        pass

    def live_count(self) -> int:
        return len(self.live)

    def close(self) -> None:
        pass


def test_deliveries_reach_the_consumer_in_decision_order_when_an_ack_waits_for_the_disk() -> None:
    """Found by the failover test: on a durable queue a step with acks waits for the group commit (the
    acks are logged) and a later publish step did not, so its deliveries (higher tags, later messages)
    overtook the ack step's; the consumer then acked a higher tag with `multiple` first and the lower
    one came back as an unknown delivery tag, and publisher order was broken at the consumer."""

    async def scenario() -> list[int]:
        replica = QueueReplica(FakeHost(), QueueRecord("/", "q", master="node1", gm_group="queue.x"))
        replica.member = FakeMember()  # type: ignore[assignment]
        replica.log = FakeLog()  # type: ignore[assignment]
        replica.committer = SlowCommitter()  # type: ignore[assignment]
        await replica.publish_in_order([Publish(str(i).encode(), persistent=True) for i in (1, 2, 3)])
        consumer = await replica.consume("c", prefetch=2, priority=0)
        for _ in range(2):
            await consumer.deliveries.get()
        # Acks of tags 1 and 2 (logged: this step waits for the disk) let message 3 go out as tag 3 ...
        replica.settle_now("c", [Settlement(2, True, "ack")])
        # ... and message 4, published next (nothing to log), goes out as tag 4.
        await replica.publish_in_order([Publish(b"4")])
        tags = []
        for _ in range(2):
            delivery = await asyncio.wait_for(consumer.deliveries.get(), 5)
            assert delivery is not None
            tags.append(delivery.delivery_tag)
        return tags

    assert asyncio.run(scenario()) == [3, 4]
