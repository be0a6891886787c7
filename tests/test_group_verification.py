"""A node's fallback to the group watch (services/node.py, `Node._verify_groups`).

A real `Node` runs against an in-memory coordinator whose watch the test controls. Its member's group
changes in the table without a watch event (the member is recorded dead behind its back): with the
watch down, the node's periodic listing of its groups tells the member; with the watch up and silent, a
resync event (changes were missed) makes the node list its groups at once. Either way the node lists
its groups in one call, not with a ReadGroup per member (issue 13: 1,000 idle queues made each node
read eight groups a second).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import grpc

from ringq.internal.v1 import coordinator_pb2
from services.coordinator.group_table import Group
from services.gm.member import MemberEvent
from services.gm.messages import Stopped
from services.node import Node, NodeSettings
from tests.test_integration_ring import _wait_for
from tests.test_join_suspicion import MemoryCoordinator

SETTINGS = NodeSettings(heartbeat_interval=0.05, failure_timeout=0.5, grace=0.1)


class WatchedCoordinator(MemoryCoordinator):
    """MemoryCoordinator whose watch is down (no event ever) or up, sending what `events` is given."""

    def __init__(self, watch_up: bool) -> None:
        super().__init__()
        self.groups.clear()
        self.watch_up = watch_up
        self.events: asyncio.Queue[coordinator_pb2.WatchResponse] = asyncio.Queue()
        self.listings = 0
        self.reads = 0

    async def list_groups(self, node: str) -> list[Group]:
        self.listings += 1
        return await super().list_groups(node)

    async def read_group(self, name: str) -> Group:
        self.reads += 1
        return await super().read_group(name)

    async def watch(self, kinds: list[str], after_revision: int) -> AsyncIterator[coordinator_pb2.WatchResponse]:
        if not self.watch_up:
            await asyncio.Event().wait()
        yield coordinator_pb2.WatchResponse(revision=1, kind="node", key="node9")  # the watch is up
        while True:
            yield await self.events.get()


async def _member_recorded_dead_behind_its_back(coordinator: WatchedCoordinator, node: Node) -> list[MemberEvent]:
    """Start a member of group "v" on `node`, then record it dead in the table, without a watch event."""
    events: list[MemberEvent] = []
    member = node.new_member("v", events.append)
    await asyncio.wait_for(member.joined.wait(), 10)
    group = coordinator.groups["v"]
    coordinator.groups["v"] = Group("v", group.version + 1, tuple(replace(m, alive=False) for m in group.members))
    return events


def _stopped(events: list[MemberEvent]) -> bool:
    return any(isinstance(event, Stopped) for event in events)


Scenario = Callable[[WatchedCoordinator, Node], Awaitable[None]]


def _run(coordinator: WatchedCoordinator, membership_check: float, scenario: Scenario) -> None:
    """Run `scenario` with a started node1 of `coordinator`, listing its groups every `membership_check` s
    while its watch is down; the node stops after."""

    async def main() -> None:
        settings = replace(SETTINGS, membership_check=membership_check)
        node = Node("node1", "127.0.0.1:1", coordinator, settings)  # type: ignore[arg-type]
        await node.start()
        try:
            await scenario(coordinator, node)
        finally:
            await node.stop(timeout=1.0)

    asyncio.run(main())


def test_with_the_watch_down_a_member_learns_of_its_death_from_the_nodes_listing() -> None:
    async def scenario(coordinator: WatchedCoordinator, node: Node) -> None:
        events = await _member_recorded_dead_behind_its_back(coordinator, node)
        reads, listings = coordinator.reads, coordinator.listings
        await _wait_for(lambda: _stopped(events), 5, "the member to learn of its death")
        assert coordinator.listings > listings, "the listing told it"
        assert coordinator.reads == reads, "no member read its group for it"

    _run(WatchedCoordinator(watch_up=False), 0.1, scenario)


def test_a_resync_from_the_watch_makes_the_node_list_its_groups_at_once() -> None:
    async def scenario(coordinator: WatchedCoordinator, node: Node) -> None:
        await _wait_for(lambda: node.watching_groups, 5, "the node's watch to be up")
        events = await _member_recorded_dead_behind_its_back(coordinator, node)
        reads = coordinator.reads
        assert coordinator.listings == 0
        coordinator.events.put_nowait(coordinator_pb2.WatchResponse(revision=7, resync=True))
        await _wait_for(lambda: _stopped(events), 5, "the member to learn of its death")
        assert coordinator.listings == 1 and coordinator.reads == reads

    # The periodic listing would come only after a minute: what tells the member is the resync.
    _run(WatchedCoordinator(watch_up=True), 60.0, scenario)


class OlderCoordinator(WatchedCoordinator):
    """A coordinator from before ListGroups."""

    async def list_groups(self, node: str) -> list[Group]:
        self.listings += 1
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "", "")


def test_with_a_coordinator_older_than_the_listing_each_member_reads_its_group() -> None:
    async def scenario(coordinator: WatchedCoordinator, node: Node) -> None:
        events = await _member_recorded_dead_behind_its_back(coordinator, node)
        reads = coordinator.reads
        await _wait_for(lambda: _stopped(events), 5, "the member to learn of its death")
        assert coordinator.listings > 0 and coordinator.reads > reads, "it read its group after the listing failed"

    _run(OlderCoordinator(watch_up=False), 0.1, scenario)
