"""The member shell (services/gm/member.py): what waits on a member is never left waiting when it stops."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.gm.member import MemberShell
from services.gm.messages import Action, Stopped, WatchNeighbours
from services.gm.ring import RingMember


class NoHost:
    flush_interval = 0.002
    join_timeout = 1.0

    def neighbours_changed(self) -> None:
        pass


def test_a_confirmed_broadcast_taken_in_the_pass_that_stops_the_member_fails() -> None:
    """Found by the partition test: a broadcast the core took in the same pass over the inbox as the
    member's stop registered its confirm waiter after _finish had failed every waiter, so the publisher
    behind it was never answered."""

    async def scenario() -> None:
        events: list[Any] = []
        shell = MemberShell(NoHost(), RingMember("g", "node1.a", "node1"), events.append)  # type: ignore[arg-type]
        taken: asyncio.Future[tuple[int, list[Action]]] = asyncio.get_running_loop().create_future()
        done = asyncio.ensure_future(shell._broadcast_done(taken, 1, confirmed=True))
        await asyncio.sleep(0)  # waiting for the core to take it
        taken.set_result((7, []))  # the core took it ...
        shell._finish(Stopped("recorded dead"))  # ... and stopped, before the waiter was registered
        with pytest.raises(ConnectionAbortedError, match="recorded dead"):
            await asyncio.wait_for(done, 1)

    asyncio.run(scenario())


def test_the_host_recomputes_its_links_only_when_a_neighbours_node_changes() -> None:
    """Each view re-read says a member's neighbours again; recomputing the node's wanted links every time
    cost O(members) per view, which with 1,000 idle queues was most of a node's idle CPU (issue 13)."""

    class CountingHost(NoHost):
        calls = 0

        def neighbours_changed(self) -> None:
            self.calls += 1

    async def scenario() -> None:
        host = CountingHost()
        shell = MemberShell(host, RingMember("g", "node1.a", "node1"), lambda event: None)  # type: ignore[arg-type]
        await shell._perform(WatchNeighbours("node2.b", "node2", "node3.c", "node3"))
        await shell._perform(WatchNeighbours("node2.b", "node2", "node3.c", "node3"))  # the same again
        assert host.calls == 1
        await shell._perform(WatchNeighbours("node2.x", "node2", "node3.c", "node3"))  # a new member there
        assert host.calls == 1 and shell.neighbours is not None and shell.neighbours.left == "node2.x"
        await shell._perform(WatchNeighbours("node2.x", "node2", "node4.d", "node4"))  # a new node
        assert host.calls == 2

    asyncio.run(scenario())
