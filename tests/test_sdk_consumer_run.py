"""`ringq.aio.Consumer.run(callback)` against a stand-in QueueService on a real gRPC server (no cluster):
the callback gets every delivery once, in order, one call at a time (an async callback is awaited before
the next); what was queued for an iteration before comes first; close() from another task or from the
callback itself ends run(); an exception from the callback, or cancelling run(), ends run() and the
consumer goes on for an iteration, missing nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from ringq import aio
from ringq.v1 import queue_pb2, queue_pb2_grpc

TIMEOUT_S = 10.0


class _Queue(queue_pb2_grpc.QueueServiceServicer):
    """Consume only: streams what the test sends, records the settlements, and ends a stream once its
    client half-closes (as a node does after applying a closing consumer's settlements)."""

    def __init__(self) -> None:
        self.outbox: asyncio.Queue[list[int]] = asyncio.Queue()  # delivery tags, one response each
        self.acked: set[int] = set()
        self.attached = asyncio.Event()

    def send(self, *tags: int) -> None:
        self.outbox.put_nowait(list(tags))

    async def Consume(
        self, requests: AsyncIterator[queue_pb2.ConsumeRequest], context: Any
    ) -> AsyncIterator[queue_pb2.ConsumeResponse]:
        half_closed = asyncio.Event()

        async def read() -> None:
            async for request in requests:
                if request.HasField("queue"):
                    self.attached.set()
                self.acked.update(s.delivery_tag for s in request.settlements if s.kind == queue_pb2.SETTLE_KIND_ACK)
            half_closed.set()

        reader = asyncio.ensure_future(read())
        try:
            while not half_closed.is_set():
                sending = asyncio.ensure_future(self.outbox.get())
                closing = asyncio.ensure_future(half_closed.wait())
                await asyncio.wait((sending, closing), return_when=asyncio.FIRST_COMPLETED)
                closing.cancel()
                if not sending.done():
                    sending.cancel()
                    return
                yield queue_pb2.ConsumeResponse(
                    deliveries=[
                        queue_pb2.QueueDelivery(
                            consumer_tag="c", delivery_tag=tag, body=b"%d" % tag, publisher="p", seq=tag
                        )
                        for tag in sending.result()
                    ]
                )
        finally:
            reader.cancel()


async def _with_queue(scenario: Callable[[_Queue, aio.Connection], Awaitable[None]]) -> None:
    server = grpc.aio.server()
    queue = _Queue()  # type: ignore[abstract]  # only Consume
    queue_pb2_grpc.add_QueueServiceServicer_to_server(queue, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    connection = aio.Connection([f"127.0.0.1:{port}"], retry_for=2.0)
    try:
        await asyncio.wait_for(scenario(queue, connection), TIMEOUT_S)
    finally:
        await connection.close()
        await server.stop(None)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.005)


def _tags(deliveries: list[aio.Delivery]) -> list[int]:
    return [d.delivery_tag for d in deliveries]


def test_the_callback_gets_every_delivery_in_order_and_close_ends_run() -> None:
    async def scenario(queue: _Queue, connection: aio.Connection) -> None:
        consumer = connection.consumer("q")
        got: list[aio.Delivery] = []

        def take(delivery: aio.Delivery) -> None:
            got.append(delivery)
            delivery.ack()

        running = asyncio.ensure_future(consumer.run(take))
        await queue.attached.wait()
        queue.send(1, 2)
        queue.send(3)
        await _until(lambda: len(got) == 3)
        assert _tags(got) == [1, 2, 3]
        await consumer.close()
        await asyncio.wait_for(running, TIMEOUT_S)  # returns: the consumer is closed
        assert queue.acked == {1, 2, 3}, "the acks were sent before the stream ended"

    asyncio.run(_with_queue(scenario))


def test_the_callback_is_called_by_the_task_reading_the_stream() -> None:
    """No hand-off to another task between the stream and the callback (issue 13: about 50 us a delivery)."""

    async def scenario(queue: _Queue, connection: aio.Connection) -> None:
        consumer = connection.consumer("q")
        callers: list[asyncio.Task[Any] | None] = []
        running = asyncio.ensure_future(consumer.run(lambda _: callers.append(asyncio.current_task())))
        await queue.attached.wait()
        queue.send(1)
        await _until(lambda: len(callers) == 1)
        assert callers[0] is consumer._runner
        await consumer.close()
        await asyncio.wait_for(running, TIMEOUT_S)

    asyncio.run(_with_queue(scenario))


def test_an_async_callback_is_awaited_before_the_next_delivery() -> None:
    async def scenario(queue: _Queue, connection: aio.Connection) -> None:
        consumer = connection.consumer("q")
        events: list[str] = []
        release = asyncio.Event()

        async def take(delivery: aio.Delivery) -> None:
            events.append(f"start {delivery.delivery_tag}")
            if delivery.delivery_tag == 1:
                await release.wait()
            events.append(f"end {delivery.delivery_tag}")

        running = asyncio.ensure_future(consumer.run(take))
        await queue.attached.wait()
        queue.send(1, 2)
        await _until(lambda: events == ["start 1"])
        await asyncio.sleep(0.05)
        assert events == ["start 1"], "the second delivery waits for the first call to finish"
        release.set()
        await _until(lambda: len(events) == 4)
        assert events == ["start 1", "end 1", "start 2", "end 2"]
        await consumer.close()
        await asyncio.wait_for(running, TIMEOUT_S)

    asyncio.run(_with_queue(scenario))


def test_what_an_iteration_left_queued_comes_first() -> None:
    async def scenario(queue: _Queue, connection: aio.Connection) -> None:
        consumer = connection.consumer("q")
        consumer.start()
        await queue.attached.wait()
        queue.send(1, 2, 3)
        assert (await asyncio.wait_for(anext(consumer), TIMEOUT_S)).delivery_tag == 1
        await _until(lambda: consumer._deliveries.qsize() == 2)  # 2 and 3 wait for the application
        got: list[int] = []
        running = asyncio.ensure_future(consumer.run(lambda d: got.append(d.delivery_tag)))
        await _until(lambda: got == [2, 3])
        queue.send(4)
        await _until(lambda: got == [2, 3, 4])
        await consumer.close()
        await asyncio.wait_for(running, TIMEOUT_S)

    asyncio.run(_with_queue(scenario))


def test_close_from_the_callback_ends_run_once_the_callback_returns() -> None:
    async def scenario(queue: _Queue, connection: aio.Connection) -> None:
        consumer = connection.consumer("q")
        got: list[int] = []

        async def take(delivery: aio.Delivery) -> None:
            got.append(delivery.delivery_tag)
            delivery.ack()
            if len(got) == 2:
                await consumer.close()

        running = asyncio.ensure_future(consumer.run(take))
        await queue.attached.wait()
        queue.send(1, 2)
        await asyncio.wait_for(running, TIMEOUT_S)
        assert got == [1, 2]
        assert queue.acked == {1, 2}, "what the callback settled before closing was sent"
        assert consumer._runner is not None and consumer._runner.done()
        with pytest.raises(StopAsyncIteration):
            await anext(consumer)  # closed for an iteration too

    asyncio.run(_with_queue(scenario))


def test_an_exception_from_the_callback_ends_run_and_the_consumer_goes_on() -> None:
    async def scenario(queue: _Queue, connection: aio.Connection) -> None:
        consumer = connection.consumer("q")

        def take(delivery: aio.Delivery) -> None:
            if delivery.delivery_tag == 2:
                raise ValueError("cannot handle 2")

        running = asyncio.ensure_future(consumer.run(take))
        await queue.attached.wait()
        queue.send(1, 2, 3)
        with pytest.raises(ValueError, match="cannot handle 2"):
            await asyncio.wait_for(running, TIMEOUT_S)
        after = await asyncio.wait_for(anext(consumer), TIMEOUT_S)
        assert after.delivery_tag == 3, "the delivery after the failed one comes to an iteration"
        await consumer.close()

    asyncio.run(_with_queue(scenario))


def test_cancelling_run_hands_later_deliveries_to_an_iteration() -> None:
    async def scenario(queue: _Queue, connection: aio.Connection) -> None:
        consumer = connection.consumer("q")
        got: list[int] = []
        running = asyncio.ensure_future(consumer.run(lambda d: got.append(d.delivery_tag)))
        await queue.attached.wait()
        queue.send(1)
        await _until(lambda: got == [1])
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        queue.send(2)
        assert (await asyncio.wait_for(anext(consumer), TIMEOUT_S)).delivery_tag == 2
        assert got == [1]
        await consumer.close()

    asyncio.run(_with_queue(scenario))
