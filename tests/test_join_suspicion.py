"""A failed join request is a suspicion, not a death (services/node.py, services/gm/member.py).

A real `Node` (the joiner's) runs against an in-memory coordinator and asks a stand-in for the
node hosting its join target: a gRPC server whose links are a real LinkManager (heartbeats, as a
live node sends) and whose AddOnRight each test scripts. Checked: a target that answers
UNAVAILABLE for longer than the failure timeout while its node heartbeats, then answers, is never
reported down and nobody is recorded dead; a target whose node stays silent is recorded dead, and
not before the failure timeout plus the grace; a node answering that it does not host the target
gets it recorded dead at once. Each death is logged with its reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from ringq.internal.v1 import coordinator_pb2, peer_pb2, peer_pb2_grpc
from services.coordinator import group_table
from services.coordinator.convert import group_to_proto
from services.coordinator.group_table import AddMember, Group, GroupChange, GroupMember, MarkMemberDead, Outcome
from services.gm.links import LinkManager
from services.gm.member import MemberEvent
from services.node import JOIN_TIMEOUT_FLOOR_SECONDS, Node, NodeSettings
from tests.test_integration_ring import _wait_for

GROUP = "g"
TARGET = "node2.target"
SETTINGS = NodeSettings(heartbeat_interval=0.05, failure_timeout=0.5, grace=0.1)


class MemoryCoordinator:
    """The coordinator calls a Node makes, over an in-memory group table; records every change's time."""

    def __init__(self) -> None:
        self.groups = {GROUP: Group(GROUP, 1, (GroupMember(TARGET, "node2"),))}
        self.addresses: dict[str, str] = {}
        self.changes: list[tuple[float, GroupChange]] = []

    async def register_node(
        self, node: str, address: str, cluster_address: str = "", certificate_address: str = ""
    ) -> None:
        self.addresses[node] = address

    async def node_heartbeat(self, node: str, disk: object = None, memory: object = None) -> bool:
        return False  # not draining

    async def list_nodes(self) -> list[tuple[str, str]]:
        return list(self.addresses.items())

    async def read_group(self, name: str) -> Group:
        return self.groups.get(name, Group(name))

    async def list_groups(self, node: str) -> list[Group]:
        return [group for _, group in sorted(self.groups.items()) if any(m.node == node for m in group.members)]

    async def change_group(self, name: str, change: GroupChange) -> tuple[Outcome, Group]:
        self.changes.append((time.monotonic(), change))
        outcome, self.groups[name] = group_table.apply(await self.read_group(name), change)
        return outcome, self.groups[name]

    async def watch(self, kinds: list[str], after_revision: int) -> AsyncIterator[coordinator_pb2.WatchResponse]:
        await asyncio.Event().wait()  # no events: members read the table themselves
        yield coordinator_pb2.WatchResponse()

    async def close(self) -> None:
        pass

    def deaths(self) -> list[tuple[float, str]]:
        """(when, whom) of every MarkMemberDead written."""
        return [(at, change.member) for at, change in self.changes if isinstance(change, MarkMemberDead)]


class UnavailableFor:
    """A script for TargetNode.answer: UNAVAILABLE for `seconds` after the first request, then add the newcomer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.first_request: float | None = None

    def __call__(self) -> grpc.StatusCode | None:
        now = time.monotonic()
        if self.first_request is None:
            self.first_request = now
        return grpc.StatusCode.UNAVAILABLE if now - self.first_request < self.seconds else None


class TargetNode(peer_pb2_grpc.PeerServiceServicer):
    """node2, hosting TARGET: `answer` scripts AddOnRight (None: add the newcomer); `paused` makes it
    accept connections and then say nothing at all, like a SIGSTOPped process."""

    def __init__(self, coordinator: MemoryCoordinator, answer: Callable[[], grpc.StatusCode | None]) -> None:
        self.coordinator = coordinator
        self.answer = answer
        self.paused = False
        self.requests = 0
        self.links = LinkManager("node2", "incarnation", self._no_address, lambda *_: None, lambda _: None, 0.05)
        self.server = grpc.aio.server()

    @staticmethod
    async def _no_address(node: str) -> str | None:
        return None

    async def start(self) -> None:
        port = self.server.add_insecure_port("127.0.0.1:0")
        peer_pb2_grpc.add_PeerServiceServicer_to_server(self, self.server)
        await self.server.start()
        await self.coordinator.register_node("node2", f"127.0.0.1:{port}")

    async def stop(self) -> None:
        await self.links.close()
        await self.server.stop(grace=None)

    async def Link(self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:  # type: ignore[override]
        if self.paused:
            await asyncio.Event().wait()
        await self.links.accept(context)

    async def AddOnRight(
        self, request: peer_pb2.AddOnRightRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> peer_pb2.AddOnRightResponse:
        self.requests += 1
        if self.paused:
            await asyncio.Event().wait()
        status = self.answer()
        if status is not None:
            await context.abort(status, f"scripted {status.name}")
        group = await self.coordinator.read_group(request.group)
        newcomer = GroupMember(request.newcomer, request.newcomer_node)
        _, group = await self.coordinator.change_group(request.group, AddMember(group.version, TARGET, newcomer))
        return peer_pb2.AddOnRightResponse(group=group_to_proto(group))


@dataclass
class JoinOutcome:
    """What the join came to, before the joiner's node stopped (and its member left)."""

    started: float  # when the member started joining
    finished: float  # when the join settled
    deaths: list[tuple[float, str]]  # (when, whom) of every MarkMemberDead written
    group: Group


