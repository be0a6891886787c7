"""Integration: the memory alarm (RabbitMQ's vm_memory_high_watermark). A producer far faster than
its (absent) consumer fills a node up to its watermark: the node stops reading the publish stream,
so the publisher blocks (no confirm, nothing refused) and the node's memory stays near the watermark
instead of growing with the backlog; a consumer draining the queue is served all along, the alarm
clears, the publisher resumes, and every confirmed message is delivered exactly once, in order."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ringq import aio
from services import cluster
from tests.clusters import NODE_ARGS, access, live_cluster

pytestmark = pytest.mark.integration
HEADROOM_MIB = 60  # the watermark: this far above the idle node's memory
BODY = b"m" * 1024


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def _alarm_shown(admin: aio.Admin, on: bool, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        (node,) = (await admin.cluster_status()).nodes
        if node.memory_used_bytes is not None and node.memory_alarm == on:
            return True
        await asyncio.sleep(0.2)
    return False


def test_a_fast_producer_is_blocked_at_the_watermark_and_resumes_after_a_drain(tmp_path: Path) -> None:
    probe = cluster.up(1, tmp_path / "probe", node_args=NODE_ARGS, tls=True)  # the idle node's memory, measured
    idle_mib = _rss_mib(probe.nodes[0].pid)
    cluster.down(tmp_path / "probe")
    watermark_mib = int(idle_mib) + HEADROOM_MIB
    args = [*NODE_ARGS, "--memory-high-watermark-mb", str(watermark_mib)]
    with live_cluster(tmp_path / "cluster", {}, nodes=1, node_args=args) as info:
        node = info.nodes[0]

        async def scenario() -> None:
            connection = aio.Connection([node.address], retry_for=120, **access(info))
            async with connection, aio.Admin(info.node_addresses, **access(info)) as admin:
                await connection.declare_queue("flood")
                producer = connection.producer("flood", window=2000, batch=100)
                published = 0

                async def flood() -> None:
                    nonlocal published
                    while published < 400_000:
                        await producer.publish_many([BODY] * 100)
                        published += 100

                flooding = asyncio.ensure_future(flood())
                # Blocked: the confirmed count stops growing while the node sits at its watermark.
                deadline, last, still_since = time.monotonic() + 120, -1, time.monotonic()
                while time.monotonic() - still_since < 2.0:
                    assert time.monotonic() < deadline, "the producer was never blocked"
                    assert not flooding.done(), "the producer published everything: never blocked"
                    confirmed = producer.next_seq - 1 - producer.unconfirmed
                    if confirmed != last:
                        last, still_since = confirmed, time.monotonic()
                    await asyncio.sleep(0.1)
                blocked_at = last
                assert blocked_at > 10_000, f"blocked after only {blocked_at} messages"
                rss = _rss_mib(node.pid)
                assert rss < watermark_mib + 64, f"the node holds {rss:.0f} MiB, watermark {watermark_mib} MiB"
                assert await _alarm_shown(admin, True), "cluster_status shows the memory alarm"

                # A consumer is served while publishers are blocked; draining frees the memory.
                consumer = connection.consumer("flood", prefetch=2000)
                seen = 0
                async for delivery in consumer:
                    assert int(delivery.seq) == seen + 1, "in order, once each"
                    seen += 1
                    delivery.ack()
                    if seen > blocked_at + 20_000:  # past the blocked point: the publisher resumed
                        break
                await consumer.close()
                flooding.cancel()
                assert await _alarm_shown(admin, False), "the alarm cleared after the drain"

        asyncio.run(asyncio.wait_for(scenario(), 300))
