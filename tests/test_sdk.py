"""The Python SDK (clients/python/ringq) against a live 3-node cluster: the blocking and asyncio APIs,
back-pressure, acks on the consume stream, history recording, get/settle, Admin, and errors."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import ringq
from ringq import aio
from services import cluster
from tests.clusters import access, live_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sdk_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    with live_cluster(tmp_path_factory.mktemp("sdk")) as info:
        yield info


def _addresses(info: cluster.ClusterInfo) -> list[str]:
    return [n.address for n in info.nodes]


def test_blocking_publish_consume_ack_with_history(sdk_cluster: cluster.ClusterInfo, tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    connected = ringq.Connection(_addresses(sdk_cluster), name="sdk-test", history=str(history), **access(sdk_cluster))
    with connected as connection:
        info = connection.declare_queue("ha.blocking")
        assert isinstance(info, ringq.models.QueueStatus) and (info.name, info.vhost) == ("ha.blocking", "/")
        assert info.master_node and info.status.startswith("running") and info.depth == 0
        producer = connection.producer("ha.blocking", window=50, batch=20, publisher_id="p1")
        confirmed: list[ringq.Outcome] = []
        lock = threading.Lock()

        def on_confirm(future: object) -> None:
            with lock:
                confirmed.append(future.result())  # type: ignore[attr-defined]

        most_in_flight = 0
        for i in range(2000):
            producer.send(b"m%d" % i, callback=on_confirm)
            most_in_flight = max(most_in_flight, producer.aio.unconfirmed)
        producer.flush()
        assert most_in_flight <= 50, "the window bounds what is unconfirmed (back-pressure)"
        assert confirmed.count(ringq.Outcome.CONFIRMED) == 2000

        consumer = connection.consumer("ha.blocking", prefetch=100)
        seqs = []
        for delivery in consumer:
            assert delivery.publisher == producer.aio.scoped_id and not delivery.redelivered
            seqs.append(delivery.seq)
            assert delivery.ack()
            if len(seqs) == 2000:
                break
        assert seqs == list(range(1, 2001)), "publisher order"
        deadline = time.monotonic() + 10
        while (status := connection.queue_status("ha.blocking")).depth and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status.depth == 0, "acks on the consume stream took effect"
        consumer.close()
    events = [json.loads(line) for line in history.read_text().splitlines()]
    kinds = {kind: sum(1 for e in events if e["event"] == kind) for kind in ("publish", "confirm", "deliver", "ack")}
    assert kinds == {"publish": 2000, "confirm": 2000, "deliver": 2000, "ack": 2000}
    assert {e["client"] for e in events} == {"sdk-test"}


def test_asyncio_api_requeue_get_and_settle(sdk_cluster: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        # Not through the master's node.
        async with aio.Connection(_addresses(sdk_cluster)[1:], **access(sdk_cluster)) as connection:
            await connection.declare_queue("ha.async")
            producer = connection.producer("ha.async")
            assert await producer.publish_many([b"a", b"b", b"c"]) == [aio.Outcome.CONFIRMED] * 3
            consumer = connection.consumer("ha.async", prefetch=1)
            first = await anext(aiter(consumer))
            assert first.body == b"a"
            assert first.nack(requeue=True)
            again = await anext(aiter(consumer))
            assert (again.body, again.redelivered, again.delivery_count) == (b"a", True, 2)
            assert again.ack()
            await consumer.close()
            got = await connection.get("ha.async")
            assert got is not None and got.body == b"b"
            await connection.settle(got)
            assert (await connection.queue_status("ha.async")).depth == 1
            assert await connection.purge_queue("ha.async") == 1

    asyncio.run(scenario())


def test_status_counts_unacked_when_nothing_is_ready(sdk_cluster: cluster.ClusterInfo) -> None:
    """Regression: with every message delivered and none acked, QueueStatus said depth 0 (a queue
    whose ready list is empty is falsy), and `make demo` stopped draining 200-400 messages early."""

    async def scenario() -> None:
        async with aio.Connection(_addresses(sdk_cluster), **access(sdk_cluster)) as connection:
            await connection.declare_queue("ha.unacked")
            await connection.producer("ha.unacked").publish_many([b"1", b"2", b"3"])
            consumer = connection.consumer("ha.unacked", prefetch=10)
            for _ in range(3):
                await anext(aiter(consumer))
            status = await connection.queue_status("ha.unacked")
            assert (status.depth, status.ready, status.unacked) == (3, 0, 3)
            await consumer.close()

    asyncio.run(scenario())


def test_closing_a_consumer_applies_its_acks_first(sdk_cluster: cluster.ClusterInfo) -> None:
    """close() half-closes the consume stream: the queue applies every ack sent, then ends the stream,
    so right after close() the queue is empty (before, acks still queued in the client were lost)."""

    async def scenario() -> None:
        # Through a forwarding node.
        async with aio.Connection(_addresses(sdk_cluster)[2:], **access(sdk_cluster)) as connection:
            await connection.declare_queue("ha.close")
            await connection.producer("ha.close").publish_many([b"%d" % i for i in range(300)])
            consumer = connection.consumer("ha.close", prefetch=300)
            for _ in range(300):
                assert (await anext(aiter(consumer))).ack()
            started = time.monotonic()
            await consumer.close()
            assert time.monotonic() - started < 2.0, "the queue ended the stream: no timeout"
            status = await connection.queue_status("ha.close")
            assert (status.depth, status.consumers) == (0, 0)

    asyncio.run(scenario())


def test_errors_are_ringq_errors(sdk_cluster: cluster.ClusterInfo) -> None:
    with ringq.Connection(_addresses(sdk_cluster), retry_for=2.0, **access(sdk_cluster)) as connection:
        with pytest.raises(ringq.errors.NotFound) as unknown:
            connection.queue_status("no.such.queue")
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND
        assert "no.such.queue" in str(unknown.value) and "\n" not in str(unknown.value), "one line, naming it"
        assert not isinstance(unknown.value, grpc.RpcError)
        connection.declare_queue("ha.args", arguments={"x-single-active-consumer": True})
        with pytest.raises(ringq.errors.PreconditionFailed) as redeclared:
            connection.declare_queue("ha.args", durable=True)
        assert redeclared.value.code == grpc.StatusCode.FAILED_PRECONDITION
        connection.producer("ha.args").publish(b"x")
        consumer = connection.consumer("ha.args", prefetch=1)
        delivery = consumer.next(timeout=10)
        assert delivery is not None
        delivery.delivery_tag += 1000  # a tag the queue never gave: the stream fails with a clear status
        delivery.ack()
        with pytest.raises(ringq.errors.PreconditionFailed) as refused:
            consumer.next(timeout=10)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "unknown delivery tag" in refused.value.details


def test_admin_lists_policies_queues_and_cluster(sdk_cluster: cluster.ClusterInfo) -> None:
    admin = ringq.Admin(sdk_cluster.node_addresses, **access(sdk_cluster))
    try:
        admin.set_policy("ttl", "^ttl\\.", {"message-ttl": 1000}, priority=2)
        policies = {p.name: p for p in admin.list_policies()}
        assert policies["ttl"] == ringq.models.Policy("ttl", "^ttl\\.", {"message-ttl": 1000}, "/", 2, "queues")
        admin.clear_policy("ttl")
        assert "ttl" not in {p.name for p in admin.list_policies()}
        status = admin.cluster_status()
        assert isinstance(status, ringq.models.ClusterStatus) and status.store_kind == "sqlite"
        assert [n.node for n in status.nodes] == ["node1", "node2", "node3"]
        assert all(isinstance(n, ringq.models.NodeStatus) and n.alive for n in status.nodes)
        records = {q.name: q for q in admin.list_queues()}
        assert isinstance(records["ha.blocking"], ringq.models.QueueRecord)  # declared by the first test
        assert records["ha.blocking"].master in {"node1", "node2", "node3"}
    finally:
        admin.close()


def test_producers_and_consumers_are_context_managers(sdk_cluster: cluster.ClusterInfo) -> None:
    """Leaving a producer's block flushes it (every send confirmed) and ends its stream; leaving a consumer's
    applies its acks and cancels it, also when the block raises; the connection has nothing left to close."""
    with ringq.Connection(_addresses(sdk_cluster), **access(sdk_cluster)) as connection:
        connection.declare_queue("ha.ctx")
        with connection.producer("ha.ctx", window=10) as producer:
            futures = [producer.send(b"%d" % i) for i in range(50)]
        assert all(f.done() and f.result() is ringq.Outcome.CONFIRMED for f in futures), "flushed on leaving"
        with connection.consumer("ha.ctx", prefetch=50) as consumer:
            for n, delivery in enumerate(consumer, 1):
                assert delivery.ack()
                if n == 50:
                    break
        status = connection.queue_status("ha.ctx")
        assert (status.depth, status.consumers) == (0, 0), "acks applied, consumer gone"
        assert not connection.aio._closing, "closed producers and consumers are not closed again"

    async def scenario() -> None:
        async with aio.Connection(_addresses(sdk_cluster), **access(sdk_cluster)) as connection:
            async with connection.producer("ha.ctx") as producer:
                await producer.send(b"a")
                await producer.send(b"b")
            assert producer.unconfirmed == 0
            with pytest.raises(RuntimeError, match="while processing"):
                async with connection.consumer("ha.ctx", prefetch=1) as consumer:
                    first = await anext(aiter(consumer))
                    assert first.ack()
                    raise RuntimeError("failed while processing")
            status = await connection.queue_status("ha.ctx")
            assert (status.depth, status.consumers) == (1, 0), "the ack went out before the consumer closed"
            assert not connection._closing

    asyncio.run(scenario())
