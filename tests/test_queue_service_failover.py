"""QueueService routing during a failover (services/queue/service.py `_after_failover`): a call for a queue
whose master's node is known dead waits here for the promoted master instead of sending the client away."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc

from ringq.v1 import queue_pb2
from services.coordinator.metadata import QueueRecord
from services.queue import service
from services.queue.service import QueueServicer

RECORD = QueueRecord("/", "q", master="node1", mirrors=("node2", "node3"), gm_group="queue.x")


class _Manager:
    """The records as the node's watch sees them: node1 masters until `promote` names node2."""

    def __init__(self) -> None:
        self.forward_publish: Any = None
        self.record = RECORD
        self.moved = asyncio.Event()

    def local(self, vhost: str, name: str) -> None:
        return None  # this node (node3) hosts no master of it

    async def master_moved(self, vhost: str, name: str, master: str, version: int = 0) -> str:
        while self.record.master == master:
            await self.moved.wait()
        return self.record.master

    def promote(self) -> None:
        self.record = dataclasses.replace(self.record, master="node2", mirrors=("node3",))
        self.moved.set()


class _Coordinator:
    def __init__(self, manager: _Manager) -> None:
        self.manager = manager

    async def get_queue(self, vhost: str, name: str) -> QueueRecord:
        return self.manager.record


def _servicer(manager: _Manager, dead: set[str]) -> QueueServicer:
    async def address_of(node: str) -> str:
        return f"{node}.invalid:1"

    def channel_to(node: str, address: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address)

    return QueueServicer(
        "node3",
        manager,  # type: ignore[arg-type]
        _Coordinator(manager),  # type: ignore[arg-type]
        address_of,
        channel_to,
        node_down=lambda node: node in dead,
    )


REF = queue_pb2.QueueRef(vhost="/", queue="q")


def test_a_call_for_a_queue_whose_masters_node_is_dead_is_routed_to_the_promoted_master() -> None:
    async def scenario() -> None:
        manager = _Manager()
        servicer = _servicer(manager, dead={"node1"})
        found = asyncio.ensure_future(servicer._find(REF))
        await asyncio.sleep(0.05)
        assert not found.done()  # waiting for the promotion, not answering UNAVAILABLE
        manager.promote()
        replica, stub, record = await asyncio.wait_for(found, 1)
        assert replica is None and stub is not None and record.master == "node2"

    asyncio.run(scenario())


def test_a_master_on_a_live_node_is_routed_to_at_once() -> None:
    async def scenario() -> None:
        manager = _Manager()
        _, stub, record = await asyncio.wait_for(_servicer(manager, dead=set())._find(REF), 1)
        assert stub is not None and record.master == "node1"

    asyncio.run(scenario())


def test_without_a_promotion_the_wait_ends_and_the_old_record_is_answered(monkeypatch: Any) -> None:
    monkeypatch.setattr(service, "FAILOVER_WAIT_S", 0.05)

    async def scenario() -> None:
        manager = _Manager()
        _, _, record = await asyncio.wait_for(_servicer(manager, dead={"node1"})._find(REF), 1)
        assert record.master == "node1"  # the forward then fails and the client retries, as before

    asyncio.run(scenario())


def test_a_watch_that_lags_behind_the_coordinator_is_not_taken_for_a_move() -> None:
    """Found by W3's timeline: a node that routed a consume to the promoted master (read from the
    coordinator) ended the relayed stream at once, 'its master moved to node1', because its records watch
    had not brought the promotion yet; the client went on to the dead node and lost 100 ms."""
    from types import SimpleNamespace

    from services.queue.manager import QueueManager

    async def scenario() -> None:
        manager = QueueManager(SimpleNamespace(id="node3"), None, "data")  # type: ignore[arg-type]
        manager._note_master(("/", "q"), "node1", 5)  # the watch, before the promotion
        moved = asyncio.ensure_future(manager.master_moved("/", "q", "node2", 6))  # routed by record 6
        await asyncio.sleep(0.02)
        assert not moved.done()
        manager._note_master(("/", "q"), "node2", 6)  # the watch catches up: no move
        manager._note_master(("/", "q"), "node1", 5)  # an older record changes nothing
        await asyncio.sleep(0.02)
        assert not moved.done()
        manager._note_master(("/", "q"), "node3", 7)
        assert await asyncio.wait_for(moved, 1) == "node3"

    asyncio.run(scenario())