async def _join(
    answer: Callable[[], grpc.StatusCode | None], *, paused: bool, until: Callable[[MemoryCoordinator], bool]
) -> JoinOutcome:
    """Start node1's member of GROUP (whose one live member is TARGET on node2) and wait for `until`."""
    coordinator = MemoryCoordinator()
    target = TargetNode(coordinator, answer)
    target.paused = paused
    await target.start()
    node = Node("node1", "127.0.0.1:1", coordinator, SETTINGS)  # type: ignore[arg-type]
    await node.start()
    events: list[MemberEvent] = []
    started = time.monotonic()
    node.new_member(GROUP, events.append)
    try:
        await _wait_for(lambda: until(coordinator), 10, "the join to settle")
        assert target.requests > 0
        return JoinOutcome(started, time.monotonic(), coordinator.deaths(), coordinator.groups[GROUP])
    finally:
        await node.stop(timeout=1.0)
        await target.stop()


def test_a_target_answering_unavailable_past_the_failure_timeout_while_its_node_lives_is_not_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bug: the joiner's channel to the target's node failed fast (UNAVAILABLE) until the failure
    timeout ran out, and the live target was recorded dead. Its node heartbeats on the link: no suspicion."""
    caplog.set_level(logging.INFO)
    unavailable = UnavailableFor(2 * (SETTINGS.failure_timeout + SETTINGS.grace))

    async def scenario() -> None:
        def joined(coordinator: MemoryCoordinator) -> bool:
            return len(coordinator.groups[GROUP].alive_ids()) == 2 or bool(coordinator.deaths())

        outcome = await _join(unavailable, paused=False, until=joined)
        assert outcome.deaths == [], "a live join target was recorded dead"
        assert outcome.group.alive_ids() == [TARGET, outcome.group.members[1].id]
        assert outcome.group.members[1].node == "node1"
        assert unavailable.first_request is not None
        assert outcome.finished - unavailable.first_request >= unavailable.seconds, "it answered UNAVAILABLE throughout"

    asyncio.run(scenario())
    assert not [
        message for message in caplog.messages if TARGET in message and ("dead" in message or "down" in message)
    ]


def test_a_target_whose_node_stays_silent_is_recorded_dead_after_the_timeout_and_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        outcome = await _join(lambda: None, paused=True, until=lambda c: bool(c.deaths()))
        ((recorded_at, member),) = outcome.deaths
        assert member == TARGET
        waited = recorded_at - outcome.started
        assert waited >= SETTINGS.failure_timeout + SETTINGS.grace, f"recorded dead after {waited:.2f} s"

    asyncio.run(scenario())
    (line,) = [message for message in caplog.messages if f"recorded {TARGET} dead" in message]
    assert line.startswith(f"group {GROUP}: recorded {TARGET} dead (reason: join target {TARGET} on node2 down (silent")


def test_a_target_its_node_does_not_host_is_recorded_dead_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """NOT_FOUND is an answer: the node lives and says the member is gone (the node restarted)."""
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        outcome = await _join(lambda: grpc.StatusCode.NOT_FOUND, paused=False, until=lambda c: bool(c.deaths()))
        ((recorded_at, member),) = outcome.deaths
        assert member == TARGET
        assert recorded_at - outcome.started < SETTINGS.failure_timeout, "no need to wait out the failure timeout"

    asyncio.run(scenario())
    assert (
        f"group {GROUP}: recorded {TARGET} dead (reason: join target {TARGET} on node2 down "
        "(its node answered that it does not host it))"
    ) in caplog.messages


def test_a_short_failure_timeout_does_not_shorten_the_wait_for_a_joining_catchup() -> None:
    """Found by a clean-clone CI run: with a 0.6 s failure timeout a newcomer gave up after 1.2 s on the
    joining Catchup of a live adder that the loaded machine had not got round to sending, recorded itself
    dead and joined again. Twice the failure timeout still applies above the floor."""
    quick = Node("node1", "127.0.0.1:1", None, NodeSettings(failure_timeout=0.6))  # type: ignore[arg-type]
    assert quick.join_timeout == JOIN_TIMEOUT_FLOOR_SECONDS >= 3.0
    slow = Node("node1", "127.0.0.1:1", None, NodeSettings(failure_timeout=5.0))  # type: ignore[arg-type]
    assert slow.join_timeout == 10.0
