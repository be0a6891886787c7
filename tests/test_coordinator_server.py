"""CoordinatorService in-process on 127.0.0.1, driven through CoordinatorClient."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from ringq.internal.v1 import coordinator_pb2
from services.coordinator import server as coordinator_server
from services.coordinator.client import CoordinatorClient
from services.coordinator.group_table import (
    AddMember,
    CreateGroup,
    EraseMembers,
    Group,
    GroupMember,
    MarkMemberDead,
    Outcome,
)
from services.coordinator.metadata import QueueRecord
from services.coordinator.server import create_server, stop_upkeep
from services.coordinator.sqlite_store import SqliteStore

A, B, C = GroupMember("a", "n1"), GroupMember("b", "n2"), GroupMember("c", "n3")

Scenario = Callable[[CoordinatorClient], Awaitable[None]]


def run_against_server(tmp_path: Path, scenario: Scenario) -> None:
    async def main() -> None:
        store = SqliteStore(str(tmp_path / "c.db"))
        server, port = await create_server("127.0.0.1:0", store)
        assert port > 0
        try:
            async with CoordinatorClient(f"127.0.0.1:{port}", timeout=5, retry_seconds=5) as client:
                await scenario(client)
        finally:
            await server.stop(None)
            await stop_upkeep()
            store.close()

    asyncio.run(main())


def test_group_changes_and_nodes_round_trip(tmp_path: Path) -> None:
    async def scenario(client: CoordinatorClient) -> None:
        assert await client.read_group("g") == Group("g")
        assert await client.change_group("g", CreateGroup(0, A)) == (Outcome.APPLIED, Group("g", 1, (A,)))
        assert (await client.change_group("g", AddMember(1, "a", B)))[0] is Outcome.APPLIED
        outcome, group = await client.change_group("g", AddMember(2, "a", C))
        assert outcome is Outcome.APPLIED
        assert [m.id for m in group.members] == ["a", "c", "b"]

        # A stale change and a change by a non-member are refused with the current group.
        assert await client.change_group("g", AddMember(1, "a", GroupMember("x", "n9"))) == (
            Outcome.VERSION_CONFLICT,
            group,
        )
        assert await client.change_group("g", MarkMemberDead(3, "b", "ghost")) == (
            Outcome.ACTOR_NOT_ALIVE,
            group,
        )

        outcome, group = await client.change_group("g", MarkMemberDead(3, "c", "a"))
        assert (outcome, group) == (Outcome.APPLIED, Group("g", 4, (A, GroupMember("c", "n3", False), B)))
        outcome, group = await client.change_group("g", EraseMembers(4, ("c",), "b"))
        assert (outcome, group) == (Outcome.APPLIED, Group("g", 5, (A, B)))
        outcome, group = await client.change_group("g", MarkMemberDead(5, "a", "j", joining=True))  # a joiner reports
        assert (outcome, group.version) == (Outcome.APPLIED, 6)
        assert await client.read_group("g") == group

        await client.register_node("n2", "127.0.0.1:7002")
        await client.register_node("n1", "127.0.0.1:7001")
        await client.register_node("n1", "127.0.0.1:7101")
        assert await client.list_nodes() == [("n1", "127.0.0.1:7101"), ("n2", "127.0.0.1:7002")]

    run_against_server(tmp_path, scenario)


Call = Callable[[CoordinatorClient], Awaitable[object]]
NO_NODE = GroupMember("b", "")
DEAD = GroupMember("a", "n1", alive=False)
BAD_REQUESTS = [
    pytest.param(lambda c: c.read_group(""), "group must not be empty", id="empty group"),
    pytest.param(lambda c: c.read_group("bad name!"), "group may contain only", id="illegal characters"),
    pytest.param(lambda c: c.change_group("a/b", CreateGroup(0, A)), "group may contain only", id="slash"),
    pytest.param(lambda c: c.read_group("g" * 201), "group must be at most 200 characters", id="too long"),
    pytest.param(lambda c: c.change_group("g", CreateGroup(0, GroupMember("", "n1"))), "creator.id", id="no id"),
    pytest.param(lambda c: c.change_group("g", CreateGroup(0, DEAD)), "creator.alive", id="dead creator"),
    pytest.param(lambda c: c.change_group("g", AddMember(1, "", B)), "left must not be empty", id="no left"),
    pytest.param(lambda c: c.change_group("g", AddMember(1, "a", NO_NODE)), "newcomer.node", id="no node"),
    pytest.param(lambda c: c.change_group("g", MarkMemberDead(1, "", "a")), "member must not", id="no member"),
    pytest.param(lambda c: c.change_group("g", MarkMemberDead(1, "a", "")), "actor must not", id="no actor"),
    pytest.param(lambda c: c.change_group("g", EraseMembers(1, ("a",), "")), "actor must not", id="no eraser"),
    pytest.param(lambda c: c.change_group("g", EraseMembers(1, (), "a")), "members must name", id="no members"),
    pytest.param(lambda c: c.change_group("g", EraseMembers(1, ("x", ""), "a")), "members[1]", id="members[1]"),
    pytest.param(lambda c: c.register_node("", "127.0.0.1:1"), "node must not be empty", id="empty node"),
    pytest.param(lambda c: c.list_groups("n1\n"), "node must be printable", id="unprintable listing node"),
    pytest.param(
        lambda c: c.call(lambda stub: stub.ListGroups, coordinator_pb2.ListGroupsRequest(after="a/b")),
        "after: group may contain only",
        id="listing after a bad name",
    ),
    pytest.param(lambda c: c.register_node("n1", ""), "address must not be empty", id="empty address"),
]


@pytest.mark.parametrize(("call", "message"), BAD_REQUESTS)
def test_bad_input_is_invalid_argument(tmp_path: Path, call: Call, message: str) -> None:
    async def scenario(client: CoordinatorClient) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(client)
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert message in (raised.value.details() or "")
        assert await client.read_group("g") == Group("g")  # nothing was written

    run_against_server(tmp_path, scenario)


def test_groups_are_listed_by_node_a_page_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes' fallback to the watch: one listing of a node's groups, not a ReadGroup per member."""
    monkeypatch.setattr(coordinator_server, "GROUPS_PAGE", 2)

    async def scenario(client: CoordinatorClient) -> None:
        assert await client.list_groups("n1") == []
        for name in ("g1", "g2", "g3", "g4", "g5"):
            await client.change_group(name, CreateGroup(0, A))
        await client.change_group("h", CreateGroup(0, B))
        await client.change_group("g3", AddMember(1, "a", B))
        await client.change_group("g4", MarkMemberDead(1, "a", "a"))
        for change in (AddMember(1, "a", B), MarkMemberDead(2, "a", "b"), EraseMembers(3, ("a",), "b")):
            assert (await client.change_group("g5", change))[0] is Outcome.APPLIED  # n1's member erased
        on_n1 = await client.list_groups("n1")
        assert [(g.name, g.version) for g in on_n1] == [("g1", 1), ("g2", 1), ("g3", 2), ("g4", 2)]  # dead counts
        assert on_n1 == [await client.read_group(g.name) for g in on_n1]
        assert [g.name for g in await client.list_groups("n2")] == ["g3", "g5", "h"]
        assert [g.name for g in await client.list_groups("")] == ["g1", "g2", "g3", "g4", "g5", "h"]
        page = await client.call(lambda stub: stub.ListGroups, coordinator_pb2.ListGroupsRequest(node="n1", limit=5))
        assert [g.name for g in page.groups] == ["g1", "g2"] and page.next_after == "g2", "at most a page"

    run_against_server(tmp_path, scenario)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_client_waits_for_the_coordinator_to_come_up(tmp_path: Path) -> None:
    async def main() -> None:
        port = free_port()
        store = SqliteStore(str(tmp_path / "c.db"))
        async with CoordinatorClient(f"127.0.0.1:{port}", retry_seconds=10) as client:
            started = time.monotonic()
            pending = asyncio.create_task(client.change_group("g", CreateGroup(0, A)))
            await asyncio.sleep(0.5)
            assert not pending.done()
            server, _ = await create_server(f"127.0.0.1:{port}", store)
            try:
                assert await pending == (Outcome.APPLIED, Group("g", 1, (A,)))
                assert time.monotonic() - started < 5
            finally:
                await server.stop(None)
                await stop_upkeep()
        store.close()

    asyncio.run(main())


