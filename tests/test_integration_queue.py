"""Integration: mirrored queues on a cluster of real node processes.

Basic operations through any node (forwarding to the master), several ready
deliveries per Consume response, publishing that goes on behind a consumer
that stopped acknowledging, bad input with clear statuses, and the
failover acceptance test of issue 4: 100,000 messages published with confirms
while the master is killed with SIGKILL; every confirmed message is delivered
afterwards, none twice to the application (an idempotent publisher's retries
are dropped), in publisher order except redeliveries, which carry the flag.
Once with the consumer idle during the kill, once with it running.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ringq import aio
from ringq.v1 import queue_pb2
from services import cluster
from services.queue.service import MAX_DELIVERIES_PER_RESPONSE
from tests.clusters import NODE_ARGS, connection, every_node_live, set_policy

pytestmark = pytest.mark.integration
TOTAL = 100_000


async def _start(directory: Path, node_args: list[str] | None = None) -> cluster.ClusterInfo:
    """A 3-node TLS cluster whose queues named ha.* are mirrored on every node, synced automatically."""
    info = cluster.up(3, directory, node_args=NODE_ARGS if node_args is None else node_args, tls=True)
    await set_policy(info, "ha", "^ha\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
    await every_node_live(info)
    return info


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    directory = tmp_path_factory.mktemp("queues")
    try:
        yield asyncio.run(_start(directory))
    finally:
        cluster.down(directory)


async def _code(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    raise AssertionError("the call succeeded")


def test_a_large_message_goes_through_a_relaying_node(shared_cluster: cluster.ClusterInfo) -> None:
    """Found by review: nodes relayed queue calls on channels limited to the ring's 8 MiB frames, so a
    message between 8 and 16 MiB (the body limit) failed when published or consumed through a node
    that is not the master's."""

    async def scenario() -> None:
        on1, on3 = connection(shared_cluster, "node1"), connection(shared_cluster, "node3")
        await on1.declare_queue("large")  # master on node1
        body = bytes(range(256)) * (12 * 1024 * 1024 // 256)  # 12 MiB
        producer = on3.producer("large")  # relayed by node3
        assert await producer.publish(body) == aio.Outcome.CONFIRMED
        consumer = on3.consumer("large", prefetch=1)  # relayed by node3
        delivery = await asyncio.wait_for(anext(aiter(consumer)), 30)
        assert delivery.body == body
        assert delivery.ack()
        await consumer.close()
        await on1.close()
        await on3.close()

    asyncio.run(scenario())


def test_queue_operations_through_any_node(shared_cluster: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        on1, on2, on3 = (connection(shared_cluster, n) for n in ("node1", "node2", "node3"))
        info = await on1.declare_queue("plain")
        assert info.master_node == "node1" and list(info.mirrors) == []
        producer = on2.producer("plain")  # forwarded to node1
        assert await producer.publish_many([b"m1", b"m2", b"m3"]) == [aio.Outcome.CONFIRMED] * 3
        got = await on3.get("plain", no_ack=True)
        assert got is not None and got.body == b"m1"
        consumer = on2.consumer("plain", prefetch=1)  # forwarded to node1, settlements too
        delivery = await anext(aiter(consumer))
        assert delivery.body == b"m2" and not delivery.redelivered
        assert delivery.nack(requeue=True)
        again = await anext(aiter(consumer))
        assert again.body == b"m2" and again.redelivered and again.delivery_count == 2
        assert again.ack()
        held = await anext(aiter(consumer))  # with prefetch 1, m3 comes only once m2 is acknowledged
        assert held.body == b"m3" and not held.redelivered
        await consumer.close()  # cancels the consumer: m3, which it held, goes back
        while (await on1.queue_status("plain")).consumers:
            await asyncio.sleep(0.02)
        assert await on3.purge_queue("plain") == 1
        assert await on2.delete_queue("plain") == 0
        for opened in (on1, on2, on3):
            await opened.close()

    asyncio.run(scenario())


def test_a_producers_headers_reach_the_consumer_and_a_message_sent_without_has_none(
    shared_cluster: cluster.ClusterInfo,
) -> None:
    async def scenario() -> None:
        client = connection(shared_cluster, "node1")
        await client.declare_queue("headers")
        producer = client.producer("headers")
        with_headers = await producer.send(b"with", headers={"k": "v", "n": "1"})
        assert [await with_headers, await producer.publish(b"without")] == [aio.Outcome.CONFIRMED] * 2
        first, second = await client.get("headers", no_ack=True), await client.get("headers", no_ack=True)
        assert first is not None and first.body == b"with" and first.headers == {"k": "v", "n": "1"}
        assert second is not None and second.body == b"without" and second.headers == {}
        await client.delete_queue("headers")
        await client.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("through", ["node1", "node2"], ids=["on-the-master", "forwarded"])
def test_consume_responses_carry_the_ready_deliveries_in_order(
    shared_cluster: cluster.ClusterInfo, through: str
) -> None:
    """Messages that wait for a consumer reach it several per response (the master's node hands out what is
    ready at once), each once, in order, with increasing delivery tags; through a forwarding node too."""
    count = 300  # more than one response holds

    async def scenario() -> None:
        on1, client = connection(shared_cluster, "node1"), connection(shared_cluster, through)
        queue = f"batched.{through}"
        assert (await on1.declare_queue(queue)).master_node == "node1"
        bodies = [f"m{seq}".encode() for seq in range(1, count + 1)]
        assert await on1.producer(queue).publish_many(bodies) == [aio.Outcome.CONFIRMED] * count
        call = client.stub().Consume()
        await call.write(queue_pb2.ConsumeRequest(queue=client.ref(queue), prefetch=count))
        responses: list[queue_pb2.ConsumeResponse] = []
        while sum(len(r.deliveries) for r in responses) < count:
            response = await asyncio.wait_for(call.read(), 10)
            assert response is not grpc.aio.EOF, "the stream ended early"  # type: ignore[attr-defined]
            responses.append(response)
        sizes = [len(r.deliveries) for r in responses]
        assert sizes[0] > 1, f"the ready messages came one per response: {sizes[:10]}"
        assert max(sizes) <= MAX_DELIVERIES_PER_RESPONSE, sizes
        deliveries = [d for r in responses for d in r.deliveries]
        assert [d.body for d in deliveries] == bodies, "each message once, in order"
        tags = [d.delivery_tag for d in deliveries]
        assert tags == sorted(set(tags)), "delivery tags increase"
        assert not any(d.redelivered for d in deliveries)
        last = queue_pb2.Settlement(delivery_tag=tags[-1], multiple=True, kind=queue_pb2.SETTLE_KIND_ACK)
        await call.write(queue_pb2.ConsumeRequest(settlements=[last]))
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF  # type: ignore[attr-defined]
        assert await call.code() == grpc.StatusCode.OK
        assert (await client.queue_status(queue)).depth == 0, "the acks were applied before the stream ended"
        await on1.delete_queue(queue)
        for opened in (on1, client):
            await opened.close()

    asyncio.run(scenario())


def test_publishing_goes_on_behind_a_consumer_that_stopped_acknowledging(shared_cluster: cluster.ClusterInfo) -> None:
    """The publish window shrinks while ready messages wait behind a consumer holding its full prefetch
    (replica_core.py `may_publish`), to one request's worth at least: a backlog many times the window
    (here 2,000 messages behind a prefetch of 10, whose window is 256) is still confirmed, in order,
    and one acknowledgement lets the consumer go on from where it stopped."""
    count, prefetch = 2_000, 10

    async def scenario() -> None:
        client = connection(shared_cluster, "node1")
        queue = "ha.stalled"
        await client.declare_queue(queue)
        consumer = client.consumer(queue, prefetch=prefetch)
        stream = aiter(consumer)
        producer = client.producer(queue)
        first = await producer.publish(b"m0")
        assert first == aio.Outcome.CONFIRMED
        taken = [await asyncio.wait_for(anext(stream), 10)]
        deadline = time.monotonic() + 10
        while (await client.queue_status(queue)).unacked < 1:
            assert time.monotonic() < deadline, "the consumer was not handed its first message"
            await asyncio.sleep(0.02)
        bodies = [f"m{seq}".encode() for seq in range(1, count)]
        outcomes = await asyncio.wait_for(producer.publish_many(bodies), 60)
        assert outcomes == [aio.Outcome.CONFIRMED] * (count - 1), "every publish confirmed behind the backlog"
        status = await client.queue_status(queue)
        assert (status.unacked, status.ready) == (prefetch, count - prefetch), status
        while len(taken) < prefetch:
            taken.append(await asyncio.wait_for(anext(stream), 10))
        assert [d.body for d in taken] == [f"m{seq}".encode() for seq in range(prefetch)]
        taken[-1].ack(multiple=True)
        after = await asyncio.wait_for(anext(stream), 10)
        assert after.body == f"m{prefetch}".encode(), "the consumer goes on from where it stopped"
        await consumer.close()
        await client.delete_queue(queue)
        await client.close()

    asyncio.run(scenario())


def test_bad_input_gets_clear_statuses(shared_cluster: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        client = connection(shared_cluster, "node2")
        stub = client.stub()
        code, message = await _code(stub.QueueStatus(queue_pb2.QueueStatusRequest(queue=client.ref("no-such-queue"))))
        assert code == grpc.StatusCode.NOT_FOUND and "no-such-queue" in message
        await client.declare_queue("strict", durable=True)
        code, message = await _code(stub.DeclareQueue(queue_pb2.DeclareQueueRequest(queue=client.ref("strict"))))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "durable" in message
        declare = queue_pb2.DeclareQueueRequest(queue=client.ref("x"), arguments={"x-max-length": "ten"})
        code, message = await _code(stub.DeclareQueue(declare))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "x-max-length" in message
        settle = queue_pb2.SettleRequest(
            queue=client.ref("strict"), consumer_tag="c", delivery_tag=7, kind=queue_pb2.SETTLE_KIND_ACK
        )
        code, message = await _code(stub.Settle(settle))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "delivery tag 7" in message
        settle.kind = queue_pb2.SETTLE_KIND_UNSPECIFIED
        code, _ = await _code(stub.Settle(settle))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        for bad, expected in (
            (queue_pb2.PublishRequest(queue=client.ref("strict")), "messages must not be empty"),
            (
                queue_pb2.PublishRequest(
                    queue=client.ref("strict"), messages=[queue_pb2.OutgoingMessage(body=b"x" * (16 * 1024 * 1024 + 1))]
                ),
                "messages[0].body",
            ),
        ):
            call = stub.Publish()
            await call.write(bad)
            code, message = await _code(call.read())
            assert code == grpc.StatusCode.INVALID_ARGUMENT and expected in message
        status = await client.queue_status("strict")
        assert status.depth == 0, "nothing was added by the refused requests"
        await client.close()

    asyncio.run(scenario())


async def _failover(directory: Path, consume_during: bool) -> dict[str, float]:
    info = await _start(directory)
    client = connection(info, "node1", "node2", "node3")
    queue = "ha.orders"
    declared = await client.declare_queue(queue, durable=True)
    master = declared.master_node
    deadline = time.monotonic() + 20
    while len((status := await client.queue_status(queue)).synchronised_mirrors) < 2:
        assert time.monotonic() < deadline, f"mirrors did not synchronise: {status}"
        await asyncio.sleep(0.1)
    producer = client.producer(queue, window=2000, batch=200)
    seen: dict[int, int] = {}  # seq -> deliveries
    order_violations: list[tuple[int, int]] = []
    redelivered = 0
    last_fresh = 0
    consumer = connection(info, *[n.name for n in info.nodes if n.name != master])

    async def consume(until: int) -> None:
        nonlocal redelivered, last_fresh
        unsettled = 0
        deliveries = consumer.consumer(queue, prefetch=1000)
        async for delivery in deliveries:
            seq = delivery.seq
            if delivery.redelivered:
                redelivered += 1
            elif seq <= last_fresh:
                order_violations.append((last_fresh, seq))
            else:
                last_fresh = seq
            seen[seq] = seen.get(seq, 0) + 1
            unsettled += 1
            if unsettled == 200 or len(seen) >= until:  # acknowledge in batches, as consumers do
                delivery.ack(multiple=True)  # False for a delivery of a stream gone with the master: it comes back
                unsettled = 0
            if len(seen) >= until:
                break
        await deliveries.close()

    def confirmed() -> int:
        return producer.next_seq - 1 - producer.unconfirmed

    consuming = asyncio.ensure_future(consume(TOTAL)) if consume_during else None
    started = time.monotonic()
    bodies = [f"{i:08d}".encode().ljust(256, b".") for i in range(TOTAL)]
    publishing = asyncio.ensure_future(producer.publish_many(bodies))
    while confirmed() < TOTAL * 0.3:
        await asyncio.sleep(0.02)
    cluster.kill(directory, master, signal.SIGKILL)
    killed_at = time.monotonic()
    outcomes = await asyncio.wait_for(publishing, 120)
    published_in = time.monotonic() - started
    if consuming is None:
        consuming = asyncio.ensure_future(consume(TOTAL))
    await asyncio.wait_for(consuming, 120)
    duplicates = [seq for seq, count in seen.items() if count > 1]
    assert len(outcomes) == TOTAL
    assert set(outcomes) <= {aio.Outcome.CONFIRMED, aio.Outcome.DUPLICATE}, "every message confirmed"
    missing = set(range(1, TOTAL + 1)) - set(seen)
    assert not missing, f"{len(missing)} confirmed messages never delivered, e.g. {sorted(missing)[:5]}"
    assert len(duplicates) <= redelivered, "a message came twice without the redelivered flag"
    assert not order_violations, order_violations[:5]
    await client.close()
    await consumer.close()
    return {
        "published_in": published_in,
        "killed_after": killed_at - started,
        "resends": producer.resends,
        "redelivered": redelivered,
        "duplicates": len(duplicates),
    }


@pytest.mark.parametrize("consume_during", [False, True], ids=["consumer-after", "consumer-during"])
def test_no_confirmed_message_is_lost_when_the_master_is_killed(tmp_path: Path, consume_during: bool) -> None:
    directory = tmp_path / "cluster"
    try:
        figures = asyncio.run(asyncio.wait_for(_failover(directory, consume_during), 300))
        published, killed = figures["published_in"], figures["killed_after"]
        print(f"100,000 published in {published:.1f}s, master killed at {killed:.1f}s; ", end="")
        print(f"{figures['resends']} resends, {figures['redelivered']} redelivered, {figures['duplicates']} repeats")
    finally:
        cluster.down(directory)
