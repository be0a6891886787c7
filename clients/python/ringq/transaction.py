"""Transactions on one queue: RabbitMQ's tx.select / tx.commit / tx.rollback for ringq.

Responsible for: gathering a producer's publishes and a consumer's acknowledgements (or rejects and
requeues) and sending them as one QueueService.Commit, which the queue's master applies as one ring
report: every replica holds all of it or none. A rollback sends nothing.

    async with producer.transaction(consumer) as tx:   # commit on leaving, rollback on an exception
        tx.ack(delivery)
        tx.publish(b"result")

Guarantees: `commit` returns once every message is confirmed as a publish is (the outcomes, in order).
A commit of publishes only is retried on another node if its node fails, and adds no message twice (the
messages keep their seqs, numbered by the producer). A commit with acknowledgements is not retried: they
name delivery tags of the consumer's stream, which after a failover name other deliveries. If it fails
it was applied whole or not at all; its deliveries come back redelivered if it was not, as in RabbitMQ,
where a channel's transaction dies with its channel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

import grpc

from ringq.v1 import queue_pb2

if TYPE_CHECKING:
    from ringq.aio import Consumer, Delivery, Outcome, Producer


@dataclass
class Transaction:
    """One transaction of `producer`'s queue; acknowledgements only of `consumer`'s deliveries."""

    producer: Producer
    consumer: Consumer | None = None
    _messages: list[queue_pb2.OutgoingMessage] = field(default_factory=list)
    _settlements: list[queue_pb2.Settlement] = field(default_factory=list)
    _acked: list[Delivery] = field(default_factory=list)
    _consumer_tag: str = ""  # the tag the broker gave the stream the settled deliveries came on

    def publish(
        self,
        body: bytes,
        *,
        headers: dict[str, str] | None = None,
        persistent: bool | None = None,
        priority: int = 0,
        expiration_ms: int = 0,
    ) -> int:
        """Add a message to the transaction; its seq (the producer numbers it, for deduplication)."""
        producer = self.producer
        seq = producer.next_seq
        producer.next_seq += 1
        self._messages.append(
            queue_pb2.OutgoingMessage(
                body=body,
                seq=seq,
                persistent=producer.persistent if persistent is None else persistent,
                headers=headers or {},
                priority=priority,
                expiration_ms=expiration_ms,
            )
        )
        return seq

    def ack(self, delivery: Delivery, *, multiple: bool = False) -> None:
        """Acknowledge `delivery` when the transaction commits."""
        self._settle(delivery, "ack", multiple)

    def nack(self, delivery: Delivery, *, requeue: bool = True, multiple: bool = False) -> None:
        """Requeue (default) or reject `delivery` when the transaction commits."""
        self._settle(delivery, "requeue" if requeue else "reject", multiple)

    def _settle(self, delivery: Delivery, kind: str, multiple: bool) -> None:
        from ringq.aio import _KINDS  # ringq.aio imports this module

        if self.consumer is None or delivery._consumer is not self.consumer:
            raise ValueError("a transaction settles deliveries of the consumer it was opened with only")
        if self._settlements and delivery.consumer_tag != self._consumer_tag:
            raise ValueError("a transaction settles deliveries of one consumer stream (the consumer reattached)")
        self._consumer_tag = delivery.consumer_tag
        if delivery.queue != self.producer.queue:
            raise ValueError(f"a transaction is on one queue ({self.producer.queue!r}), not {delivery.queue!r}")
        self._settlements.append(
            queue_pb2.Settlement(delivery_tag=delivery.delivery_tag, multiple=multiple, kind=_KINDS[kind])
        )
        if kind == "ack":
            self._acked.append(delivery)

    async def commit(self) -> list[Outcome]:
        """Apply everything gathered, all or none; the publishes' outcomes, in order. The transaction is
        empty again afterwards (also when the commit is refused: nothing of it was applied)."""
        from ringq.aio import _OUTCOMES  # ringq.aio imports this module

        producer = self.producer
        request = queue_pb2.CommitRequest(
            queue=producer.connection.ref(producer.queue),
            publisher=producer.publisher_id,
            messages=self._messages,
            consumer_tag=self._consumer_tag,
            settlements=self._settlements,
        )
        acked = self._acked
        self.rollback()
        connection = producer.connection
        if request.settlements:
            # Not retried: delivery tags belong to the consumer's stream, and after a failover the same tag
            # names another delivery. A commit that fails here was applied whole or not at all.
            await connection.reach()
            try:
                response: queue_pb2.CommitResponse = await connection.stub().Commit(
                    request, timeout=connection.call_timeout
                )
            except grpc.aio.AioRpcError as error:
                raise connection.error(error, retried=()) from None
        else:
            response = await connection.call("Commit", request)  # publishes only: a retry adds nothing twice
        if self.consumer is not None:
            self.consumer.acknowledged_elsewhere(acked)
        return [_OUTCOMES[outcome] for outcome in response.outcomes]

    def rollback(self) -> None:
        """Drop everything gathered (deliveries acknowledged in it stay unacknowledged)."""
        self._messages = []
        self._settlements = []
        self._acked = []
        self._consumer_tag = ""

    async def __aenter__(self) -> Transaction:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if kind is None:
            await self.commit()
        else:
            self.rollback()
