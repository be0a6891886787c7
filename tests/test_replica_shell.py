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
            assert "malformed report" in caplog.text  # another member's is

    asyncio.run(scenario())
