"""Mirrored queues from Python: a thin asyncio client of ringq.v1.QueueService.

`QueueClient` talks to any node of the cluster (a list of addresses; on
UNAVAILABLE it moves to the next). `Publisher` keeps a window of unconfirmed
messages, each numbered for an idempotent publisher id; when its stream
breaks (a master failover) it resends every unconfirmed message on a new
stream, and the queue drops those it already has, so nothing is lost and
nothing is duplicated.

    client = QueueClient(["127.0.0.1:7101", "127.0.0.1:7102"])
    await client.declare("orders", durable=True)
    publisher = client.publisher("orders")
    await publisher.publish([b"hello"])      # returns once confirmed
    async for delivery in client.consume("orders", prefetch=100):
        await client.ack("orders", delivery)
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc

from ringq.v1 import queue_pb2, queue_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)
# A stream the broker ended while we were still writing to it reports INTERNAL
# ("Failed execute_batch") rather than the broker's status: retry it too.
STREAM_RETRYABLE = (*RETRYABLE, grpc.StatusCode.INTERNAL)


class QueueClient:
    """A connection to a ringq cluster for queues."""

    def __init__(self, addresses: Sequence[str], vhost: str = "/") -> None:
        self.addresses = list(addresses)
        self.vhost = vhost
        self._channels = {a: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self.addresses}
        self._current = 0

    def stub(self) -> Any:
        return queue_pb2_grpc.QueueServiceStub(self._channels[self.addresses[self._current]])

    def failed(self) -> None:
        """The current node did not answer: use the next one."""
        self._current = (self._current + 1) % len(self.addresses)

    def ref(self, queue: str) -> queue_pb2.QueueRef:
        return queue_pb2.QueueRef(vhost=self.vhost, queue=queue)

    async def call(self, method: str, request: Any, attempts: int = 60) -> Any:
        """A unary call, retried on another node while the cluster is in transition."""
        for attempt in range(attempts):
            try:
                return await getattr(self.stub(), method)(request, timeout=10)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE or attempt == attempts - 1:
                    raise
                self.failed()
                await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))
        raise AssertionError("unreachable")

    async def declare(
        self, queue: str, durable: bool = False, arguments: dict[str, str] | None = None
    ) -> queue_pb2.QueueInfo:
        """Declare `queue`; `arguments` values are JSON texts (e.g. {"x-single-active-consumer": "true"})."""
        request = queue_pb2.QueueDeclareRequest(queue=self.ref(queue), durable=durable, arguments=arguments or {})
        info: queue_pb2.QueueInfo = await self.call("DeclareQueue", request)
        return info

    async def status(self, queue: str) -> queue_pb2.QueueInfo:
        info: queue_pb2.QueueInfo = await self.call("QueueStatus", self.ref(queue))
        return info

    def publisher(
        self,
        queue: str,
        publisher_id: str | None = None,
        window: int = 1000,
        batch: int = 100,
        persistent: bool = False,
    ) -> Publisher:
        """A publisher; `persistent` messages of durable queues are on disk when confirmed."""
        return Publisher(self, queue, publisher_id or uuid.uuid4().hex, window, batch, persistent)

    async def consume(
        self, queue: str, prefetch: int = 100, resume: bool = True
    ) -> AsyncGenerator[queue_pb2.QueueDelivery, None]:
        """Deliveries from `queue`; with `resume`, reattach after a failover (on any node)."""
        while True:
            call = self.stub().Consume(queue_pb2.ConsumeRequest(queue=self.ref(queue), prefetch=prefetch))
            try:
                async for delivery in call:
                    yield delivery
                return
            except grpc.aio.AioRpcError as error:
                if not resume or error.code() not in RETRYABLE:
                    raise
                self.failed()
                await asyncio.sleep(0.1)
            finally:
                call.cancel()  # closing the iterator cancels the consumer on the broker

    async def settle(
        self,
        queue: str,
        delivery: queue_pb2.QueueDelivery,
        kind: queue_pb2.SettleKind.ValueType = queue_pb2.SETTLE_KIND_ACK,
        multiple: bool = False,
    ) -> bool:
        """Settle a delivery (and, with `multiple`, every earlier one of its consumer);
        False if its consumer is gone (after a failover it comes back redelivered)."""
        request = queue_pb2.SettleRequest(
            queue=self.ref(queue),
            consumer_tag=delivery.consumer_tag,
            delivery_tag=delivery.delivery_tag,
            kind=kind,
            multiple=multiple,
        )
        try:
            await self.call("Settle", request, attempts=3)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.FAILED_PRECONDITION, *RETRYABLE):
                return False
            raise
        return True

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)


class Publisher:
    """Publishes to one queue with confirms, an idempotent id and a bounded window."""

    def __init__(
        self, client: QueueClient, queue: str, publisher_id: str, window: int, batch: int, persistent: bool = False
    ) -> None:
        self.client = client
        self.persistent = persistent
        self.queue = queue
        self.publisher_id = publisher_id
        self.window = window
        self.batch = batch
        self.next_seq = 1
        self.unconfirmed: dict[int, bytes] = {}
        self.outcomes: dict[int, int] = {}
        self.resends = 0

    async def publish(self, bodies: Sequence[bytes]) -> list[int]:
        """Publish and wait for every confirm; returns the seqs given to `bodies`."""
        seqs = list(range(self.next_seq, self.next_seq + len(bodies)))
        self.next_seq += len(bodies)
        self.unconfirmed.update(zip(seqs, bodies, strict=True))
        while self.unconfirmed:
            try:
                await self._stream()
            except grpc.aio.AioRpcError as error:
                if error.code() not in STREAM_RETRYABLE:
                    raise
                self.client.failed()
                self.resends += 1
                await asyncio.sleep(0.1)
        return seqs

    async def _stream(self) -> None:
        call = self.client.stub().Publish()
        pending = sorted(self.unconfirmed)
        in_flight: asyncio.Queue[int] = asyncio.Queue(maxsize=max(1, self.window // self.batch))

        async def write() -> None:
            # A write fails once the broker ended the stream; the reader then sees the real status.
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await send()

        async def send() -> None:
            for start in range(0, len(pending), self.batch):
                seqs = pending[start : start + self.batch]
                await in_flight.put(len(seqs))
                messages = [
                    queue_pb2.OutgoingMessage(body=self.unconfirmed[s], seq=s, persistent=self.persistent) for s in seqs
                ]
                await call.write(
                    queue_pb2.PublishRequest(
                        queue=self.client.ref(self.queue), publisher=self.publisher_id, messages=messages
                    )
                )
            await call.done_writing()

        writer = asyncio.ensure_future(write())
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:  # type: ignore[attr-defined]
                    break
                in_flight.get_nowait()
                for seq, outcome in zip(response.seqs, response.outcomes, strict=True):
                    self.outcomes[seq] = outcome
                    self.unconfirmed.pop(seq, None)
            await writer
        finally:
            writer.cancel()
            call.cancel()
