"""The blocking API of the ringq Python SDK, for code without an event loop.

Responsible for: the same Connection / Producer / Consumer / Admin as
ringq/aio.py, run on one background event-loop thread shared by every
blocking connection of the process. Guarantees: those of ringq/aio.py, with
the same typed arguments and the same results (ringq.models dataclasses) and
errors (ringq.errors); `Producer.send` blocks while the window is full
(back-pressure) and returns a `concurrent.futures.Future`; callbacks run on
the background thread. Ordered streams (ringq/streams.py) likewise:
`stream_producer` / `stream_consumer` block until this process holds the
stream's producer / consumer lease (a standby waits there), and a
`StreamMessage` it delivers may be acknowledged from any thread.

    from ringq import Connection

    with Connection(["127.0.0.1:7101", "127.0.0.1:7102"]) as connection:
        connection.declare_queue("orders", durable=True)
        producer = connection.producer("orders")
        producer.publish(b"hello")                         # returns once confirmed
        for delivery in connection.consumer("orders", prefetch=100):
            print(delivery.body)
            delivery.ack()

        connection.declare_stream("events", groups=3)
        with connection.stream_producer("events") as producer:
            seq = producer.publish(b"event 1")               # its stream_seq, once both replicas hold it
        with connection.stream_consumer("events") as consumer:
            for message in consumer:                         # in stream order
                message.ack()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from opentelemetry import metrics, trace

from ringq import aio, streams
from ringq.aio import Delivery, Outcome
from ringq.models import ClusterStatus, Permission, Policy, QueueRecord, QueueStatus, User
from ringq.security import TLS, Credentials
from ringq.streams import StreamMessage, StreamStatus

T = TypeVar("T")
_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="ringq-sdk", daemon=True).start()
            _loop = loop
        return _loop


def _run(coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    return asyncio.run_coroutine_threadsafe(coroutine, _background_loop()).result(timeout)


async def _made(factory: Callable[[], T]) -> T:
    return factory()


class Connection:
    """A blocking connection to a ringq cluster; see ringq.aio.Connection for the arguments."""

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
        def made() -> aio.Connection:
            return aio.Connection(
                addresses,
                vhost=vhost,
                name=name,
                history=history,
                retry_for=retry_for,
                call_timeout=call_timeout,
                connect_timeout=connect_timeout,
                tls=tls,
                credentials=credentials,
                tracer_provider=tracer_provider,
                meter_provider=meter_provider,
            )

        self.aio: aio.Connection = _run(_made(made))

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def declare_queue(
        self,
        queue: str,
        *,
        durable: bool = False,
        auto_delete: bool = False,
        exclusive_owner: str = "",
        arguments: Mapping[str, Any] | None = None,
    ) -> QueueStatus:
        """Declare `queue` (or find it, if it exists with the same properties); its status."""
        return _run(
            self.aio.declare_queue(
                queue, durable=durable, auto_delete=auto_delete, exclusive_owner=exclusive_owner, arguments=arguments
            )
        )

    def delete_queue(self, queue: str, *, if_unused: bool = False, if_empty: bool = False) -> int:
        """Delete `queue`; how many messages went with it."""
        return _run(self.aio.delete_queue(queue, if_unused=if_unused, if_empty=if_empty))

    def purge_queue(self, queue: str) -> int:
        """Remove every ready message; how many."""
        return _run(self.aio.purge_queue(queue))

    def queue_status(self, queue: str) -> QueueStatus:
        """Depth, consumers, master, mirrors and sync state of `queue`."""
        return _run(self.aio.queue_status(queue))

    def get(self, queue: str, *, no_ack: bool = False) -> Delivery | None:
        return _run(self.aio.get(queue, no_ack=no_ack))

    def settle(self, delivery: Delivery, kind: str = "ack", *, multiple: bool = False) -> None:
        _run(self.aio.settle(delivery, kind, multiple=multiple))

    def producer(
        self,
        queue: str,
        *,
        publisher_id: str | None = None,
        window: int = 1000,
        batch: int = 100,
        persistent: bool = False,
    ) -> Producer:
        """A producer for `queue` (see ringq.aio.Connection.producer); `with connection.producer(q) as p:`."""

        def made() -> aio.Producer:  # on the loop's thread, as every SDK object
            return self.aio.producer(
                queue, publisher_id=publisher_id, window=window, batch=batch, persistent=persistent
            )

        return Producer(_run(_made(made)))

    def consumer(self, queue: str, *, prefetch: int = 100, priority: int = 0, consumer_tag: str = "") -> Consumer:
        """A consumer of `queue` (starts when first iterated); `with connection.consumer(q) as c:`."""

        def made() -> aio.Consumer:
            return self.aio.consumer(queue, prefetch=prefetch, priority=priority, consumer_tag=consumer_tag)

        return Consumer(_run(_made(made)))

    # ------------------------------------------------------------ streams

    def declare_stream(self, stream: str, *, groups: int = 3, durable: bool = True) -> StreamStatus:
        """Declare an ordered stream of `groups` broker groups (or find it, if it exists alike)."""
        return _run(self.aio.declare_stream(stream, groups=groups, durable=durable))

    def delete_stream(self, stream: str) -> None:
        """Delete `stream`, its groups and their messages."""
        _run(self.aio.delete_stream(stream))

    def stream_status(self, stream: str) -> StreamStatus:
        """The stream's send and consume lists, groups, lease holders, and why consumption waits if it does."""
        return _run(self.aio.stream_status(stream))

    def list_streams(self, vhost: str | None = None) -> list[StreamStatus]:
        """Every stream of `vhost` (the connection's if None; every vhost if "")."""
        return _run(self.aio.list_streams(vhost))

    def stream_producer(
        self,
        stream: str,
        *,
        holder: str | None = None,
        lease_ttl_ms: int = streams.DEFAULT_LEASE_TTL_MS,
        window: int = 1000,
        batch: int = 100,
        persistent: bool = True,
    ) -> StreamProducer:
        """The stream's active producer (see ringq.aio.Connection.stream_producer): returns once this
        instance holds the producer lease, blocking while another holds it; `with ... as producer:`."""
        return StreamProducer(
            _run(
                self.aio.stream_producer(
                    stream,
                    holder=holder,
                    lease_ttl_ms=lease_ttl_ms,
                    window=window,
                    batch=batch,
                    persistent=persistent,
                )
            )
        )

    def stream_consumer(
        self,
        stream: str,
        *,
        holder: str | None = None,
        lease_ttl_ms: int = streams.DEFAULT_LEASE_TTL_MS,
        prefetch: int = 100,
    ) -> StreamConsumer:
        """The stream's active consumer (see ringq.aio.Connection.stream_consumer): returns once this
        instance holds the consumer lease, blocking while another holds it; `with ... as consumer:`."""
        return StreamConsumer(
            _run(self.aio.stream_consumer(stream, holder=holder, lease_ttl_ms=lease_ttl_ms, prefetch=prefetch))
        )

    def close(self) -> None:
        _run(self.aio.close())