def test_client_gives_up_after_retry_seconds() -> None:
    async def main() -> None:
        async with CoordinatorClient(f"127.0.0.1:{free_port()}", retry_seconds=0.5) as client:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await client.read_group("g")
            assert raised.value.code() is grpc.StatusCode.UNAVAILABLE
            assert 0.5 <= time.monotonic() - started < 3

    asyncio.run(main())


def test_a_vhost_holds_at_most_max_queues_per_vhost(tmp_path: Path) -> None:
    """Past the limit a declare gets RESOURCE_EXHAUSTED naming the setting; other vhosts, and declares of
    queues that exist, are unaffected."""

    async def main() -> None:
        store = SqliteStore(str(tmp_path / "coordinator.db"))
        server, port = await create_server("127.0.0.1:0", store, max_queues_per_vhost=3)
        client = CoordinatorClient(f"127.0.0.1:{port}", retry_seconds=1)
        try:
            await client.register_node("n1", "127.0.0.1:7001")
            await client.node_heartbeat("n1")
            for k in range(3):
                await client.declare_queue(QueueRecord("/", f"q{k}"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.declare_queue(QueueRecord("/", "q3"))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-queues-per-vhost 3" in (refused.value.details() or "")
            assert (await client.declare_queue(QueueRecord("/", "q0"))).name == "q0", "an existing one is found"
            await client.declare_queue(QueueRecord("other", "q3"))
        finally:
            await client.close()
            await server.stop(None)
            await stop_upkeep()
            store.close()

    asyncio.run(main())
