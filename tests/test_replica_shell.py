"""The queue replica's asyncio shell (services/queue/replica.py): what it does with the ring's events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from services.coordinator.metadata import QueueRecord
from services.gm.messages import Deliver
from services.queue.master import Publish
from services.queue.metrics import QueueMetrics
from services.queue.replica import QueueReplica
from services.queue.replica_core import ReplicaTimers
from tests.replica_cores import fresh_master


class _Host:
    node_id = "node1"
    metrics: QueueMetrics | None = None
    timers = ReplicaTimers()

    def new_member(self, group: str, events: Callable[[Any], None]) -> Any:
        raise AssertionError("not used")

    async def update_record(
        self, record: QueueRecord, change: Callable[[QueueRecord], QueueRecord | None]
    ) -> QueueRecord:
        return record

    async def delete_record(self, record: QueueRecord, still: Callable[[QueueRecord], bool]) -> None:
        raise AssertionError("not used")

    async def dead_letter(self, vhost: str, queue: str, bodies: list[Publish]) -> None:
        pass

    def queue_dir(self, record: QueueRecord) -> str:
        raise AssertionError("a transient queue")

    def disk_alarm(self) -> str:
        return ""

    def replica_stopped(self, replica: QueueReplica) -> None:
        pass


class _Member:
    id = "node1.aaaa"


def test_the_replica_does_not_decode_its_own_broadcasts(caplog: pytest.LogCaptureFixture) -> None:
    """Found by profiling W1: the master's shell decoded every report the ring handed back for its own
    broadcasts, which the core then ignored (7% of the master's CPU)."""

    async def scenario() -> None:
        replica = QueueReplica(_Host(), QueueRecord("/", "q", master="node1", gm_group="queue.x"))
        replica.member = _Member()  # type: ignore[assignment]
        with caplog.at_level(logging.WARNING, logger="ringq.queue"):
            replica._on_member_event(Deliver("node1.aaaa", 1, [b"\xff not a report"]))
            assert not caplog.records, "its own broadcast was decoded"
            replica._on_member_event(Deliver("node2.bbbb", 1, [b"\xff not a report"]))
            assert "a report from node2.bbbb this node cannot read" in caplog.text  # another member's is

    asyncio.run(scenario())


def test_a_record_update_for_a_deleted_queue_leaves_no_unretrieved_exception(caplog: pytest.LogCaptureFixture) -> None:
    """Found by make bench: a record update racing the queue's deletion raised NOT_FOUND into a task
    nobody awaited; every node then printed "Task exception was never retrieved" with a traceback."""
    import grpc

    from services.queue.replica_core import UpdateRecord

    class _Gone(grpc.aio.AioRpcError):
        def __init__(self) -> None:
            super().__init__(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "no such queue", None)

    class _DeletedHost(_Host):
        async def update_record(
            self, record: QueueRecord, change: Callable[[QueueRecord], QueueRecord | None]
        ) -> QueueRecord:
            raise _Gone()

    async def scenario() -> None:
        unretrieved: list[Any] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        replica = QueueReplica(_DeletedHost(), QueueRecord("/", "q", master="node1", gm_group="queue.x"))
        with caplog.at_level(logging.DEBUG, logger="ringq.queue"):
            replica._spawn(replica._update_record(UpdateRecord(lambda record: record, "mark a mirror")))
            while replica._tasks:
                await asyncio.sleep(0.01)
        assert "record update (mark a mirror) failed: NOT_FOUND" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        del replica
        import gc

        gc.collect()
        assert not unretrieved

    asyncio.run(scenario())


def test_a_stopped_replica_lets_go_of_its_messages_while_it_is_still_referred_to() -> None:
    """Found by a loop watchdog during make bench: a deleted queue's replica, still referred to by its GM
    member's callbacks (a cycle), kept its 250,000 messages until a full collection reached it, which then
    stopped each node's event loop for about 100 ms in the next workload."""
    import weakref

    from services.queue.replica_core import Role

    async def scenario() -> None:
        driven = fresh_master(durable=False)
        replica = QueueReplica(_Host(), driven.record)
        replica.core = driven.core
        assert replica.core.role is Role.MASTER and replica.core.master is not None
        replica.core.publish([Publish(b"m")], 0)
        held = weakref.ref(replica.core.master.core.contents)
        replica.stop_now()
        assert held() is None, "the stopped replica still holds its messages"

    asyncio.run(scenario())


def test_a_stopped_replicas_messages_are_freed_a_slice_at_a_time() -> None:
    """Freeing a deep queue's messages at once stopped each node's event loop for about 100 ms per 250,000
    messages under load: the shell frees them FREE_SLICE_CHUNKS chunks a loop turn."""
    from services.queue.message_table import CHUNK
    from services.queue.replica import FREE_SLICE_CHUNKS

    async def scenario() -> None:
        driven = fresh_master(durable=False)
        replica = QueueReplica(_Host(), driven.record)
        replica.core = driven.core
        assert replica.core.master is not None
        count = (FREE_SLICE_CHUNKS * 2 + 1) * CHUNK  # one chunk more than two slices hold
        replica.core.publish([Publish(b"m") for _ in range(count)], 0)
        table = replica.core.master.core.contents.messages
        assert len(table) == count
        replica.stop_now()
        left = [len(table)]
        while left[-1]:
            await asyncio.sleep(0)
            left.append(len(table))
        freed = [before - after for before, after in zip([count, *left], left, strict=False)]
        assert len(freed) == 3 and all(0 < n <= FREE_SLICE_CHUNKS * CHUNK for n in freed), left

    asyncio.run(scenario())


def test_a_completed_step_wakes_its_consumer_before_its_publisher() -> None:
    """Measured at 2,000 msgs/s (issue 13): the master answered a step's publish before handing out the
    delivery the same step made, so the consume stream's write waited behind the confirm's. A waiting
    consumer now wakes first; the publisher's confirm follows in the same loop turn."""
    from services.queue.master import Delivery, Step
    from services.queue.ops import Message
    from services.queue.replica_core import CompleteStep
    from services.queue.replica_host import Consumer

    async def scenario() -> None:
        replica = QueueReplica(_Host(), QueueRecord("/", "q", master="node1", gm_group="queue.x"))
        consumer = Consumer("c1")
        replica.consumers["c1"] = consumer
        confirm = replica._waiter(7, "confirmed")
        woke: list[str] = []

        async def publisher() -> None:
            await confirm
            woke.append("publisher")

        async def consuming() -> None:
            await consumer.deliveries.get()
            woke.append("consumer")

        waiting = [asyncio.ensure_future(publisher()), asyncio.ensure_future(consuming())]
        await asyncio.sleep(0)  # both wait now, the publisher first
        step = Step(deliveries=[Delivery("c1", 1, Message(1, b"m"), False)])
        replica._complete(CompleteStep(7, step, decided_ms=0, confirmed=True))
        await asyncio.gather(*waiting)
        assert woke == ["consumer", "publisher"]

    asyncio.run(scenario())