class Producer:
    """Blocking producer: `publish` waits for the confirm, `send` only for room in the window."""

    def __init__(self, producer: aio.Producer) -> None:
        self.aio = producer

    def send(
        self,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        persistent: bool | None = None,
        callback: Callable[[concurrent.futures.Future[Outcome]], None] | None = None,
    ) -> concurrent.futures.Future[Outcome]:
        """Queue `body` (blocks while the window is full); the future completes with its outcome."""
        result: concurrent.futures.Future[Outcome] = concurrent.futures.Future()
        if callback is not None:
            result.add_done_callback(callback)

        async def send() -> None:
            future = await self.aio.send(body, headers=headers, persistent=persistent)
            future.add_done_callback(lambda done: _copy(done, result))

        _run(send())
        return result

    def publish(
        self, body: bytes, *, headers: Mapping[str, str] | None = None, persistent: bool | None = None
    ) -> Outcome:
        """Publish one message and wait for its confirm."""
        return self.send(body, headers=headers, persistent=persistent).result()

    def publish_many(
        self, bodies: Sequence[bytes], *, headers: Mapping[str, str] | None = None, persistent: bool | None = None
    ) -> list[Outcome]:
        """Publish messages in order and wait for every confirm."""
        return _run(self.aio.publish_many(bodies, headers=headers, persistent=persistent))

    def flush(self) -> None:
        """Wait until every message sent so far is confirmed (or failed)."""
        _run(self.aio.flush())

    def close(self) -> None:
        """Flush, then end the stream; idempotent."""
        _run(self.aio.close())

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _copy(done: asyncio.Future[T], result: concurrent.futures.Future[T]) -> None:
    if done.cancelled():
        result.cancel()
        return
    error = done.exception()
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(done.result())


