"""The asyncio API of the ringq Python SDK: Connection, Producer, Consumer, Admin.

Responsible for: talking to any node of a cluster (a list of addresses; on
UNAVAILABLE the next one), publishing with confirms, consuming with
prefetch and acknowledgements, and administering queues and policies. The
blocking API (`ringq.Connection`, ringq/blocking.py) runs this one on a
background event loop.

Guarantees:
- A `Producer` numbers its messages (publisher id + seq from 1) and keeps
  at most `window` of them unconfirmed (`send` waits for room: back-pressure).
  When its stream breaks (a master failover) it resends every unconfirmed
  message, in order, on a new stream (through another node if need be); the
  queue drops those it already holds, so a confirmed message is in the queue
  exactly once and a publisher's messages keep their order. Retries follow a
  bounded tenacity policy (`retry_for` seconds without progress); when it
  runs out, the pending futures fail with the last error (a nack).
- A `Consumer` acknowledges on its own stream (acks cost no call each and
  reach the node of the consumer, in order). After a failover it resumes on
  any node; deliveries it had not settled come back flagged redelivered,
  and settling one of the old stream's deliveries returns False. A
  redelivery of a message it had acknowledged (the ack was lost with the
  master) is acknowledged again and not handed to the application: it
  remembers its last 100,000 acknowledged (publisher, seq). Its deliveries
  reach the application in order, each once: through `async for`, or
  through `run(callback)`, called from the task that reads the stream.

    async with Connection(["127.0.0.1:7101", "127.0.0.1:7102"]) as connection:
        await connection.declare_queue("orders", durable=True)
        producer = connection.producer("orders")
        await producer.publish(b"hello")                  # returns once confirmed
        async for delivery in connection.consumer("orders", prefetch=100):
            print(delivery.body)
            delivery.ack()
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import metrics, trace
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_chain, wait_fixed

from ringq import streams, tracing
from ringq.errors import RingqError, Unavailable, attempts_text, from_rpc_error
from ringq.history import History
from ringq.models import ClusterStatus, Permission, Policy, QueueRecord, QueueStatus, User
from ringq.nodes import Nodes
from ringq.security import TLS, Credentials, authenticated
from ringq.transaction import Transaction
from ringq.v1 import access_pb2, admin_pb2_grpc, cluster_pb2, queue_pb2, queue_pb2_grpc

# Waits between a failed call's attempts, each on the next node: every 50 ms for half a second (a
# failover takes tens of milliseconds: the new master serves soon after), then backing off to 1 s.
RETRY_WAITS_S = (0.05,) * 10 + (0.1, 0.2, 0.4, 0.8, 1.0)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)
# A stream the broker ended while we were still writing to it reports INTERNAL
# ("Failed execute_batch") rather than the broker's status: retry it too.
STREAM_RETRYABLE = (*RETRYABLE, grpc.StatusCode.INTERNAL)
# Acks are sent on the consume stream in requests of up to ACK_BATCH, after
# waiting at most ACK_LINGER seconds for more to gather.
ACK_BATCH = 256
ACK_LINGER = 0.002
# How many acknowledged messages a consumer remembers, to recognise their redeliveries.
ACKED_MEMORY = 100_000
_KINDS = {
    "ack": queue_pb2.SETTLE_KIND_ACK,
    "requeue": queue_pb2.SETTLE_KIND_REQUEUE,
    "reject": queue_pb2.SETTLE_KIND_REJECT,
}


def _retryable(codes: tuple[grpc.StatusCode, ...]) -> Callable[[BaseException], bool]:
    def check(error: BaseException) -> bool:
        return isinstance(error, grpc.aio.AioRpcError) and error.code() in codes

    return check


def _stream_broke(connection: Connection, error: grpc.aio.AioRpcError, progressed: bool) -> None:
    """A publish or consume stream broke. Re-raise what is not retryable, and a break before any
    progress (the retry policy counts those); after progress, move to the next node and return, so the
    caller opens a new stream with a fresh retry budget."""
    if error.code() not in STREAM_RETRYABLE or not progressed:
        raise error
    connection.nodes.note(connection.address, error)
    connection.failed()


class Outcome(enum.Enum):
    """What the queue did with a published message."""

    CONFIRMED = "confirmed"  # the queue holds it where its confirm promises
    DUPLICATE = "duplicate"  # it already had it (a retry): nothing added
    REJECTED = "rejected"  # the queue is full (overflow reject-publish): not added


_OUTCOMES = {
    queue_pb2.PUBLISH_OUTCOME_CONFIRMED: Outcome.CONFIRMED,
    queue_pb2.PUBLISH_OUTCOME_DUPLICATE: Outcome.DUPLICATE,
    queue_pb2.PUBLISH_OUTCOME_REJECTED: Outcome.REJECTED,
}


class Connection:
    """A connection to a ringq cluster through any of its nodes.

    `connect_timeout`: until some node has accepted a connection, how long the first call, publish or
    consume dials every address before failing with `ringq.errors.ConnectionFailed` (naming each address
    and why). `retry_for`: once a node has been reached, how long calls and streams keep retrying through
    a failover without progress before failing with `ringq.errors.Unavailable`. `call_timeout`: seconds
    per attempt of a unary call. `history`: a file to record this client's events in
    (docs/observability.md), default $RINGQ_HISTORY. `tls`: reach the nodes over TLS
    (`ringq.TLS(ca="ca.pem")`); None: plaintext. `credentials`: the user to act as
    (`ringq.Credentials("alice", "secret")`), needed with TLS. Every failure is a `ringq.errors.RingqError`.
    `tracer_provider` / `meter_provider`: where this connection's spans and metrics go (named by the
    OpenTelemetry messaging conventions, ringq.tracing); default the process's global providers, which
    the application installs if it wants them: the SDK installs none.
    """

    def __init__(
        self,
        addresses: Sequence[str] | str,
        *,
        vhost: str = "/",
        name: str | None = None,
        history: str | None = None,
        retry_for: float = 30.0,
        call_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        tls: TLS | None = None,
        credentials: Credentials | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self.nodes = Nodes(addresses, tls=tls, connect_timeout=connect_timeout)
        self.addresses = self.nodes.addresses
        self.tls = tls
        self.credentials = credentials
        self.vhost = vhost
        self.name = name or f"client-{uuid.uuid4().hex[:8]}"
        self.history = History(history, self.name)
        self.retry_for = retry_for
        self.call_timeout = call_timeout
        self._closing: list[Callable[[], Awaitable[None]]] = []
        self.telemetry = tracing.ClientTelemetry(self.name, tracer_provider, meter_provider)

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # ----------------------------------------------------------- plumbing

    @property
    def address(self) -> str:
        """The node this connection talks to now."""
        return self.nodes.address

    def stub(self) -> Any:  # grpc's stubs type aio calls as sync ones
        return authenticated(queue_pb2_grpc.QueueServiceStub(self.nodes.channel()), self.credentials)

    def failed(self) -> None:
        """The current node did not answer: use the next one."""
        self.nodes.next()

    async def reach(self) -> None:
        """Return once a node has accepted a connection (at once after the first time); ConnectionFailed
        if none does within `connect_timeout` seconds."""
        await self.nodes.reach()

    def error(self, error: grpc.RpcError, retried: tuple[grpc.StatusCode, ...] = STREAM_RETRYABLE) -> RingqError:
        """The RingqError for a call or stream that failed with `error` at the current node: Unavailable
        (naming every address tried) when its code is one of those `retried` (the retries ran out)."""
        if isinstance(error, grpc.aio.AioRpcError) and error.code() in retried:
            self.nodes.note(self.address, error)
            attempts = self.nodes.attempts()
            return Unavailable(
                f"{error.code().name} after retrying for {self.retry_for:g} s: {attempts_text(attempts)}",
                code=error.code(),
                details=error.details() or "",
                address=self.address,
                attempts=attempts,
            )
        return from_rpc_error(error, self.address)

    def retrying(self, codes: tuple[grpc.StatusCode, ...] = RETRYABLE) -> AsyncRetrying:
        """The bounded retry policy: RETRY_WAITS_S between attempts (the last one repeated), for
        `retry_for` seconds."""

        async def next_node(state: Any) -> None:
            failure = state.outcome.exception() if state.outcome is not None else None
            if failure is not None:
                self.nodes.note(self.address, failure)
            self.failed()

        return AsyncRetrying(
            retry=retry_if_exception(_retryable(codes)),
            wait=wait_chain(*(wait_fixed(seconds) for seconds in RETRY_WAITS_S)),
            stop=stop_after_delay(self.retry_for),
            before_sleep=next_node,
            reraise=True,
        )

    def ref(self, queue: str) -> queue_pb2.QueueRef:
        return queue_pb2.QueueRef(vhost=self.vhost, queue=queue)

    async def call(self, method: str, request: Any, stub: Callable[[], Any] | None = None) -> Any:
        """A unary QueueService call (or one of the service `stub()` makes, for the current node), retried on
        other nodes while the cluster is in transition; a RingqError if it fails."""
        await self.nodes.reach()
        make_stub = stub or self.stub
        try:
            async for attempt in self.retrying():
                with attempt:
                    response = await getattr(make_stub(), method)(request, timeout=self.call_timeout)
                    self.nodes.answered(self.address)
                    return response
        except grpc.aio.AioRpcError as error:
            raise self.error(error, RETRYABLE) from None
        raise AssertionError("unreachable")

    # ------------------------------------------------------------- queues

    async def declare_queue(
        self,
        queue: str,
        *,
        durable: bool = False,
        auto_delete: bool = False,
        exclusive_owner: str = "",
        arguments: Mapping[str, Any] | None = None,
    ) -> QueueStatus:
        """Declare `queue` (or find it, if it exists with the same properties).
        `arguments`: RabbitMQ's x-arguments as Python values, e.g. {"x-max-length": 1000, "x-overflow":
        "reject-publish", "x-single-active-consumer": True}; each is sent as JSON text (the proto's form)."""
        texts = {k: json.dumps(v) for k, v in (arguments or {}).items()}
        request = queue_pb2.DeclareQueueRequest(
            queue=self.ref(queue),
            durable=durable,
            auto_delete=auto_delete,
            exclusive_owner=exclusive_owner,
            arguments=texts,
        )
        response: queue_pb2.DeclareQueueResponse = await self.call("DeclareQueue", request)
        return QueueStatus.from_proto(response.queue)

    async def delete_queue(self, queue: str, *, if_unused: bool = False, if_empty: bool = False) -> int:
        """Delete `queue`; returns how many messages went with it."""
        request = queue_pb2.DeleteQueueRequest(queue=self.ref(queue), if_unused=if_unused, if_empty=if_empty)
        response: queue_pb2.DeleteQueueResponse = await self.call("DeleteQueue", request)
        return response.messages_deleted

    async def purge_queue(self, queue: str) -> int:
        """Remove every ready message; returns how many."""
        request = queue_pb2.PurgeQueueRequest(queue=self.ref(queue))
        response: queue_pb2.PurgeQueueResponse = await self.call("PurgeQueue", request)
        return response.messages_purged

    async def queue_status(self, queue: str) -> QueueStatus:
        """Depth, consumers, master, mirrors and sync state of `queue`."""
        request = queue_pb2.QueueStatusRequest(queue=self.ref(queue))
        response: queue_pb2.QueueStatusResponse = await self.call("QueueStatus", request)
        return QueueStatus.from_proto(response.queue)

    async def get(self, queue: str, *, no_ack: bool = False) -> Delivery | None:
        """Take one message, if any; settle it with `settle` unless `no_ack`."""
        request = queue_pb2.GetRequest(queue=self.ref(queue), no_ack=no_ack)
        started = time.monotonic()
        response: queue_pb2.GetResponse = await self.call("Get", request)
        if not response.found:
            return None
        delivery = Delivery(response.delivery, queue, None, 0)
        telemetry = self.telemetry
        _note_received(telemetry, queue, delivery, started)
        return delivery

    async def settle(self, delivery: Delivery, kind: str = "ack", *, multiple: bool = False) -> None:
        """Settle a delivery of `get` ("ack", "requeue" or "reject")."""
        request = queue_pb2.SettleRequest(
            queue=self.ref(delivery.queue),
            consumer_tag=delivery.consumer_tag,
            delivery_tag=delivery.delivery_tag,
            multiple=multiple,
            kind=_KINDS[kind],
        )
        await self.call("Settle", request)
        if self.telemetry.tracing:
            self.telemetry.settled(delivery.queue, delivery.headers, kind, delivery.message_id)

    # ----------------------------------------------- producers, consumers

    def producer(
        self,
        queue: str,
        *,
        publisher_id: str | None = None,
        window: int = 1000,
        batch: int = 100,
        persistent: bool = False,
    ) -> Producer:
        """A producer for `queue`. `persistent` messages of durable queues are on disk when confirmed.
        Close it (`async with connection.producer(queue) as producer:`), or the connection does."""
        producer = Producer(self, queue, publisher_id or uuid.uuid4().hex, window, batch, persistent)
        self._closing.append(producer.close)
        return producer

    def consumer(self, queue: str, *, prefetch: int = 100, priority: int = 0, consumer_tag: str = "") -> Consumer:
        """A consumer of `queue` (starts when first iterated or `start`ed). Close it (`async with
        connection.consumer(queue) as consumer:`), or the connection does."""
        consumer = Consumer(self, queue, prefetch, priority, consumer_tag)
        self._closing.append(consumer.close)
        return consumer

    # ------------------------------------------------------------ streams

    async def declare_stream(self, stream: str, *, groups: int = 3, durable: bool = True) -> streams.StreamStatus:
        """Declare an ordered stream of `groups` broker groups (or find it, if it exists alike)."""
        return await streams.declare_stream(self, stream, groups, durable)

    async def delete_stream(self, stream: str) -> None:
        await streams.delete_stream(self, stream)

    async def stream_status(self, stream: str) -> streams.StreamStatus:
        return await streams.stream_status(self, stream)

    async def list_streams(self, vhost: str | None = None) -> list[streams.StreamStatus]:
        return await streams.list_streams(self, vhost)

    async def stream_producer(
        self,
        stream: str,
        *,
        holder: str | None = None,
        lease_ttl_ms: int = streams.DEFAULT_LEASE_TTL_MS,
        window: int = 1000,
        batch: int = 100,
        persistent: bool = True,
    ) -> streams.StreamProducer:
        """The stream's active producer: returns once this instance holds the producer lease (a standby
        waits here while another holds it)."""
        producer = streams.StreamProducer(
            self, stream, holder or streams.holder_id(self), lease_ttl_ms, window, batch, persistent
        )
        await producer.start()
        self._closing.append(producer.close)
        return producer

    async def stream_consumer(
        self,
        stream: str,
        *,
        holder: str | None = None,
        lease_ttl_ms: int = streams.DEFAULT_LEASE_TTL_MS,
        prefetch: int = 100,
    ) -> streams.StreamConsumer:
        """The stream's active consumer: returns once this instance holds the consumer lease (a standby
        waits here while another holds it)."""
        consumer = streams.StreamConsumer(self, stream, holder or streams.holder_id(self), lease_ttl_ms, prefetch)
        await consumer.start()
        self._closing.append(consumer.close)
        return consumer

    def _closed(self, close: Callable[[], Awaitable[None]]) -> None:
        """A producer or consumer closed itself: the connection has nothing more to close for it."""
        with contextlib.suppress(ValueError):
            self._closing.remove(close)

    async def close(self) -> None:
        """Flush producers, cancel consumers, close the channels."""
        closing, self._closing = self._closing, []
        for close in reversed(closing):
            with contextlib.suppress(Exception):
                await close()
        await self.nodes.close()
        self.history.close()


@dataclass
class _Pending:
    body: bytes
    headers: dict[str, str]
    persistent: bool
    future: asyncio.Future[Outcome]
    span: trace.Span | None = None
    started: float = 0.0  # when it was sent, if metrics are on


class Producer:
    """Publishes to one queue with confirms, an idempotent publisher id and a bounded window."""

    def __init__(
        self, connection: Connection, queue: str, publisher_id: str, window: int, batch: int, persistent: bool
    ) -> None:
        if window < 1 or batch < 1:
            raise ValueError("window and batch must be at least 1")
        self.connection = connection
        self.queue = queue
        self.publisher_id = publisher_id
        # How the broker keeps it (what deliveries, spans and histories show): on a TLS cluster, where
        # publisher ids are scoped to their user, USER\x1fID; else the id itself.
        credentials = connection.credentials
        scoped = connection.tls is not None and credentials is not None
        self.scoped_id = f"{credentials.user}\x1f{publisher_id}" if scoped and credentials else publisher_id
        self.window = window
        self.batch = batch
        self.persistent = persistent
        self.next_seq = 1
        self.resends = 0  # streams reopened after a break
        self._unconfirmed: dict[int, _Pending] = {}
        self._unsent: deque[int] = deque()
        self._room = asyncio.Semaphore(window)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._runner: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def unconfirmed(self) -> int:
        return len(self._unconfirmed)

    def transaction(self, consumer: Consumer | None = None) -> Transaction:
        """A transaction of this producer's messages and `consumer`'s acknowledgements (ringq.transaction):
        `async with producer.transaction(consumer) as tx:` commits on leaving, rolls back on an exception."""
        return Transaction(self, consumer)

    async def send(
        self,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        persistent: bool | None = None,
        callback: Callable[[asyncio.Future[Outcome]], None] | None = None,
    ) -> asyncio.Future[Outcome]:
        """Queue `body` for publishing once the window has room; returns a future of its outcome."""
        if self._closing:
            raise RuntimeError("the producer is closed")
        await self._room.acquire()
        seq = self.next_seq
        self.next_seq += 1
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        if callback is not None:
            future.add_done_callback(callback)
        pending = _Pending(body, dict(headers or {}), self.persistent if persistent is None else persistent, future)
        history = self.connection.history
        telemetry = self.connection.telemetry
        if telemetry.tracing:
            pending.span = telemetry.publish_span(self.queue, self.scoped_id, seq, len(body), self.connection.address)
            tracing.inject(pending.headers, pending.span)
        if telemetry.metering:
            pending.started = time.monotonic()
        if history.on:
            history.record("publish", queue=self.queue, publisher=self.scoped_id, seq=seq)
        self._unconfirmed[seq] = pending
        self._unsent.append(seq)
        self._idle.clear()
        self._wake.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        return future

    async def publish(
        self, body: bytes, *, headers: Mapping[str, str] | None = None, persistent: bool | None = None
    ) -> Outcome:
        """Publish one message and wait for its confirm (`persistent`: default the producer's)."""
        return await (await self.send(body, headers=headers, persistent=persistent))

    async def publish_many(
        self, bodies: Sequence[bytes], *, headers: Mapping[str, str] | None = None, persistent: bool | None = None
    ) -> list[Outcome]:
        """Publish messages in order (each with `headers`) and wait for every confirm."""
        futures = [await self.send(body, headers=headers, persistent=persistent) for body in bodies]
        return list(await asyncio.gather(*futures))

    async def flush(self) -> None:
        """Wait until every message sent so far is confirmed (or failed)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Flush (every message sent so far is confirmed or failed), then end the stream; idempotent."""
        await self.flush()
        self._closing = True
        self._wake.set()
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._runner
        self.connection._closed(self.close)

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # ----------------------------------------------------------- the stream

    async def _run(self) -> None:
        """Keep a publish stream open while messages are unconfirmed; fail them when retries run out."""
        try:
            await self.connection.reach()
            while self._unconfirmed:
                async for attempt in self.connection.retrying(STREAM_RETRYABLE):
                    with attempt:
                        await self._stream()
        except grpc.aio.AioRpcError as error:
            self._fail_all(self.connection.error(error))
        except RingqError as error:
            self._fail_all(error)

    async def _stream(self) -> None:
        call = self.connection.stub().Publish()
        self._unsent = deque(sorted(self._unconfirmed))  # everything unconfirmed goes (again), in order
        progressed = False

        async def write() -> None:
            # A write fails once the broker ended the stream; the reader then sees the real status.
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                while self._unconfirmed or not self._closing:
                    if not self._unsent:
                        self._wake.clear()
                        await self._wake.wait()
                        continue
                    seqs = [self._unsent.popleft() for _ in range(min(self.batch, len(self._unsent)))]
                    request = self._request(seqs)
                    if request.messages:  # a request without messages is refused: none left unconfirmed
                        await call.write(request)

        writer = asyncio.ensure_future(write())
        try:
            async for response in call:
                for seq, outcome in zip(response.seqs, response.outcomes, strict=True):
                    self._settled(seq, _OUTCOMES.get(outcome, Outcome.CONFIRMED))
                progressed = True
                if not self._unconfirmed:
                    self._idle.set()
        except grpc.aio.AioRpcError as error:
            self.resends += error.code() in STREAM_RETRYABLE
            _stream_broke(self.connection, error, progressed)
        finally:
            writer.cancel()
            call.cancel()

    def _request(self, seqs: list[int]) -> queue_pb2.PublishRequest:
        """A request of the messages of `seqs` still unconfirmed, built in place: a message built on its own and
        then copied into the request took twice as long (1.0 against 0.5 us for a 256-byte body). make bench's
        W1 and W2 were not lower with it in 12 pairs taken in ABBA order (docs/benchmarks.md, fifteenth update)."""
        request = queue_pb2.PublishRequest(queue=self.connection.ref(self.queue), publisher=self.publisher_id)
        add = request.messages.add
        unconfirmed = self._unconfirmed
        for seq in seqs:
            pending = unconfirmed.get(seq)
            if pending is None:
                continue
            message = add(body=pending.body, seq=seq, persistent=pending.persistent)
            if pending.headers:  # an empty map passed as an argument costs twice the rest of the message
                message.headers.update(pending.headers)
        return request

    def _settled(self, seq: int, outcome: Outcome) -> None:
        pending = self._unconfirmed.pop(seq, None)
        if pending is None:
            return
        self._room.release()
        if pending.span is not None or pending.started:
            self.connection.telemetry.published(self.queue, pending.span, pending.started, outcome.value, None)
        history = self.connection.history
        if history.on:
            history.record("confirm", queue=self.queue, publisher=self.scoped_id, seq=seq, outcome=outcome.value)
        if not pending.future.done():
            pending.future.set_result(outcome)

    def _fail_all(self, error: RingqError) -> None:
        history = self.connection.history
        for seq, pending in sorted(self._unconfirmed.items()):
            self._room.release()
            if pending.span is not None or pending.started:
                self.connection.telemetry.published(self.queue, pending.span, pending.started, None, error.code.name)
            if history.on:
                history.record("nack", queue=self.queue, publisher=self.scoped_id, seq=seq, error=str(error.code))
            if not pending.future.done():
                pending.future.set_exception(error)
        self._unconfirmed.clear()
        self._idle.set()


class Delivery:
    """A message delivered to a consumer (or taken by `get`).

    What every consumer reads (the body, the delivery tag, the publisher's name and sequence number, the
    redelivered flag) is copied out of the response at once; the rest (headers, delivery count, message
    id, consumer tag) is read from it when first asked for: copying all ten fields took 1.5 us a message,
    a tenth of a consumer's cost per message (issue 13)."""

    __slots__ = (
        "_consumer",
        "_headers",
        "_message",
        "_stream",
        "body",
        "delivery_tag",
        "publisher",
        "queue",
        "redelivered",
        "seq",
    )

    def __init__(self, message: queue_pb2.QueueDelivery, queue: str, consumer: Consumer | None, stream: int) -> None:
        self.queue = queue
        self.body = message.body
        self.redelivered = message.redelivered
        self.publisher = message.publisher
        self.seq = message.seq
        self.delivery_tag = message.delivery_tag
        self._message = message
        self._headers: dict[str, str] | None = None
        self._consumer = consumer
        self._stream = stream

    @property
    def headers(self) -> dict[str, str]:
        headers = self._headers
        if headers is None:
            headers = self._headers = dict(self._message.headers)
        return headers

    @property
    def delivery_count(self) -> int:
        return self._message.delivery_count

    @property
    def message_id(self) -> int:
        return self._message.message_id

    @property
    def consumer_tag(self) -> str:
        return self._message.consumer_tag

    def __repr__(self) -> str:
        return (
            f"Delivery(queue={self.queue!r}, publisher={self.publisher!r}, seq={self.seq}, "
            f"message_id={self.message_id}, redelivered={self.redelivered})"
        )

    def ack(self, *, multiple: bool = False) -> bool:
        """Acknowledge (processed). False if its consumer's stream is gone (it comes back redelivered)."""
        return self._settle("ack", multiple)

    def nack(self, *, requeue: bool = True, multiple: bool = False) -> bool:
        """Negative acknowledgement: requeue it (default) or drop / dead-letter it."""
        return self._settle("requeue" if requeue else "reject", multiple)

    def reject(self) -> bool:
        """Drop it (dead-lettered if the queue says so)."""
        return self._settle("reject", False)

    def _settle(self, kind: str, multiple: bool) -> bool:
        if self._consumer is None:
            raise RuntimeError("a delivery of get() is settled with Connection.settle()")
        return self._consumer.settle(self, kind, multiple)


@dataclass
class _Stream:
    """One Consume stream of a consumer: deliveries of an earlier stream cannot be settled on it."""

    number: int
    settlements: list[queue_pb2.Settlement] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closing: bool = False  # write what is queued, then half-close: the queue applies it and ends the stream
    # Deliveries handed to the application and not settled yet: delivery tag -> (publisher, seq), or None
    # for a message published without a seq (it cannot be recognised again).
    unsettled: dict[int, tuple[str, int] | None] = field(default_factory=dict)


@dataclass
class _Handler:
    """A `Consumer.run(callback)` under way: the task reading the stream calls `callback` itself."""

    callback: Callable[[Delivery], Awaitable[None] | None]
    ended: asyncio.Future[None]  # run() returns (a result) or raises (the consumer's or the callback's error)


class Consumer:
    """Consumes one queue: iterate it (`async for delivery in consumer`) or `run(callback)`."""

    def __init__(self, connection: Connection, queue: str, prefetch: int, priority: int, consumer_tag: str) -> None:
        self.connection = connection
        self.queue = queue
        self.prefetch = prefetch
        self.priority = priority
        self.consumer_tag = consumer_tag
        self.resumes = 0  # streams reopened after a failover
        self.acked_redeliveries = 0  # redeliveries of messages acknowledged before: acked again, not handed over
        self._acked: OrderedDict[tuple[str, int], None] = OrderedDict()  # (publisher, seq) acknowledged lately
        self._deliveries: asyncio.Queue[Delivery | BaseException | None] = asyncio.Queue()
        self._stream = _Stream(0)
        self._runner: asyncio.Task[None] | None = None
        self._handler: _Handler | None = None  # set while run(callback) takes the deliveries
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._closing = False

    def start(self) -> None:
        """Attach the consumer now (iterating starts it too)."""
        if self._runner is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            self._runner = asyncio.ensure_future(self._run())

    def __aiter__(self) -> AsyncIterator[Delivery]:
        self.start()
        return self

    async def __anext__(self) -> Delivery:
        self.start()
        item = await self._deliveries.get()
        if item is None:
            self._deliveries.put_nowait(None)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def run(self, callback: Callable[[Delivery], Awaitable[None] | None]) -> None:
        """Call `callback` with each delivery until the consumer is closed (it settles them); each call is a
        `process {queue}` span (with tracing on, for a traced message), its parent the message's publish.

        The calls come one at a time, in delivery order, from the consumer's own task that reads the stream
        (a delivery reaches the callback without a hand-off to another task: 20-50 us sooner at the median
        at 2,000 msgs/s, issue 13). An exception from `callback` ends run() with it, and the consumer goes on for an
        iteration; so does cancelling run(). Called from `callback`, `close()` returns at once: the consumer
        closes once the callback has returned."""
        self.start()
        while True:  # first what was queued for an iteration before, in order
            try:
                item = self._deliveries.get_nowait()
            except asyncio.QueueEmpty:
                break
            if item is None:
                self._deliveries.put_nowait(None)
                return
            if isinstance(item, BaseException):
                raise item
            await self._call(callback, item)
        handler = self._handler = _Handler(callback, asyncio.get_running_loop().create_future())
        try:
            await handler.ended
        finally:
            if self._handler is handler:
                self._handler = None

    async def _call(self, callback: Callable[[Delivery], Awaitable[None] | None], delivery: Delivery) -> None:
        with self.processing(delivery):
            result = callback(delivery)
            if result is not None:
                await result

    async def _handle(self, handler: _Handler, delivery: Delivery) -> None:
        """`delivery` to run()'s callback, in the reading task; the callback's exception ends run() with it."""
        try:
            await self._call(handler.callback, delivery)
        except Exception as error:
            if self._handler is handler:
                self._handler = None
            if not handler.ended.done():
                handler.ended.set_exception(error)

    def _finish(self, end: BaseException | None) -> None:
        """The consumer closed (None) or failed: run() returns or raises it, an iteration ends or raises it."""
        handler, self._handler = self._handler, None
        if handler is not None and not handler.ended.done():
            if end is not None:
                handler.ended.set_exception(end)
                return
            handler.ended.set_result(None)
        self._deliveries.put_nowait(end)

    def processing(self, delivery: Delivery) -> contextlib.AbstractContextManager[None]:
        """Around the application's handling of `delivery`: a `process {queue}` span, current while it runs
        (the application's own spans become its children), and messaging.process.duration."""
        telemetry = self.connection.telemetry
        if not (telemetry.tracing or telemetry.metering):
            return contextlib.nullcontext()
        return telemetry.processing(self.queue, delivery.headers, delivery.message_id)

    def settle(self, delivery: Delivery, kind: str, multiple: bool) -> bool:
        """Queue a settlement on the stream `delivery` came from (thread-safe); False if that stream is gone."""
        stream = self._stream
        if delivery._stream != stream.number:
            return False
        settlement = queue_pb2.Settlement(delivery_tag=delivery.delivery_tag, multiple=multiple, kind=_KINDS[kind])
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._queue_settlement, stream, settlement)
        else:
            self._queue_settlement(stream, settlement)
        telemetry = self.connection.telemetry
        if telemetry.tracing:
            telemetry.settled(self.queue, delivery.headers, kind, delivery.message_id)
        history = self.connection.history
        if history.on and kind == "ack":
            history.record(
                "ack", queue=self.queue, publisher=delivery.publisher, seq=delivery.seq, message_id=delivery.message_id
            )
        return True

    def acknowledged_elsewhere(self, deliveries: Sequence[Delivery]) -> None:
        """These deliveries were acknowledged by a committed transaction: forget them as acknowledged."""
        stream = self._stream
        for delivery in deliveries:
            if delivery._stream == stream.number:
                key = stream.unsettled.pop(delivery.delivery_tag, None)
                if key is not None:
                    self._acked[key] = None

    def _queue_settlement(self, stream: _Stream, settlement: queue_pb2.Settlement) -> None:
        tag, unsettled = settlement.delivery_tag, stream.unsettled
        if settlement.multiple:
            tags = []
            for unsettled_tag in unsettled:  # in delivery order: a stream's delivery tags only grow
                if unsettled_tag > tag:
                    break
                tags.append(unsettled_tag)
        else:
            tags = [tag]
        if settlement.kind == queue_pb2.SETTLE_KIND_ACK:
            acked = self._acked
            for settled in tags:
                key = unsettled.pop(settled, None)
                if key is not None:
                    acked[key] = None
            while len(acked) > ACKED_MEMORY:
                acked.popitem(last=False)
        else:
            for settled in tags:
                unsettled.pop(settled, None)
        stream.settlements.append(settlement)
        stream.wake.set()

    def _already_acked(self, stream: _Stream, delivery: Delivery) -> bool:
        """True for a redelivery of a message this consumer acknowledged (its ack went with a master that
        died): it is acknowledged again here and not handed to the application twice."""
        key = (delivery.publisher, delivery.seq) if delivery.publisher and delivery.seq else None
        if delivery.redelivered and key is not None and key in self._acked:
            self.acked_redeliveries += 1
            ack = queue_pb2.Settlement(delivery_tag=delivery.delivery_tag, kind=queue_pb2.SETTLE_KIND_ACK)
            self._queue_settlement(stream, ack)
            return True
        stream.unsettled[delivery.delivery_tag] = key
        return False

    async def close(self, timeout: float = 5.0) -> None:
        """Cancel the consumer: the settlements queued so far are sent, the queue applies them and ends
        the stream (within `timeout` seconds, else the stream is cancelled); what was not settled is
        requeued by the queue."""
        self._closing = True
        self._stream.closing = True
        self._stream.wake.set()
        runner = self._runner
        if runner is asyncio.current_task() and runner is not None:
            # From run()'s callback, which runs in the runner: it ends once the callback returns.
            overdue = asyncio.get_running_loop().call_later(timeout, runner.cancel)

            def ended(_: object) -> None:
                overdue.cancel()
                self._closed()

            runner.add_done_callback(ended)
            return
        if runner is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(runner), timeout)
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        self._closed()

    def _closed(self) -> None:
        self._finish(None)
        self.connection._closed(self.close)

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _run(self) -> None:
        try:
            await self.connection.reach()
            while not self._closing:
                async for attempt in self.connection.retrying(STREAM_RETRYABLE):
                    with attempt:
                        await self._consume()
        except grpc.aio.AioRpcError as error:
            self._finish(self.connection.error(error))
        except RingqError as error:
            self._finish(error)

    async def _consume(self) -> None:
        stream = self._stream = _Stream(self._stream.number + 1)
        call = self.connection.stub().Consume()
        attach = queue_pb2.ConsumeRequest(
            queue=self.connection.ref(self.queue),
            consumer_tag=self.consumer_tag,
            prefetch=self.prefetch,
            priority=self.priority,
        )

        async def write() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(attach)
                while True:
                    await stream.wake.wait()
                    if len(stream.settlements) < ACK_BATCH and not stream.closing:
                        await asyncio.sleep(ACK_LINGER)  # let acks gather: one request carries many
                    stream.wake.clear()
                    settlements, stream.settlements = stream.settlements, []
                    if settlements:
                        await call.write(queue_pb2.ConsumeRequest(settlements=settlements))
                    if stream.closing and not stream.settlements:
                        await call.done_writing()
                        return

        writer = asyncio.ensure_future(write())
        progressed = False
        try:
            async for response in call:
                progressed = True
                for message in response.deliveries:
                    delivery = Delivery(message, self.queue, self, stream.number)
                    if self._receive(stream, delivery):
                        handler = self._handler
                        if handler is None:
                            self._deliveries.put_nowait(delivery)
                        else:
                            await self._handle(handler, delivery)
            if self._closing:
                return  # the queue applied our settlements and ended the stream
            raise grpc.aio.AioRpcError(  # the broker ended the stream: treat it as a node going away
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "the consume stream ended", None
            )
        except grpc.aio.AioRpcError as error:
            self.resumes += error.code() in STREAM_RETRYABLE
            _stream_broke(self.connection, error, progressed)
        finally:
            writer.cancel()
            call.cancel()

    def _receive(self, stream: _Stream, delivery: Delivery) -> bool:
        """Whether a delivery of `stream` goes to the application (not a redelivery of one acknowledged);
        if so, note it received."""
        if self._already_acked(stream, delivery):
            return False
        telemetry = self.connection.telemetry
        _note_received(telemetry, self.queue, delivery)
        history = self.connection.history
        if history.on:
            history.record(
                "deliver",
                queue=self.queue,
                publisher=delivery.publisher,
                seq=delivery.seq,
                message_id=delivery.message_id,
                redelivered=delivery.redelivered,
                delivery_count=delivery.delivery_count,
            )
        return True


