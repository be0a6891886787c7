"""The coordinator keeps queues placed as their policies say (server._keep_queues_placed), over real
gRPC with nodes faked by heartbeats: a mirror struck from a node that stayed alive comes back, and
one struck from a node that went silent goes elsewhere instead of straight back to it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

from ringq.internal.v1 import coordinator_pb2
from ringq.v1 import cluster_pb2
from tests.test_coordinator_api import _live_nodes, _policy, run

NODES = ("n1", "n2", "n3")
HEARTBEAT_SECONDS = 0.2


class Heartbeats:
    """Fake nodes: a heartbeat for each node of `nodes` every HEARTBEAT_SECONDS."""

    def __init__(self, stub: Any, nodes: Collection[str]) -> None:
        self._stub = stub
        self._nodes = set(nodes)
        self._round = asyncio.Lock()

    async def add(self, node: str) -> None:
        await _live_nodes(self._stub, node)
        self._nodes.add(node)

    async def stop(self, node: str) -> None:
        """No heartbeat from `node` once this returns (none is in flight either)."""
        async with self._round:
            self._nodes.discard(node)

    async def run(self) -> None:
        while True:
            async with self._round:
                for node in sorted(self._nodes):
                    await self._stub.NodeHeartbeat(coordinator_pb2.NodeHeartbeatRequest(node=node))
            await asyncio.sleep(HEARTBEAT_SECONDS)


@contextlib.asynccontextmanager
async def heartbeats(stub: Any, nodes: Collection[str]) -> AsyncIterator[Heartbeats]:
    """Registered nodes `nodes`, heartbeating until the block ends."""
    await _live_nodes(stub, *nodes)
    beating = Heartbeats(stub, nodes)
    task = asyncio.ensure_future(beating.run())
    try:
        yield beating
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _queue(stub: Any, name: str) -> Any:
    return (await stub.GetQueue(coordinator_pb2.GetQueueRequest(name=name))).queue


async def _declared(stub: Any, admin: Any, name: str, policy: dict[str, Any], mirrors: Collection[str]) -> Any:
    await admin.SetPolicy(cluster_pb2.SetPolicyRequest(policy=_policy("p", f"^{name}$", policy)))
    request = coordinator_pb2.DeclareQueueRequest(name=name, preferred_master="n1")
    queue = (await stub.DeclareQueue(request)).queue
    assert (queue.master, list(queue.mirrors)) == ("n1", list(mirrors))
    return queue


async def _strike(stub: Any, queue: Any, node: str) -> Any:
    """What a master does when its mirror's ring member is recorded dead."""
    struck = cluster_pb2.QueueRecord()
    struck.CopyFrom(queue)
    del struck.mirrors[:]
    struck.mirrors.extend(m for m in queue.mirrors if m != node)
    request = coordinator_pb2.UpdateQueueRequest(queue=struck, expected_version=queue.version)
    return (await stub.UpdateQueue(request)).queue


async def _until_mirrors(stub: Any, name: str, mirrors: list[str], why: str) -> Any:
    deadline = time.monotonic() + 15
    while list((queue := await _queue(stub, name)).mirrors) != mirrors:
        assert time.monotonic() < deadline, f"{why}: {queue}"
        await asyncio.sleep(0.05)
    return queue


def test_a_mirror_struck_from_a_node_that_stayed_alive_comes_back(tmp_path: Path) -> None:
    async def scenario(stub: Any, admin: Any) -> None:
        async with heartbeats(stub, ["n1", "n2"]) as beating:
            queue = await _declared(stub, admin, "ha.q", {"ha-mode": "all"}, ["n2"])
            await beating.add("n3")
            queue = await _until_mirrors(stub, "ha.q", ["n2", "n3"], "n3 joined: the placeable nodes changed")
            struck = await _strike(stub, queue, "n3")
            assert list(struck.mirrors) == ["n2"]
            # The placeable nodes stay the same: only the record says n3 needs its mirror back.
            queue = await _until_mirrors(stub, "ha.q", ["n2", "n3"], "n3 never got its mirror back")
            assert queue.master == "n1" and queue.master_epoch == struck.master_epoch

    run(tmp_path, scenario)


def test_a_mirror_struck_from_a_silent_node_goes_to_another_node(tmp_path: Path) -> None:
    async def scenario(stub: Any, admin: Any) -> None:
        async with heartbeats(stub, NODES) as beating:
            queue = await _declared(stub, admin, "two.q", {"ha-mode": "exactly", "ha-params": 2}, ["n2"])
            await beating.stop("n2")  # killed: still alive by its last heartbeat for the liveness timeout
            struck = await _strike(stub, queue, "n2")
            watch = stub.Watch(coordinator_pb2.WatchRequest(kinds=["queue"], after_revision=1))  # every change
            async for event in watch:
                if event.queue.name == "two.q" and event.queue.version > struck.version:
                    break
            watch.cancel()
            assert list(event.queue.mirrors) == ["n3"], "the first re-placement does not go back to n2"
            assert event.queue.master == "n1"

    run(tmp_path, scenario)