class Consumer:
    """Blocking consumer: iterate it, or `run(callback)`; settle with `delivery.ack()` etc."""

    def __init__(self, consumer: aio.Consumer) -> None:
        self.aio = consumer

    def __iter__(self) -> Iterator[Delivery]:
        while True:
            try:
                yield _run(self.aio.__anext__())
            except StopAsyncIteration:
                return

    def next(self, timeout: float | None = None) -> Delivery | None:
        """The next delivery, or None after `timeout` seconds or once closed."""
        try:
            return _run(asyncio.wait_for(self.aio.__anext__(), timeout))
        except (TimeoutError, StopAsyncIteration):
            return None

    def run(self, callback: Callable[[Delivery], None]) -> None:
        """Call `callback` with each delivery (on this thread) until the consumer is closed; each call is a
        `process {queue}` span as in ringq.aio.Consumer.run."""
        for delivery in self:
            with self.aio.processing(delivery):
                callback(delivery)

    def close(self) -> None:
        """Send the settlements made so far, then cancel the consumer (the queue requeues what was not
        settled); idempotent."""
        _run(self.aio.close())

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class StreamProducer:
    """Blocking producer of an ordered stream: `publish` waits for the confirm and returns the message's
    stream_seq, `send` waits only for room in the window."""

    def __init__(self, producer: streams.StreamProducer) -> None:
        self.aio = producer

    @property
    def fencing_token(self) -> int:
        """The token of this producer's lease (the high 32 bits of its stream_seqs)."""
        return self.aio.fencing_token

    @property
    def resends(self) -> int:
        """Publish streams reopened after a failure (each resent what was unconfirmed)."""
        return self.aio.resends

    @property
    def groups_used(self) -> list[str]:
        """The send groups in the order they confirmed messages."""
        return list(self.aio.groups_used)

    def send(
        self,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        persistent: bool | None = None,
        callback: Callable[[concurrent.futures.Future[int]], None] | None = None,
    ) -> concurrent.futures.Future[int]:
        """Queue `body` (blocks while the window is full); the future completes with its stream_seq once
        both replicas hold it, or with the error (a lost lease, retries exhausted)."""
        result: concurrent.futures.Future[int] = concurrent.futures.Future()
        if callback is not None:
            result.add_done_callback(callback)

        async def send() -> None:
            future = await self.aio.send(body, headers=headers, persistent=persistent)
            future.add_done_callback(lambda done: _copy(done, result))

        _run(send())
        return result

    def publish(self, body: bytes, *, headers: Mapping[str, str] | None = None, persistent: bool | None = None) -> int:
        """Publish one message and wait for its confirm; its stream_seq."""
        return self.send(body, headers=headers, persistent=persistent).result()

    def publish_many(self, bodies: Sequence[bytes]) -> list[int]:
        """Publish messages in order and wait for every confirm; their stream_seqs."""
        return _run(self.aio.publish_many(bodies))

    def flush(self) -> None:
        """Wait until every message sent so far is confirmed (or failed)."""
        _run(self.aio.flush())

    def close(self) -> None:
        """Flush, end the publish stream and give the lease up (a standby takes over at once); idempotent."""
        _run(self.aio.close())

    def __enter__(self) -> StreamProducer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class _ThreadSafeStreamMessage(StreamMessage):
    """A StreamMessage whose `ack()` may be called from any thread: the ack is queued on the SDK's loop."""

    def ack(self) -> None:
        if self._consumer is not None:
            _background_loop().call_soon_threadsafe(self._consumer.ack, self)


