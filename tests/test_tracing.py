"""OpenTelemetry end to end: one published message yields one trace whose spans come from the client,
the master and the mirrors, ring hops included (docs/observability.md). The client's spans go to the
provider the application hands its Connection (the SDK installs none) and are named by the OpenTelemetry
messaging conventions."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from services import cluster
from services.telemetry import JsonLinesSpanExporter
from tests.clusters import NODE_ARGS, connection, every_node_live, scoped, set_policy

pytestmark = pytest.mark.integration


@pytest.fixture
def traced_cluster(tmp_path: Path) -> Iterator[tuple[cluster.ClusterInfo, Path]]:
    spans = tmp_path / "spans"
    info = cluster.up(3, tmp_path / "cluster", node_args=[*NODE_ARGS, "--trace-dir", str(spans)], tls=True)
    try:
        yield info, spans
    finally:
        cluster.down(tmp_path / "cluster")  # SIGTERM: each node flushes its spans


def _spans(directory: Path) -> list[dict[str, object]]:
    files = sorted(directory.glob("spans-*.jsonl"))
    return [json.loads(line) for path in files for line in path.read_text().splitlines()]


def test_one_message_one_trace_across_processes(traced_cluster: tuple[cluster.ClusterInfo, Path]) -> None:
    info, directory = traced_cluster
    provider = TracerProvider()  # the application's: the client's spans go to the same directory as the nodes'
    provider.add_span_processor(
        SimpleSpanProcessor(JsonLinesSpanExporter(directory / "spans-client.jsonl", "client", "ringq-client"))
    )

    async def scenario() -> None:
        await set_policy(info, "ha", "^ha\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
        await every_node_live(info)  # the queue is placed on all three
        async with connection(info, name="tracer", tracer_provider=provider) as connected:
            await connected.declare_queue("ha.traced")
            deadline = time.monotonic() + 20
            while len((await connected.queue_status("ha.traced")).synchronised_mirrors) < 2:
                assert time.monotonic() < deadline, "mirrors never synchronised"
                await asyncio.sleep(0.1)
            await connected.producer("ha.traced", publisher_id="tracer").publish(b"follow me")
            consumer = connected.consumer("ha.traced", prefetch=1)
            delivery = await anext(aiter(consumer))
            assert delivery.ack()
            await asyncio.sleep(0.3)  # the ack reaches the master
            await consumer.close()

    try:
        asyncio.run(scenario())
    finally:
        provider.shutdown()
    cluster.down(directory.parent / "cluster")

    spans = _spans(directory)
    publish = [s for s in spans if s["name"] == "publish ha.traced"]
    assert len(publish) == 1
    assert publish[0]["kind"] == "PRODUCER"
    assert publish[0]["attributes"] == {
        "messaging.system": "ringq",
        "messaging.destination.name": "ha.traced",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.client.id": "tracer",
        "messaging.message.body.size": len(b"follow me"),
        "server.address": "127.0.0.1",
        "server.port": publish[0]["attributes"]["server.port"],  # type: ignore[index]
        "ringq.publisher": scoped(info, "tracer"),  # as the queue keeps it
        "ringq.seq": 1,
        "ringq.outcome": "confirmed",
    }
    trace = [s for s in spans if s["trace_id"] == publish[0]["trace_id"]]
    names = {str(s["name"]) for s in trace}
    processes = {str(s["process"]) for s in trace}
    assert {"publish ha.traced", "ringq.enqueue", "ringq.ring.hop", "ringq.mirror.apply", "ringq.confirm"} <= names
    assert {"ringq.deliver", "receive ha.traced", "ack ha.traced"} <= names
    by_name = {str(s["name"]): s for s in trace}
    assert by_name["receive ha.traced"]["kind"] == "CONSUMER" and by_name["ack ha.traced"]["kind"] == "CLIENT"
    received = by_name["receive ha.traced"]["attributes"]
    assert isinstance(received, dict)
    assert received["messaging.operation.type"] == "receive" and received["messaging.message.id"] == str(
        enqueue_id(trace)
    )
    assert "client" in processes and len(processes) >= 3, processes
    enqueue = next(s for s in trace if s["name"] == "ringq.enqueue")
    attributes = enqueue["attributes"]
    assert isinstance(attributes, dict)
    master = attributes["ringq.node"]
    applied_on = {s["process"] for s in trace if s["name"] == "ringq.mirror.apply"}
    assert len(applied_on) == 2 and master not in applied_on, "each mirror applied it, the master did not"
    hops = [s for s in trace if s["name"] == "ringq.ring.hop"]
    assert {h["process"] for h in hops} >= applied_on, "the report went round the ring through both mirrors"
    assert all(s["parent_span_id"] == publish[0]["span_id"] for s in trace if s is not publish[0])


def enqueue_id(trace: list[dict[str, object]]) -> object:
    """The message id the master's enqueue span gives the message."""
    attributes = next(s for s in trace if s["name"] == "ringq.enqueue")["attributes"]
    assert isinstance(attributes, dict)
    return attributes["ringq.message_id"]
