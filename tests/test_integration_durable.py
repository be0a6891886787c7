"""Integration: a durable queue survives a restart of every node (issue 4).

Persistent messages are confirmed only once the master has them on disk.
Kill every node with SIGKILL, start them again: the master recovers from its
log, and every confirmed message that was not acknowledged is delivered;
acknowledged ones do not come back.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from services import cluster
from tests.test_integration_queue import _client, _start

pytestmark = pytest.mark.integration
PUBLISHED = 5_000
ACKED = 1_000


async def _scenario(directory: Path) -> dict[str, float]:
    # Default failure detection: this test is about the disk, not about suspicion
    # while three processes restart at once.
    info = await _start(directory, node_args=[])
    client = _client(info, "node1", "node2", "node3")
    queue = "ha.durable"
    declared = await client.declare(queue, durable=True)
    assert declared.master_node == "node1"
    publisher = client.publisher(queue, persistent=True, window=1000, batch=100)
    await publisher.publish([f"{i:06d}".encode() for i in range(PUBLISHED)])
    acked: set[int] = set()
    async for delivery in client.consume(queue, prefetch=ACKED, resume=False):
        acked.add(delivery.seq)
        if len(acked) == ACKED:
            # Acknowledged (durably: the reply comes after the commit) before the consumer goes.
            assert await client.settle(queue, delivery, multiple=True)
            break
    await client.close()

    for node in ("node1", "node2", "node3"):
        cluster.kill(directory, node, signal.SIGKILL)
    restarted = time.monotonic()
    for node in ("node1", "node2", "node3"):
        cluster.start_node(directory, node)
    info = cluster.load(directory)
    client = _client(info, "node1", "node2", "node3")
    deadline = time.monotonic() + 30
    while True:
        try:
            status = await client.status(queue)
            if status.depth:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the queue did not come back"
        await asyncio.sleep(0.2)
    back_after = time.monotonic() - restarted
    assert status.depth == PUBLISHED - ACKED, f"{status.depth} messages recovered, {PUBLISHED - ACKED} expected"
    delivered: set[int] = set()
    async for delivery in client.consume(queue, prefetch=0, resume=False):
        delivered.add(delivery.seq)
        if len(delivered) == PUBLISHED - ACKED:
            await client.settle(queue, delivery, multiple=True)
            break
    assert delivered == set(range(1, PUBLISHED + 1)) - acked, "exactly the unacknowledged messages came back"
    await client.close()
    return {"back_after": back_after}


def test_a_durable_queue_survives_a_restart_of_every_node(tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    try:
        figures = asyncio.run(asyncio.wait_for(_scenario(directory), 180))
        print(f"the queue served again {figures['back_after']:.1f}s after every node was restarted")
    finally:
        cluster.down(directory)
