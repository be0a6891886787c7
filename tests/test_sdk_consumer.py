"""The SDK consumer's bookkeeping, without a cluster: a redelivery of a message it acknowledged (the ack
went with a master that died) is acknowledged again and not handed to the application; one it had not
acknowledged (requeued, or still being processed) is handed over again, flagged."""

from __future__ import annotations

import asyncio

from ringq import aio
from ringq.v1 import queue_pb2


def _delivery(consumer: aio.Consumer, tag: int, seq: int, redelivered: bool, stream: int) -> aio.Delivery:
    message = queue_pb2.QueueDelivery(
        consumer_tag="c", delivery_tag=tag, publisher="p", seq=seq, message_id=seq, redelivered=redelivered
    )
    return aio.Delivery(message, "q", consumer, stream)


def _received(consumer: aio.Consumer, count: int) -> tuple[aio._Stream, list[aio.Delivery]]:
    """`count` deliveries (tags and seqs 1, 2, ...) received on a first stream, none settled yet."""
    stream = consumer._stream = aio._Stream(1)
    deliveries = [_delivery(consumer, tag, tag, False, 1) for tag in range(1, count + 1)]
    for delivery in deliveries:
        consumer._already_acked(stream, delivery)
    return stream, deliveries


def test_redeliveries_of_acknowledged_messages_are_acked_again_not_handed_over() -> None:
    async def scenario() -> None:
        connection = aio.Connection("127.0.0.1:1")  # never dialled
        consumer = connection.consumer("q")
        first = consumer._stream = aio._Stream(1)
        one, two, three = (_delivery(consumer, tag, tag, False, 1) for tag in (1, 2, 3))
        for delivery in (one, two, three):
            assert not consumer._already_acked(first, delivery)
        assert one.ack() and two.nack(requeue=True)  # three: still being processed when the master dies
        # The master died before replicating the ack: all three come back, flagged, on a new stream.
        second = consumer._stream = aio._Stream(2)
        again = [_delivery(consumer, tag, seq, True, 2) for tag, seq in ((1, 1), (2, 2), (3, 3))]
        handed = [d.seq for d in again if not consumer._already_acked(second, d)]
        assert handed == [2, 3], "only the acknowledged one is held back"
        assert consumer.acked_redeliveries == 1
        assert [(s.delivery_tag, s.kind) for s in second.settlements] == [(1, queue_pb2.SETTLE_KIND_ACK)]
        assert not one.ack(), "a delivery of the dead stream cannot be settled"
        await connection.close()

    asyncio.run(scenario())


def test_multiple_acks_are_remembered_and_memory_is_bounded() -> None:
    async def scenario() -> None:
        connection = aio.Connection("127.0.0.1:1")
        consumer = connection.consumer("q")
        stream, deliveries = _received(consumer, 5)
        assert deliveries[3].ack(multiple=True)  # tags 1..4
        assert list(consumer._acked) == [("p", 1), ("p", 2), ("p", 3), ("p", 4)]
        assert list(stream.unsettled) == [5]
        aio.ACKED_MEMORY, saved = 2, aio.ACKED_MEMORY
        try:
            assert deliveries[4].ack()
            assert list(consumer._acked) == [("p", 4), ("p", 5)], "the oldest are forgotten"
        finally:
            aio.ACKED_MEMORY = saved
        await connection.close()

    asyncio.run(scenario())


def test_a_multiple_ack_settles_what_is_unsettled_up_to_its_tag_and_no_further() -> None:
    async def scenario() -> None:
        connection = aio.Connection("127.0.0.1:1")
        consumer = connection.consumer("q")
        stream, deliveries = _received(consumer, 7)
        assert deliveries[2].ack()  # tag 3 alone, ahead of the others
        assert deliveries[3].nack(requeue=True, multiple=True)  # tags 1, 2 and 4: requeued, not remembered
        assert list(consumer._acked) == [("p", 3)]
        assert deliveries[5].ack(multiple=True)  # tags 5 and 6; 7 stays
        assert list(consumer._acked) == [("p", 3), ("p", 5), ("p", 6)]
        assert list(stream.unsettled) == [7]
        await connection.close()

    asyncio.run(scenario())


def test_a_delivery_reads_every_field_of_its_message() -> None:
    message = queue_pb2.QueueDelivery(
        consumer_tag="c",
        delivery_tag=7,
        body=b"body",
        publisher="p",
        seq=3,
        message_id=11,
        redelivered=True,
        delivery_count=2,
        headers={"k": "v"},
    )
    delivery = aio.Delivery(message, "q", None, 0)
    assert (delivery.queue, delivery.body, delivery.delivery_tag) == ("q", b"body", 7)
    assert (delivery.publisher, delivery.seq, delivery.message_id) == ("p", 3, 11)
    assert (delivery.redelivered, delivery.delivery_count, delivery.consumer_tag) == (True, 2, "c")
    assert delivery.headers == {"k": "v"}
    delivery.headers["added"] = "by the application"
    assert delivery.headers == {"k": "v", "added": "by the application"}, "the same dict on every read"
    bare = aio.Delivery(queue_pb2.QueueDelivery(delivery_tag=1), "q", None, 0)
    assert bare.headers == {} and bare.delivery_count == 0 and bare.message_id == 0
