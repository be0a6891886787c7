"""How a Consume stream groups a consumer's ready deliveries into responses, without a cluster: what is
queued goes in one response, in order, up to the caps (deliveries, body bytes: a larger delivery goes
alone), and the end marker ends the stream after what was queued before it. The queue holds a step's
deliveries as one run; a stopping replica discards what was not sent, runs taken in part included."""

from __future__ import annotations

import asyncio

from services.queue import service
from services.queue.master import Delivery
from services.queue.ops import Message
from services.queue.replica_host import Consumer


def _delivery(tag: int, body_bytes: int = 8) -> Delivery:
    return Delivery("c", tag, Message(id=tag, body=b"x" * body_bytes), redelivered=False)


def _queue(*items: Delivery | list[Delivery] | None) -> Consumer:
    """A consumer whose queue holds `items`: a delivery alone is a run of one."""
    consumer = Consumer("c")
    for item in items:
        consumer.deliveries.put_nowait([item] if isinstance(item, Delivery) else item)
    return consumer


def _tags(batch: list[Delivery]) -> list[int]:
    return [d.delivery_tag for d in batch]


def test_what_is_queued_goes_in_one_response_in_order_up_to_the_cap() -> None:
    async def scenario() -> None:
        total = service.MAX_DELIVERIES_PER_RESPONSE + 10
        batches = service._ReadyBatches(_queue(*(_delivery(tag) for tag in range(1, total + 1))))
        first, second = await batches.next(), await batches.next()
        assert _tags(first) == list(range(1, service.MAX_DELIVERIES_PER_RESPONSE + 1))
        assert _tags(second) == list(range(service.MAX_DELIVERIES_PER_RESPONSE + 1, total + 1))

    asyncio.run(scenario())


def test_a_response_is_sent_without_waiting_for_more() -> None:
    async def scenario() -> None:
        consumer = _queue(_delivery(1))
        batches = service._ReadyBatches(consumer)
        assert _tags(await asyncio.wait_for(batches.next(), 1)) == [1]
        later = asyncio.ensure_future(batches.next())
        await asyncio.sleep(0.01)
        assert not later.done(), "the next response waits for a delivery"
        consumer.deliveries.put_nowait([_delivery(2)])
        assert _tags(await asyncio.wait_for(later, 1)) == [2]

    asyncio.run(scenario())


def test_the_end_marker_ends_the_stream_after_what_came_before_it() -> None:
    async def scenario() -> None:
        batches = service._ReadyBatches(_queue(_delivery(1), _delivery(2), None, _delivery(3)))
        assert _tags(await batches.next()) == [1, 2], "what was queued before the end marker is sent"
        assert await batches.next() == []
        assert await batches.next() == [], "nothing after the end marker"

    asyncio.run(scenario())


def test_an_end_marker_first_ends_at_once() -> None:
    async def scenario() -> None:
        batches = service._ReadyBatches(_queue(None, _delivery(1)))
        assert await batches.next() == []

    asyncio.run(scenario())


def test_body_bytes_past_the_budget_open_the_next_response_and_a_large_delivery_goes_alone() -> None:
    async def scenario() -> None:
        budget = service.MAX_RESPONSE_BODY_BYTES
        queue = _queue(
            _delivery(1, budget // 2),
            _delivery(2, budget // 2),
            _delivery(3, 1),  # one byte over: it opens the next response
            _delivery(4, budget * 4),  # alone
            _delivery(5),
            None,
        )
        batches = service._ReadyBatches(queue)
        assert [_tags(await batches.next()) for _ in range(4)] == [[1, 2], [3], [4], [5]]
        assert await batches.next() == []

    asyncio.run(scenario())


def test_runs_are_split_at_the_caps_and_joined_up_to_them() -> None:
    async def scenario() -> None:
        cap = service.MAX_DELIVERIES_PER_RESPONSE
        big = [_delivery(tag) for tag in range(1, cap + 11)]  # one step's deliveries, over the cap
        batches = service._ReadyBatches(_queue(big, [_delivery(cap + 11), _delivery(cap + 12)], None))
        assert _tags(await batches.next()) == list(range(1, cap + 1))
        assert _tags(await batches.next()) == list(range(cap + 1, cap + 13)), "the rest, and the next run"
        assert await batches.next() == []

    asyncio.run(scenario())


def test_a_stopping_replica_discards_what_was_not_sent_even_of_a_run_taken_in_part() -> None:
    async def scenario() -> None:
        cap = service.MAX_DELIVERIES_PER_RESPONSE
        consumer = _queue([_delivery(tag) for tag in range(1, cap + 11)], [_delivery(cap + 11)])
        batches = service._ReadyBatches(consumer)
        assert len(await batches.next()) == cap
        consumer.discard_unsent()  # the replica stopped: the next master delivers the rest again
        assert await batches.next() == []
        assert await batches.next() == []

    asyncio.run(scenario())
