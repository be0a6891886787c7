"""Integration: policies are applied live when nodes come and go (issue 4, build item 4).

The coordinator re-places every queue when the set of live nodes changes: under
ha-mode exactly N a dead mirror is replaced on another node, which syncs while
the queue keeps its messages; under ha-mode all a node that comes back gets its
mirror again. It also re-places queues when their records change: a mirror the
master struck while its node stayed alive (paused past the ring's failure
timeout) comes back once the node heartbeats again. The master is never moved
by this (promotion is the queue's own business, with its synchronisation rules).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from ringq import aio
from services import cluster
from tests.clusters import connection, set_policy
from tests.test_integration_durable import _wait_for_status
from tests.test_integration_queue import _start

pytestmark = pytest.mark.integration
MESSAGES = 200


async def _scenario(directory: Path) -> None:
    info = await _start(directory)
    await set_policy(info, "two", "^two\\.", {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"})
    client = connection(info, "node1", "node2", "node3")
    for queue in ("two.orders", "ha.orders"):
        declared = await client.declare_queue(queue, durable=True)
        assert declared.master_node == "node1"
        producer = client.producer(queue, publisher_id=queue, persistent=True)
        assert await producer.publish_many([b"m"] * MESSAGES) == [aio.Outcome.CONFIRMED] * MESSAGES
    two = await _wait_for_status(client, "two.orders", lambda s: len(s.synchronised_mirrors) == 1, 20)
    (mirror,) = two.mirrors
    other = ({"node2", "node3"} - {mirror}).pop()
    await _wait_for_status(client, "ha.orders", lambda s: len(s.synchronised_mirrors) == 2, 20)

    cluster.kill(directory, mirror, signal.SIGKILL)
    # exactly 2: the dead mirror is replaced on the other node, which syncs every message.
    two = await _wait_for_status(client, "two.orders", lambda s: list(s.synchronised_mirrors) == [other], 30)
    assert two.master_node == "node1" and list(two.mirrors) == [other] and two.depth == MESSAGES
    # all: the dead node's mirror is gone with it ...
    await _wait_for_status(client, "ha.orders", lambda s: list(s.mirrors) == [other], 30)

    cluster.start_node(directory, mirror)
    # ... and comes back with it, synchronised again; exactly 2 has its two replicas and stays as it is.
    ha = await _wait_for_status(client, "ha.orders", lambda s: len(s.synchronised_mirrors) == 2, 30)
    assert ha.master_node == "node1" and ha.depth == MESSAGES
    assert list((await client.queue_status("two.orders")).mirrors) == [other]
    await client.close()


async def _paused_mirror(directory: Path) -> None:
    info = await _start(directory)  # ha.* on every node
    client = connection(info, "node1", "node2")
    assert (await client.declare_queue("ha.paused", durable=True)).master_node == "node1"
    producer = client.producer("ha.paused", publisher_id="paused", persistent=True)
    assert await producer.publish_many([b"m"] * MESSAGES) == [aio.Outcome.CONFIRMED] * MESSAGES
    await _wait_for_status(client, "ha.paused", lambda s: len(s.synchronised_mirrors) == 2, 20)

    # Paused past the ring's failure timeout, but not the coordinator's liveness timeout: the
    # master strikes node3's mirror while node3 stays a live node by heartbeat.
    cluster.kill(directory, "node3", signal.SIGSTOP)
    try:
        await _wait_for_status(client, "ha.paused", lambda s: list(s.mirrors) == ["node2"], 20)
    finally:
        cluster.kill(directory, "node3", signal.SIGCONT)
    # node3 heartbeats again: its mirror comes back, and syncs every message.
    back = await _wait_for_status(client, "ha.paused", lambda s: len(s.synchronised_mirrors) == 2, 30)
    assert back.master_node == "node1" and list(back.mirrors) == ["node2", "node3"] and back.depth == MESSAGES
    await client.close()


def _on_a_cluster(tmp_path: Path, scenario: Callable[[Path], Awaitable[None]]) -> None:
    """Run `scenario` on a cluster in tmp_path, stopped afterwards whatever happens."""
    directory = tmp_path / "cluster"
    try:
        asyncio.run(asyncio.wait_for(scenario(directory), 150))
    finally:
        cluster.down(directory)


def test_a_mirror_struck_from_a_paused_node_comes_back(tmp_path: Path) -> None:
    _on_a_cluster(tmp_path, _paused_mirror)


def test_policies_follow_nodes_that_die_and_come_back(tmp_path: Path) -> None:
    _on_a_cluster(tmp_path, _scenario)
