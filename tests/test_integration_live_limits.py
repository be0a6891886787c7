"""Integration: a policy's limits reach the queues already running (the README says so; a review
found max-length set on a running queue never reached it). max-length set on a queue holding 10
messages drops the 5 oldest at once, and later publishes keep it at 5; clearing the policy lifts it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ringq import aio
from tests.clusters import access, live_cluster

pytestmark = pytest.mark.integration


async def _depth_becomes(connection: aio.Connection, queue: str, depth: int, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while (status := await connection.queue_status(queue)).depth != depth:
        assert time.monotonic() < deadline, f"depth {status.depth}, not {depth}, after {seconds:g} s"
        await asyncio.sleep(0.05)


def test_a_policy_limit_set_and_cleared_reaches_a_running_queue(tmp_path: Path) -> None:
    with live_cluster(tmp_path / "cluster", {}, nodes=1) as info:

        async def scenario() -> None:
            connection = aio.Connection([info.nodes[0].address], retry_for=10, **access(info))
            async with connection, aio.Admin(info.node_addresses, **access(info)) as admin:
                await connection.declare_queue("capped.q")
                producer = connection.producer("capped.q")
                await producer.publish_many([b"%d" % i for i in range(10)])
                await _depth_becomes(connection, "capped.q", 10)
                await admin.set_policy("cap", "^capped\\.", {"max-length": 5})
                await _depth_becomes(connection, "capped.q", 5)
                await producer.publish_many([b"late-%d" % i for i in range(3)])
                await _depth_becomes(connection, "capped.q", 5)
                assert await _bodies(connection, "capped.q") == [b"8", b"9", b"late-0", b"late-1", b"late-2"]
                await admin.clear_policy("cap")
                deadline = time.monotonic() + 10
                while (await connection.queue_status("capped.q")).depth <= 5:
                    assert time.monotonic() < deadline, "clearing the policy did not lift the limit"
                    await producer.publish_many([b"after-clear"])

        asyncio.run(scenario())


async def _bodies(connection: aio.Connection, queue: str) -> list[bytes]:
    bodies: list[bytes] = []
    depth = (await connection.queue_status(queue)).depth
    consumer = connection.consumer(queue, prefetch=depth)
    async for delivery in consumer:
        bodies.append(delivery.body)
        delivery.ack()
        if len(bodies) == depth:
            break
    await consumer.close()
    return bodies
