"""Integration: queue features set by policy, through real nodes (issue 4).

max-length with reject-publish and with drop-head, message TTL with
dead-lettering, the delivery limit for a poison message, and single active
consumer (queue argument x-single-active-consumer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import pytest

from ringq import aio
from ringq.errors import InvalidArgument, NotFound, RingqError
from services import cluster
from tests.clusters import connection, live_cluster

pytestmark = pytest.mark.integration

POLICIES: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "reject": ("^reject\\.", {"max-length": 3, "overflow": "reject-publish"}),
    "drop": ("^drop\\.", {"max-length": 2}),
    "ttl": ("^ttl\\.", {"message-ttl": 200, "dead-letter-queue": "dead.ttl"}),
    "poison": ("^poison\\.", {"delivery-limit": 1, "dead-letter-queue": "dead.poison"}),
}


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    with live_cluster(tmp_path_factory.mktemp("features"), POLICIES, nodes=2) as info:
        yield info


async def _bodies(client: aio.Connection, queue: str) -> list[bytes]:
    out = []
    while (got := await client.get(queue, no_ack=True)) is not None:
        out.append(got.body)
    return out


async def _dead_letter(client: aio.Connection, queue: str, what: str) -> aio.Delivery:
    deadline = time.monotonic() + 10
    while (got := await client.get(queue, no_ack=True)) is None:
        assert time.monotonic() < deadline, f"the {what} was not dead-lettered"
        await asyncio.sleep(0.05)
    return got


def test_max_length_with_reject_publish_and_drop_head(features: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with connection(features) as client:
            await client.declare_queue("reject.q")
            outcomes = await client.producer("reject.q").publish_many([b"1", b"2", b"3", b"4", b"5"])
            assert outcomes == [aio.Outcome.CONFIRMED] * 3 + [aio.Outcome.REJECTED] * 2
            assert await _bodies(client, "reject.q") == [b"1", b"2", b"3"]
            await client.declare_queue("drop.q")
            await client.producer("drop.q").publish_many([b"1", b"2", b"3"])
            assert await _bodies(client, "drop.q") == [b"2", b"3"], "the head is dropped"

    asyncio.run(scenario())


def test_expired_messages_are_dead_lettered_with_the_reason(features: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with connection(features) as client:
            await client.declare_queue("dead.ttl")
            await client.declare_queue("ttl.q")
            await client.producer("ttl.q").publish(b"short-lived")
            got = await _dead_letter(client, "dead.ttl", "expired message")
            assert got.body == b"short-lived"
            assert got.headers["x-death-reason"] == "expired" and got.headers["x-death-queue"] == "ttl.q"
            assert (await client.queue_status("ttl.q")).depth == 0

    asyncio.run(scenario())


def test_a_poison_message_goes_to_its_dead_letter_queue_after_the_delivery_limit(features: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with connection(features) as client:
            await client.declare_queue("dead.poison")
            await client.declare_queue("poison.q")
            await client.producer("poison.q").publish(b"poison")
            deliveries = 0
            consumer = client.consumer("poison.q", prefetch=1)
            async for delivery in consumer:
                deliveries += 1
                assert delivery.nack(requeue=True)
                if deliveries == 2:
                    break
            # the consumer stays attached until the requeue, sent on its stream, took effect
            got = await _dead_letter(client, "dead.poison", "poison message")
            assert got.headers["x-death-reason"] == "delivery_limit" and deliveries == 2
            await consumer.close()

    asyncio.run(scenario())


async def _consumers_attached(client: aio.Connection, queue: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while (await client.queue_status(queue)).consumers < count:
        assert time.monotonic() < deadline, f"{count} consumers did not attach to {queue}"
        await asyncio.sleep(0.02)


def test_single_active_consumer(features: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with connection(features) as client:
            await client.declare_queue("sac.q", arguments={"x-single-active-consumer": True})
            first = client.consumer("sac.q", prefetch=10)
            second = client.consumer("sac.q", prefetch=10)
            first_task = asyncio.ensure_future(anext(aiter(first)))
            await _consumers_attached(client, "sac.q", 1)  # the first to attach is the active one
            second_task = asyncio.ensure_future(anext(aiter(second)))
            await _consumers_attached(client, "sac.q", 2)
            await client.producer("sac.q").publish_many([b"1", b"2"])
            delivery = await asyncio.wait_for(first_task, 10)
            assert delivery.body == b"1"
            await asyncio.sleep(0.5)
            assert not second_task.done(), "only the active consumer receives messages"
            await first.close()  # the active consumer goes: the next takes over, with what it had
            taken_over = await asyncio.wait_for(second_task, 10)
            assert taken_over.body in (b"1", b"2")
            await second.close()

    asyncio.run(scenario())


def test_queue_arguments_bound_a_queue_with_its_policy_and_bad_ones_are_refused(features: cluster.ClusterInfo) -> None:
    """Arguments were accepted whatever their type (x-max-length "ten") and never applied: they are now
    validated as policies are, and the lower of the policy's limit and the argument's applies."""

    async def scenario() -> None:
        async with connection(features) as client:
            # The policy "drop" says max-length 2 (drop-head); the argument asks 5 with reject-publish:
            # the lower length (2) and the argument's overflow apply.
            await client.declare_queue("drop.args", arguments={"x-max-length": 5, "x-overflow": "reject-publish"})
            outcomes = await client.producer("drop.args").publish_many([b"1", b"2", b"3"])
            assert outcomes == [aio.Outcome.CONFIRMED, aio.Outcome.CONFIRMED, aio.Outcome.REJECTED]
            # No policy: the argument alone bounds the queue.
            await client.declare_queue("plain.args", arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
            outcomes = await client.producer("plain.args").publish_many([b"1", b"2"])
            assert outcomes == [aio.Outcome.CONFIRMED, aio.Outcome.REJECTED]
            assert await _bodies(client, "plain.args") == [b"1"]
            for arguments, named in (
                ({"x-max-length": "ten"}, "x-max-length"),
                ({"x-max-lenght": 10}, "x-max-lenght"),
                ({"x-single-active-consumer": "yes"}, "x-single-active-consumer"),
            ):
                with pytest.raises(InvalidArgument) as refused:
                    await client.declare_queue("bad.args", arguments=arguments)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, refused.value
                assert named in refused.value.details
            with pytest.raises(NotFound) as absent:
                await client.queue_status("bad.args")
            assert absent.value.code == grpc.StatusCode.NOT_FOUND, "a refused declare made the queue"

    asyncio.run(scenario())


def test_a_deleted_queue_confirms_and_delivers_nothing_once_the_delete_has_returned(
    features: cluster.ClusterInfo,
) -> None:
    """delete_queue returned before the queue stopped: publishes were confirmed, and delivered, a few ms
    later. The master now stops serving the queue before it answers."""

    async def scenario() -> None:
        for attempt in range(5):
            async with connection(features) as client, connection(features) as admin:
                queue = f"deleted.{attempt}"
                await client.declare_queue(queue)
                producer = client.producer(queue, publisher_id="p")
                assert await producer.publish(b"before") is aio.Outcome.CONFIRMED  # the stream reaches the master
                consumer = client.consumer(queue, prefetch=10)
                first = await asyncio.wait_for(anext(aiter(consumer)), 10)
                assert first.body == b"before"
                await admin.delete_queue(queue)
                with pytest.raises(RingqError) as refused:
                    await producer.publish(b"after")
                assert refused.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
                late: list[bytes] = []
                with pytest.raises(NotFound) as ended:
                    async for delivery in consumer:  # the stream ends; reattaching finds no queue
                        late.append(delivery.body)
                assert ended.value.code == grpc.StatusCode.NOT_FOUND, ended.value
                assert late == [], "a message was delivered after the delete returned"
                await producer.close()

    asyncio.run(scenario())


def test_an_auto_delete_queue_goes_with_its_last_consumer(features: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with connection(features) as client:
            await client.declare_queue("auto.q", auto_delete=True)
            await client.producer("auto.q").publish(b"m")
            consumer = client.consumer("auto.q", prefetch=10)
            assert (await asyncio.wait_for(anext(aiter(consumer)), 10)).body == b"m"
            await consumer.close()
            deadline = time.monotonic() + 10
            while True:
                try:
                    await client.queue_status("auto.q")
                except RingqError as error:
                    assert isinstance(error, NotFound), error
                    break
                assert time.monotonic() < deadline, "the auto-delete queue outlived its last consumer"
                await asyncio.sleep(0.05)

    asyncio.run(scenario())
