"""Integration: a durable queue survives a restart of every node (issue 4); transient ones do not.

Persistent messages are confirmed only once the master and every synchronised
mirror have them on disk. Kill every node with SIGKILL, start them again: the
master recovers from its log, and every confirmed message that was not
acknowledged is delivered; acknowledged ones do not come back. If the master's
node does not come back, the replica that knows most recovers the queue from
its own log (services/queue/durability.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from ringq import aio
from ringq.errors import NotFound, RingqError
from services import cluster
from tests.clusters import connection
from tests.test_integration_queue import _start

pytestmark = pytest.mark.integration
PUBLISHED = 5_000
ACKED = 1_000


async def _scenario(directory: Path) -> dict[str, float]:
    # Default failure detection: this test is about the disk, not about suspicion
    # while three processes restart at once.
    info = await _start(directory, node_args=[])
    client = connection(info, "node1", "node2", "node3")
    queue = "ha.durable"
    declared = await client.declare_queue(queue, durable=True)
    assert declared.master_node == "node1"
    producer = client.producer(queue, publisher_id="orders", persistent=True, window=1000, batch=100)
    await producer.publish_many([f"{i:06d}".encode() for i in range(PUBLISHED)])
    acked: set[int] = set()
    consumer = client.consumer(queue, prefetch=ACKED)
    async for delivery in consumer:
        acked.add(delivery.seq)
        if len(acked) == ACKED:
            assert delivery.ack(multiple=True)
            break
    # An ack on the consume stream has no reply: wait until the master applied it, then publish a
    # persistent marker, confirmed only once the queue's log is on disk up to it, the ack included.
    deadline = time.monotonic() + 10
    while (await client.queue_status(queue)).depth != PUBLISHED - ACKED:
        assert time.monotonic() < deadline, "the acknowledgement was not applied"
        await asyncio.sleep(0.02)
    marker = client.producer(queue, publisher_id="marker", persistent=True)
    assert await marker.publish(b"marker") == aio.Outcome.CONFIRMED
    # Transient queues beside it, mirrored and not: RabbitMQ deletes them when every replica restarts.
    for transient in ("ha.transient", "solo.transient"):
        await client.declare_queue(transient)
        assert await client.producer(transient).publish(b"gone with the restart") == aio.Outcome.CONFIRMED
    await consumer.close()
    await client.close()

    cluster.kill_together(directory, ["node1", "node2", "node3"], signal.SIGKILL)
    restarted = time.monotonic()
    for node in ("node1", "node2", "node3"):
        cluster.start_node(directory, node)
    info = cluster.load(directory)
    client = connection(info, "node1", "node2", "node3")
    deadline = time.monotonic() + 30
    while True:
        try:
            status = await client.queue_status(queue)
            if status.depth:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the queue did not come back"
        await asyncio.sleep(0.2)
    back_after = time.monotonic() - restarted
    expected = PUBLISHED - ACKED + 1  # with the marker
    assert status.depth == expected, f"{status.depth} messages recovered, {expected} expected"
    delivered: set[tuple[str, int]] = set()
    consumer = client.consumer(queue, prefetch=0)
    async for delivery in consumer:
        delivered.add((delivery.publisher, delivery.seq))
        if len(delivered) == expected:
            delivery.ack(multiple=True)
            break
    orders = producer.scoped_id  # as deliveries show it: scoped to the user on a TLS cluster
    unacknowledged = {(orders, seq) for seq in range(1, PUBLISHED + 1)} - {(orders, seq) for seq in acked}
    assert delivered == unacknowledged | {(marker.scoped_id, 1)}, "exactly the unacknowledged messages came back"
    for transient in ("ha.transient", "solo.transient"):
        await _wait_until_deleted(client, transient, 30)
    await client.close()
    return {"back_after": back_after}


async def _wait_until_deleted(client: aio.Connection, queue: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        status: object
        try:
            status = await client.queue_status(queue)
        except RingqError as error:
            if isinstance(error, NotFound):
                return
            status = error
        assert time.monotonic() < deadline, f"the transient queue {queue} survived the restart: {status}"
        await asyncio.sleep(0.2)


def _on_a_cluster(tmp_path: Path, scenario: Callable[[Path], Awaitable[dict[str, float]]]) -> dict[str, float]:
    """Run `scenario` on a cluster in tmp_path, stopped afterwards whatever happens."""
    directory = tmp_path / "cluster"
    try:
        return asyncio.run(asyncio.wait_for(scenario(directory), 180))
    finally:
        cluster.down(directory)


def test_a_durable_queue_survives_a_restart_of_every_node(tmp_path: Path) -> None:
    figures = _on_a_cluster(tmp_path, _scenario)
    print(f"the queue served again {figures['back_after']:.1f}s after every node was restarted")


async def _wait_for_status(client: aio.Connection, queue: str, ready: Callable[[Any], bool], seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(RingqError):
            last = await client.queue_status(queue)
            if ready(last):
                return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"queue {queue}: still {last} after {seconds} s")


async def _master_stays_away(directory: Path) -> dict[str, float]:
    info = await _start(directory, node_args=["--recovery-wait-ms", "2000"])
    client = connection(info, "node1", "node2", "node3")
    queue = "ha.recovered"
    await client.declare_queue(queue, durable=True)
    await _wait_for_status(client, queue, lambda s: len(s.synchronised_mirrors) == 2, 20)
    producer = client.producer(queue, publisher_id="orders", persistent=True, window=1000, batch=100)
    outcomes = await producer.publish_many([f"{i:06d}".encode() for i in range(PUBLISHED)])
    assert outcomes == [aio.Outcome.CONFIRMED] * PUBLISHED
    await client.close()

    cluster.kill_together(directory, ["node1", "node2", "node3"], signal.SIGKILL)
    restarted = time.monotonic()
    for node in ("node2", "node3"):  # node1, the master, stays away (its disk is gone, say)
        cluster.start_node(directory, node)
    client = connection(cluster.load(directory), "node2", "node3")
    status = await _wait_for_status(client, queue, lambda s: s.master_node in ("node2", "node3") and s.depth, 30)
    back_after = time.monotonic() - restarted
    assert status.depth == PUBLISHED, f"{status.depth} messages recovered, {PUBLISHED} confirmed"
    assert [e.node for e in status.events if e.kind == "recovered"] == [status.master_node], status.events
    delivered: list[int] = []
    consumer = client.consumer(queue, prefetch=0)
    async for delivery in consumer:
        delivered.append(delivery.seq)
        if len(delivered) == PUBLISHED:
            delivery.ack(multiple=True)
            break
    await consumer.close()
    assert delivered == list(range(1, PUBLISHED + 1)), "every confirmed message, once, in order"
    # The other replica started over as a mirror of the new master and synchronises.
    status = await _wait_for_status(client, queue, lambda s: len(s.synchronised_mirrors) == 1, 20)
    # The old master's node comes back at last: a mirror (its old log set aside), synchronised.
    cluster.start_node(directory, "node1")
    recovered_by = status.master_node
    status = await _wait_for_status(client, queue, lambda s: len(s.synchronised_mirrors) == 2, 40)
    assert status.master_node == recovered_by and "node1" in status.mirrors and status.depth == 0
    await client.close()
    return {"back_after": back_after}


def test_a_queue_whose_master_does_not_come_back_is_recovered_by_the_replica_that_knows_most(
    tmp_path: Path,
) -> None:
    figures = _on_a_cluster(tmp_path, _master_stays_away)
    print(f"recovered without its master {figures['back_after']:.1f}s after the restart")
