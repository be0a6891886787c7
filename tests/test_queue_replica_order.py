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
from services.queue.master import Publish
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