class Admin:
    """Policies and cluster status through any broker node's AdminService; queues through `Connection`.

    admin = Admin(["127.0.0.1:7101", "127.0.0.1:7102"])
    await admin.set_policy("ha-two", "^ha\\.", {"ha-mode": "exactly", "ha-params": 2})

    Each call goes to the node that answered last (at first, the first to accept a connection), then to
    the others in the order given while they answer UNAVAILABLE. `timeout`: seconds per attempt;
    `connect_timeout`, `tls` and `credentials` as for `Connection`. Every failure is a
    `ringq.errors.RingqError` (`Unavailable` naming each node when none answered).
    """

    def __init__(
        self,
        nodes: Sequence[str] | str,
        *,
        vhost: str = "/",
        timeout: float = 5.0,
        connect_timeout: float = 5.0,
        tls: TLS | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.nodes = Nodes(nodes, tls=tls, connect_timeout=connect_timeout)
        self.addresses = self.nodes.addresses
        self.vhost = vhost
        self.timeout = timeout
        self.tls = tls
        self.credentials = credentials

    async def __aenter__(self) -> Admin:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any) -> Any:
        nodes = self.nodes
        await nodes.reach()
        last: grpc.aio.AioRpcError | None = None
        for _ in nodes.addresses:
            address = nodes.address
            stub = authenticated(admin_pb2_grpc.AdminServiceStub(nodes.channel(address)), self.credentials)
            try:
                response = await getattr(stub, method)(request, timeout=self.timeout)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE:
                    raise from_rpc_error(error, address) from None
                nodes.note(address, error)
                nodes.next()
                last = error
            else:
                nodes.answered(address)
                return response
        assert last is not None
        attempts = nodes.attempts()
        raise Unavailable(
            f"no node answered {method}: {attempts_text(attempts)}",
            code=last.code(),
            details=last.details() or "",
            attempts=attempts,
        )

    async def set_policy(
        self, name: str, pattern: str, definition: Mapping[str, Any], *, priority: int = 0, apply_to: str = "queues"
    ) -> None:
        """Create or replace a policy (RabbitMQ's keys: ha-mode, ha-params, ha-sync-mode, message-ttl, ...)."""
        policy = cluster_pb2.Policy(
            vhost=self.vhost,
            name=name,
            pattern=pattern,
            definition_json=json.dumps(dict(definition)),
            priority=priority,
            apply_to=apply_to,
        )
        await self._call("SetPolicy", cluster_pb2.SetPolicyRequest(policy=policy))

    async def clear_policy(self, name: str) -> None:
        await self._call("ClearPolicy", cluster_pb2.ClearPolicyRequest(vhost=self.vhost, name=name))

    async def list_policies(self) -> list[Policy]:
        """The policies of this Admin's vhost."""
        response = await self._call("ListPolicies", cluster_pb2.ListPoliciesRequest(vhost=self.vhost))
        return [Policy.from_proto(p) for p in response.policies]

    async def list_queues(self) -> list[QueueRecord]:
        """The queues of this Admin's vhost as the coordinator records them (placement, policy, arguments)."""
        response = await self._call("ListQueues", cluster_pb2.ListQueuesRequest(vhost=self.vhost))
        return [QueueRecord.from_proto(q) for q in response.queues]

    async def cluster_status(self) -> ClusterStatus:
        """The nodes (liveness, draining, disk and memory), the coordinators and the store kind."""
        response: cluster_pb2.ClusterStatusResponse = await self._call(
            "ClusterStatus", cluster_pb2.ClusterStatusRequest()
        )
        return ClusterStatus.from_proto(response)

    async def forget_node(self, node: str) -> list[QueueRecord]:
        """Remove a node that is gone for good; the queues deleted with it (they lived only there)."""
        response: cluster_pb2.ForgetNodeResponse = await self._call(
            "ForgetNode", cluster_pb2.ForgetNodeRequest(node=node)
        )
        return [QueueRecord.from_proto(q) for q in response.deleted_queues]

    # ------------------------------------------------- users, vhosts, permissions (administrators)

    async def add_user(self, name: str, password: str, tags: Sequence[str] = ()) -> None:
        """Create a user, or replace its password and tags (administrator, monitoring, policymaker, management)."""
        await self._call("AddUser", access_pb2.AddUserRequest(name=name, password=password, tags=list(tags)))

    async def delete_user(self, name: str) -> None:
        await self._call("DeleteUser", access_pb2.DeleteUserRequest(name=name))

    async def change_password(self, name: str, password: str) -> None:
        await self._call("ChangePassword", access_pb2.ChangePasswordRequest(name=name, password=password))

    async def list_users(self) -> list[User]:
        return [User.from_proto(u) for u in (await self._call("ListUsers", access_pb2.ListUsersRequest())).users]

    async def add_vhost(self, name: str) -> None:
        await self._call("AddVhost", access_pb2.AddVhostRequest(name=name))

    async def delete_vhost(self, name: str) -> None:
        await self._call("DeleteVhost", access_pb2.DeleteVhostRequest(name=name))

    async def list_vhosts(self) -> list[str]:
        return list((await self._call("ListVhosts", access_pb2.ListVhostsRequest())).vhosts)

    async def set_permissions(self, user: str, *, configure: str = "", write: str = "", read: str = "") -> None:
        """What `user` may do in this Admin's vhost: RE2 patterns of names ("" : nothing)."""
        permission = access_pb2.Permission(user=user, vhost=self.vhost, configure=configure, write=write, read=read)
        await self._call("SetPermissions", access_pb2.SetPermissionsRequest(permission=permission))

    async def clear_permissions(self, user: str) -> None:
        await self._call("ClearPermissions", access_pb2.ClearPermissionsRequest(user=user, vhost=self.vhost))

    async def list_permissions(self) -> list[Permission]:
        response = await self._call("ListPermissions", access_pb2.ListPermissionsRequest(vhost=self.vhost))
        return [Permission.from_proto(p) for p in response.permissions]

    async def close(self) -> None:
        await self.nodes.close()


def _note_received(
    telemetry: tracing.ClientTelemetry, queue: str, delivery: Delivery, started: float | None = None
) -> None:
    """Tell the client's telemetry a delivery reached the application (`started`: when a get began)."""
    if telemetry.tracing or telemetry.metering:
        telemetry.received(
            queue,
            delivery.headers,
            delivery.message_id,
            delivery.publisher,
            delivery.seq,
            delivery.redelivered,
            delivery.delivery_count,
            len(delivery.body),
            started,
        )
