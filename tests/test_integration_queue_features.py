"""Integration: queue features set by policy, through real nodes (issue 4).

max-length with reject-publish and with drop-head, message TTL with
dead-lettering, the delivery limit for a poison message, and single active
consumer (queue argument x-single-active-consumer).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import grpc
import pytest

from ringq.queue import QueueClient
from ringq.v1 import coordinator_pb2, coordinator_pb2_grpc, queue_pb2
from services import cluster
from tests.test_integration_queue import NODE_ARGS

pytestmark = pytest.mark.integration

POLICIES = {
    "reject": ("^reject\\.", {"max-length": 3, "overflow": "reject-publish"}),
    "drop": ("^drop\\.", {"max-length": 2}),
    "ttl": ("^ttl\\.", {"message-ttl": 200, "dead-letter-queue": "dead.ttl"}),
    "poison": ("^poison\\.", {"delivery-limit": 1, "dead-letter-queue": "dead.poison"}),
}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    directory = tmp_path_factory.mktemp("features")
    info = cluster.up(2, directory, node_args=NODE_ARGS)

    async def setup() -> None:
        async with grpc.aio.insecure_channel(info.coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            for name, (pattern, definition) in POLICIES.items():
                policy = coordinator_pb2.Policy(
                    vhost="/", name=name, pattern=pattern, definition_json=json.dumps(definition)
                )
                await stub.SetPolicy(coordinator_pb2.SetPolicyRequest(policy=policy))
        await asyncio.sleep(2.0)  # nodes' heartbeats: all live

    asyncio.run(setup())
    try:
        yield [n.address for n in info.nodes]
    finally:
        cluster.down(directory)


async def _bodies(client: QueueClient, queue: str) -> list[bytes]:
    out = []
    while (got := await client.call("Get", queue_pb2.GetRequest(queue=client.ref(queue), no_ack=True))).found:
        out.append(got.delivery.body)
    return out


def test_max_length_with_reject_publish_and_drop_head(nodes: list[str]) -> None:
    async def scenario() -> None:
        client = QueueClient(nodes)
        await client.declare("reject.q")
        publisher = client.publisher("reject.q")
        await publisher.publish([b"1", b"2", b"3", b"4", b"5"])
        assert [publisher.outcomes[s] for s in range(1, 6)] == [queue_pb2.PUBLISH_OUTCOME_CONFIRMED] * 3 + [
            queue_pb2.PUBLISH_OUTCOME_REJECTED
        ] * 2
        assert await _bodies(client, "reject.q") == [b"1", b"2", b"3"]
        await client.declare("drop.q")
        await client.publisher("drop.q").publish([b"1", b"2", b"3"])
        assert await _bodies(client, "drop.q") == [b"2", b"3"], "the head is dropped"

    asyncio.run(scenario())


def test_expired_messages_are_dead_lettered_with_the_reason(nodes: list[str]) -> None:
    async def scenario() -> None:
        client = QueueClient(nodes)
        await client.declare("dead.ttl")
        await client.declare("ttl.q")
        await client.publisher("ttl.q").publish([b"short-lived"])
        deadline = time.monotonic() + 10
        while (
            got := await client.call("Get", queue_pb2.GetRequest(queue=client.ref("dead.ttl"), no_ack=True))
        ).found is False:
            assert time.monotonic() < deadline, "the expired message was not dead-lettered"
            await asyncio.sleep(0.05)
        assert got.delivery.body == b"short-lived"
        assert got.delivery.headers["x-death-reason"] == "expired" and got.delivery.headers["x-death-queue"] == "ttl.q"
        assert (await client.status("ttl.q")).depth == 0

    asyncio.run(scenario())


def test_a_poison_message_goes_to_its_dead_letter_queue_after_the_delivery_limit(nodes: list[str]) -> None:
    async def scenario() -> None:
        client = QueueClient(nodes)
        await client.declare("dead.poison")
        await client.declare("poison.q")
        await client.publisher("poison.q").publish([b"poison"])
        deliveries = 0
        stream = client.consume("poison.q", prefetch=1, resume=False)
        async for delivery in stream:
            deliveries += 1
            await client.settle("poison.q", delivery, queue_pb2.SETTLE_KIND_REQUEUE)
            if deliveries == 2:
                break
        await stream.aclose()
        deadline = time.monotonic() + 10
        while not (
            got := await client.call("Get", queue_pb2.GetRequest(queue=client.ref("dead.poison"), no_ack=True))
        ).found:
            assert time.monotonic() < deadline, "the poison message was not dead-lettered"
            await asyncio.sleep(0.05)
        assert got.delivery.headers["x-death-reason"] == "delivery_limit" and deliveries == 2

    asyncio.run(scenario())


def test_single_active_consumer(nodes: list[str]) -> None:
    async def scenario() -> None:
        client = QueueClient(nodes)
        await client.declare("sac.q", arguments={"x-single-active-consumer": "true"})
        first = client.consume("sac.q", prefetch=10, resume=False)
        second = client.consume("sac.q", prefetch=10, resume=False)
        first_task = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0.3)
        second_task = asyncio.ensure_future(anext(second))
        await asyncio.sleep(0.3)
        await client.publisher("sac.q").publish([b"1", b"2"])
        delivery = await asyncio.wait_for(first_task, 10)
        assert delivery.body == b"1"
        await asyncio.sleep(0.5)
        assert not second_task.done(), "only the active consumer receives messages"
        await first.aclose()  # the active consumer goes: the next takes over, with what it had
        taken_over = await asyncio.wait_for(second_task, 10)
        assert taken_over.body in (b"1", b"2")
        await second.aclose()

    asyncio.run(scenario())