class StreamConsumer:
    """Blocking consumer of an ordered stream: iterate it, or `next(timeout)`; acknowledge each message with
    `message.ack()` (from any thread). Iteration ends once the consumer is closed, also from another
    thread; a lost lease raises."""

    def __init__(self, consumer: streams.StreamConsumer) -> None:
        self.aio = consumer
        self._lock = threading.Lock()
        self._waiting: set[concurrent.futures.Future[StreamMessage | None]] = set()
        self._closed = False

    @property
    def fencing_token(self) -> int:
        return self.aio.fencing_token

    @property
    def duplicates_dropped(self) -> int:
        """Copies of messages already delivered (a resend after a lost confirm), dropped by the SDK."""
        return self.aio.duplicates_dropped

    @property
    def redeliveries(self) -> int:
        return self.aio.redeliveries

    @property
    def waiting(self) -> str:
        """Why nothing is delivered now, as the broker said last ("" while deliveries flow)."""
        return self.aio.waiting

    def __iter__(self) -> Iterator[StreamMessage]:
        while True:
            message = self._take(None)
            if message is None:
                return
            yield message

    def next(self, timeout: float | None = None) -> StreamMessage | None:
        """The next message in stream order, or None after `timeout` seconds or once closed."""
        return self._take(timeout)

    def ack(self, message: StreamMessage) -> None:
        """Acknowledge `message` (the same as `message.ack()`)."""
        _background_loop().call_soon_threadsafe(self.aio.ack, message)

    def close(self) -> None:
        """Send the acks made so far, stop, and give the lease up (a standby takes over at once; what was
        not acknowledged comes to it, flagged redelivered); idempotent."""
        with self._lock:
            self._closed = True
            waiting = list(self._waiting)
        for future in waiting:  # a thread blocked in iteration or next() returns
            future.cancel()
        _run(self.aio.close())

    def __enter__(self) -> StreamConsumer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _take(self, timeout: float | None) -> StreamMessage | None:
        with self._lock:
            if self._closed:
                return None
            future = asyncio.run_coroutine_threadsafe(self.aio.next(timeout), _background_loop())
            self._waiting.add(future)
        try:
            message = future.result()
        except (concurrent.futures.CancelledError, StopAsyncIteration):
            return None
        finally:
            with self._lock:
                self._waiting.discard(future)
        if message is None:
            return None
        fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        return _ThreadSafeStreamMessage(**fields)


class Admin:
    """Blocking admin of policies and the cluster; see ringq.aio.Admin."""

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
        def made() -> aio.Admin:
            return aio.Admin(
                nodes, vhost=vhost, timeout=timeout, connect_timeout=connect_timeout, tls=tls, credentials=credentials
            )

        self.aio: aio.Admin = _run(_made(made))

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def set_policy(
        self, name: str, pattern: str, definition: Mapping[str, Any], *, priority: int = 0, apply_to: str = "queues"
    ) -> None:
        """Create or replace a policy (RabbitMQ's keys: ha-mode, ha-params, ha-sync-mode, message-ttl, ...)."""
        _run(self.aio.set_policy(name, pattern, definition, priority=priority, apply_to=apply_to))

    def clear_policy(self, name: str) -> None:
        _run(self.aio.clear_policy(name))

    def list_policies(self) -> list[Policy]:
        return _run(self.aio.list_policies())

    def list_queues(self) -> list[QueueRecord]:
        return _run(self.aio.list_queues())

    def cluster_status(self) -> ClusterStatus:
        return _run(self.aio.cluster_status())

    def forget_node(self, node: str) -> list[QueueRecord]:
        """Remove a node that is gone for good; the queues deleted with it (they lived only there)."""
        return _run(self.aio.forget_node(node))

    def add_user(self, name: str, password: str, tags: Sequence[str] = ()) -> None:
        _run(self.aio.add_user(name, password, tags))

    def delete_user(self, name: str) -> None:
        _run(self.aio.delete_user(name))

    def change_password(self, name: str, password: str) -> None:
        _run(self.aio.change_password(name, password))

    def list_users(self) -> list[User]:
        return _run(self.aio.list_users())

    def add_vhost(self, name: str) -> None:
        _run(self.aio.add_vhost(name))

    def delete_vhost(self, name: str) -> None:
        _run(self.aio.delete_vhost(name))

    def list_vhosts(self) -> list[str]:
        return _run(self.aio.list_vhosts())

    def set_permissions(self, user: str, *, configure: str = "", write: str = "", read: str = "") -> None:
        _run(self.aio.set_permissions(user, configure=configure, write=write, read=read))

    def clear_permissions(self, user: str) -> None:
        _run(self.aio.clear_permissions(user))

    def list_permissions(self) -> list[Permission]:
        return _run(self.aio.list_permissions())

    def close(self) -> None:
        _run(self.aio.close())
