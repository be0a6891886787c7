"""OpenTelemetry end to end: one published message yields one trace whose spans come from the client,
the master and the mirrors, ring hops included (docs/observability.md)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringq import aio, tracing
from services import cluster
from tests.clusters import NODE_ARGS, every_node_live

pytestmark = pytest.mark.integration


@pytest.fixture
def traced_cluster(tmp_path: Path) -> Iterator[tuple[cluster.ClusterInfo, Path]]:
    spans = tmp_path / "spans"
    info = cluster.up(3, tmp_path / "cluster", node_args=[*NODE_ARGS, "--trace-dir", str(spans)])
    try:
        yield info, spans
    finally:
        cluster.down(tmp_path / "cluster")  # SIGTERM: each node flushes its spans


def _spans(directory: Path) -> list[dict[str, object]]:
    files = sorted(directory.glob("spans-*.jsonl"))
    return [json.loads(line) for path in files for line in path.read_text().splitlines()]


def test_one_message_one_trace_across_processes(traced_cluster: tuple[cluster.ClusterInfo, Path]) -> None:
    info, directory = traced_cluster
    assert tracing.configure("ringq-client", "client", str(directory))

    async def scenario() -> None:
        admin = aio.Admin(info.node_addresses)
        await admin.set_policy("ha", "^ha\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
        await admin.close()
        await every_node_live(info)  # the queue is placed on all three
        async with aio.Connection([n.address for n in info.nodes]) as connection:
            await connection.declare_queue("ha.traced")
            deadline = time.monotonic() + 20
            while len((await connection.queue_status("ha.traced")).synchronised_mirrors) < 2:
                assert time.monotonic() < deadline, "mirrors never synchronised"
                await asyncio.sleep(0.1)
            await connection.producer("ha.traced", publisher_id="tracer").publish(b"follow me")
            consumer = connection.consumer("ha.traced", prefetch=1)
            delivery = await anext(aiter(consumer))
            assert delivery.ack()
            await asyncio.sleep(0.3)  # the ack reaches the master
            await consumer.close()

    try:
        asyncio.run(scenario())
    finally:
        tracing.shutdown()  # flush the client's spans; tracing is off again for the tests that follow
    cluster.down(directory.parent / "cluster")

    spans = _spans(directory)
    publish = [s for s in spans if s["name"] == "ringq.publish"]
    assert len(publish) == 1
    trace = [s for s in spans if s["trace_id"] == publish[0]["trace_id"]]
    names = {str(s["name"]) for s in trace}
    processes = {str(s["process"]) for s in trace}
    assert {"ringq.publish", "ringq.enqueue", "ringq.ring.hop", "ringq.mirror.apply", "ringq.confirm"} <= names
    assert {"ringq.deliver", "ringq.receive", "ringq.ack"} <= names
    assert "client" in processes and len(processes) >= 3, processes
    enqueue = next(s for s in trace if s["name"] == "ringq.enqueue")
    attributes = enqueue["attributes"]
    assert isinstance(attributes, dict)
    master = attributes["ringq.node"]
    applied_on = {s["process"] for s in trace if s["name"] == "ringq.mirror.apply"}
    assert len(applied_on) == 2 and master not in applied_on, "each mirror applied it, the master did not"
    hops = [s for s in trace if s["name"] == "ringq.ring.hop"]
    assert {h["process"] for h in hops} >= applied_on, "the report went round the ring through both mirrors"
    assert all(s["parent_span_id"] == publish[0]["span_id"] for s in trace if s["name"] != "ringq.publish")
