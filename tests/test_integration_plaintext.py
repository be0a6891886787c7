"""Integration: the plaintext development mode stays. A cluster started without TLS (`ringq cluster up`
without --tls) on loopback serves clients with no TLS and no credentials end to end (a mirrored queue
declared, published to with confirms, consumed and acknowledged), and each of its processes says in its
log that it serves PLAINTEXT, on loopback only. Every other integration test runs with TLS and
authentication on (tests/clusters.py), as production clusters do."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ringq import aio
from services import cluster
from tests.clusters import HA_ALL, live_cluster

pytestmark = pytest.mark.integration
MESSAGES = 100
WARNING = "serving PLAINTEXT on loopback only: no member proves who it is and no client is authenticated"


def test_a_plaintext_cluster_on_loopback_works_end_to_end_and_says_it_is_plaintext(tmp_path: Path) -> None:
    with live_cluster(tmp_path / "cluster", HA_ALL, tls=False) as info:
        assert not info.tls and not info.tls_dir.exists(), "no certificates are made"

        async def scenario() -> list[tuple[bytes, str, int]]:
            async with aio.Connection(info.node_addresses) as connection:  # no TLS, no credentials
                declared = await connection.declare_queue("ha.plain", durable=True)
                assert len(declared.mirrors) == 2, declared
                producer = connection.producer("ha.plain", publisher_id="dev", persistent=True)
                bodies = [b"m%d" % i for i in range(MESSAGES)]
                assert await producer.publish_many(bodies) == [aio.Outcome.CONFIRMED] * MESSAGES
                received: list[tuple[bytes, str, int]] = []
                consumer = connection.consumer("ha.plain", prefetch=MESSAGES)
                async for delivery in consumer:
                    received.append((delivery.body, delivery.publisher, delivery.seq))
                    assert delivery.ack()
                    if len(received) == MESSAGES:
                        break
                await consumer.close()
                assert (await connection.queue_status("ha.plain")).depth == 0, "the acks were applied"
                return received

        received = asyncio.run(asyncio.wait_for(scenario(), 60))
        # No user to scope publisher ids to: a delivery shows the id the producer gave.
        assert received == [(b"m%d" % i, "dev", i + 1) for i in range(MESSAGES)]
        for process in info.processes:
            assert WARNING in process.log.read_text(), f"{process.name} did not log that it serves plaintext"
    assert not any(cluster.is_alive(p) for p in info.processes)
