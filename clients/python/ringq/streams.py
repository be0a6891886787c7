"""Ordered streams in the asyncio SDK: declare, inspect and delete streams; a stream's single active
producer and single active consumer, each holding the stream's lease (protos/ringq/v1/stream.proto).

Responsible for: leases (a standby `stream_producer` / `stream_consumer` waits until it holds the lease,
then renews it every third of its time to live; a lease it loses fails what it has not sent), numbering
messages (stream_seq = fencing token << 32 | n), resending every unconfirmed message with the same
stream_seq when the stream's send group fails, and, for consumers, dropping copies: a delivery whose
stream_seq is not above the last one delivered is acknowledged and dropped (counted in
`duplicates_dropped`), unless this consumer delivered it and the application has not acknowledged it
yet (then it comes again, flagged redelivered).

Guarantees, with those of the broker: the application sees the stream's confirmed messages in stream
order, each once per consumer instance; after a consumer failover the new instance starts after what the
old one acknowledged, and what the old one had not acknowledged comes again flagged redelivered.

    async with ringq.aio.Connection(["127.0.0.1:7101"]) as connection:
        await connection.declare_stream("orders", groups=3, durable=True)
        async with await connection.stream_producer("orders") as producer:
            seq = await producer.publish(b"order 1")          # once both replicas hold it
        async with await connection.stream_consumer("orders") as consumer:
            async for message in consumer:
                print(message.stream_seq, message.body)
                message.ack()
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from ringq import tracing
from ringq.errors import RingqError, from_rpc_error
from ringq.security import authenticated
from ringq.v1 import stream_pb2, stream_pb2_grpc

if TYPE_CHECKING:
    from ringq.aio import Connection

TOKEN_SHIFT = 32
DEFAULT_LEASE_TTL_MS = 3000
CLOSE_TIMEOUT_S = 2.0  # how long closing a consumer waits for the node to settle its acks
_ROLES = {"producer": stream_pb2.STREAM_ROLE_PRODUCER, "consumer": stream_pb2.STREAM_ROLE_CONSUMER}
_ROLE_NAMES = {value: name for name, value in _ROLES.items()}
_RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
)


# ---------------------------------------------------------------------- models


@dataclass(frozen=True)
class StreamGroup:
    group: str
    master_node: str
    mirrors: tuple[str, ...]
    synchronised_mirrors: tuple[str, ...]
    depth: int  # -1: its master cannot be reached
    whole: bool
    state: str
    generation: int


@dataclass(frozen=True)
class StreamLeaseInfo:
    role: str  # "producer" | "consumer"
    holder: str
    fencing_token: int
    expires_in_ms: int


@dataclass(frozen=True)
class StreamStatus:
    vhost: str
    stream: str
    durable: bool
    send_list: tuple[str, ...]
    consume_list: tuple[str, ...]
    groups: tuple[StreamGroup, ...]
    leases: tuple[StreamLeaseInfo, ...]
    consume_state: str

    @classmethod
    def from_proto(cls, info: stream_pb2.StreamInfo) -> StreamStatus:
        return cls(
            vhost=info.stream.vhost,
            stream=info.stream.stream,
            durable=info.durable,
            send_list=tuple(info.send_list),
            consume_list=tuple(info.consume_list),
            groups=tuple(
                StreamGroup(
                    g.group,
                    g.master_node,
                    tuple(g.mirrors),
                    tuple(g.synchronised_mirrors),
                    g.depth,
                    g.whole,
                    g.state,
                    g.generation,
                )
                for g in info.groups
            ),
            leases=tuple(
                StreamLeaseInfo(
                    _ROLE_NAMES.get(lease.role, "?"), lease.holder, lease.fencing_token, lease.expires_in_ms
                )
                for lease in info.leases
            ),
            consume_state=info.consume_state,
        )

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


@dataclass
class StreamMessage:
    """A message of a stream delivered to the application; `ack()` once it is processed."""

    stream_seq: int
    body: bytes
    headers: dict[str, str]
    group: str
    redelivered: bool
    delivery_tag: int = 0
    _consumer: StreamConsumer | None = field(default=None, repr=False)
    _call: int = field(default=0, repr=False)

    @property
    def producer_token(self) -> int:
        """The fencing token of the producer that published it."""
        return self.stream_seq >> TOKEN_SHIFT

    def ack(self) -> None:
        if self._consumer is not None:
            self._consumer.ack(self)


# ---------------------------------------------------------------------- plumbing


def stub(connection: Connection) -> Any:
    return authenticated(stream_pb2_grpc.StreamServiceStub(connection.nodes.channel()), connection.credentials)


def ref(connection: Connection, stream: str) -> stream_pb2.StreamRef:
    return stream_pb2.StreamRef(vhost=connection.vhost, stream=stream)


async def call(connection: Connection, method: str, request: Any) -> Any:
    """A unary StreamService call, retried on other nodes while the cluster is in transition."""
    return await connection.call(method, request, stub=lambda: stub(connection))


class _Lease:
    """A stream lease held by this process: acquired (waiting while another holds it), then renewed."""

    def __init__(self, connection: Connection, stream: str, role: str, holder: str, ttl_ms: int) -> None:
        self.connection = connection
        self.stream = stream
        self.role = _ROLES[role]
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.token = 0
        self.lost: RingqError | None = None
        self._renewer: asyncio.Task[None] | None = None
        self.on_lost: list[Any] = []

    async def acquire(self) -> int:
        request = stream_pb2.AcquireStreamLeaseRequest(
            stream=ref(self.connection, self.stream), role=self.role, holder=self.holder, ttl_ms=self.ttl_ms
        )
        while True:
            try:
                response = await call(self.connection, "AcquireStreamLease", request)
            except RingqError as error:
                if error.code != grpc.StatusCode.FAILED_PRECONDITION or "held by" not in error.details:
                    raise
                await asyncio.sleep(min(self.ttl_ms / 4000, 0.25))  # a standby: wait for the lease
                continue
            self.token = response.lease.fencing_token
            self._renewer = asyncio.ensure_future(self._renew())
            return self.token

    async def _renew(self) -> None:
        request = stream_pb2.RenewStreamLeaseRequest(
            stream=ref(self.connection, self.stream),
            role=self.role,
            holder=self.holder,
            fencing_token=self.token,
            ttl_ms=self.ttl_ms,
        )
        pause = self.ttl_ms / 3000
        while True:
            await asyncio.sleep(pause)
            try:
                await stub(self.connection).RenewStreamLease(request, timeout=self.ttl_ms / 6000)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.lost = from_rpc_error(error, self.connection.address)
                    for callback in self.on_lost:
                        callback(self.lost)
                    return
                self.connection.failed()  # at once on another node; the broker fences us if we are late
                pause = 0.05
            else:
                pause = self.ttl_ms / 3000

    async def release(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        if self.token and self.lost is None:
            request = stream_pb2.ReleaseStreamLeaseRequest(
                stream=ref(self.connection, self.stream), role=self.role, holder=self.holder, fencing_token=self.token
            )
            with contextlib.suppress(RingqError):
                await call(self.connection, "ReleaseStreamLease", request)


# ---------------------------------------------------------------------- producer


@dataclass
class _Unconfirmed:
    body: bytes
    headers: dict[str, str]
    persistent: bool
    future: asyncio.Future[int]
    span: trace.Span | None = None
    started: float = 0.0


class StreamProducer:
    """The single active producer of a stream (see the module docstring); made by
    `await connection.stream_producer(stream)`, which returns once it holds the producer lease."""

    def __init__(
        self,
        connection: Connection,
        stream: str,
        holder: str,
        lease_ttl_ms: int,
        window: int,
        batch: int,
        persistent: bool,
    ) -> None:
        self.connection = connection
        self.stream = stream
        self.lease = _Lease(connection, stream, "producer", holder, lease_ttl_ms)
        self.window = window
        self.batch = batch
        self.persistent = persistent
        self.resends = 0  # publish streams reopened after a failure (each resends what was unconfirmed)
        self.groups_used: list[str] = []  # send groups in the order they confirmed messages
        self._next = 0
        self._unconfirmed: dict[int, _Unconfirmed] = {}
        self._unsent: deque[int] = deque()
        self._room = asyncio.Semaphore(window)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._runner: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def fencing_token(self) -> int:
        return self.lease.token

    async def start(self) -> StreamProducer:
        token = await self.lease.acquire()
        self._next = token << TOKEN_SHIFT
        self.lease.on_lost.append(self._fail_all)
        return self

    async def send(
        self, body: bytes, *, headers: Mapping[str, str] | None = None, persistent: bool | None = None
    ) -> asyncio.Future[int]:
        """Queue `body` once the window has room; returns a future of its stream_seq, set once confirmed."""
        if self._closed:
            raise RuntimeError("the stream producer is closed")
        if self.lease.lost is not None:
            raise self.lease.lost
        await self._room.acquire()
        self._next += 1
        seq = self._next
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        keep = self.persistent if persistent is None else persistent
        pending = self._unconfirmed[seq] = _Unconfirmed(body, dict(headers or {}), keep, future)
        telemetry = self.connection.telemetry
        if telemetry.tracing:
            pending.span = telemetry.stream_publish_span(self.stream, seq, len(body), self.connection.address)
            tracing.inject(pending.headers, pending.span)
        if telemetry.metering:
            pending.started = time.monotonic()
        self._unsent.append(seq)
        self._idle.clear()
        self._wake.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        return future

    async def publish(
        self, body: bytes, *, headers: Mapping[str, str] | None = None, persistent: bool | None = None
    ) -> int:
        """Publish one message and wait for its confirm; returns its stream_seq."""
        return await (await self.send(body, headers=headers, persistent=persistent))

    async def publish_many(self, bodies: Sequence[bytes]) -> list[int]:
        futures = [await self.send(body) for body in bodies]
        return list(await asyncio.gather(*futures))

    async def flush(self) -> None:
        await self._idle.wait()

    async def close(self) -> None:
        """Flush, end the stream and give the lease up (a standby takes over at once); idempotent."""
        if self._closed:
            return
        with contextlib.suppress(RingqError):
            await self.flush()
        self._closed = True
        self._wake.set()
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._runner
        await self.lease.release()
        self.connection._closed(self.close)

    async def __aenter__(self) -> StreamProducer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _run(self) -> None:
        try:
            while self._unconfirmed and not self._closed:
                async for attempt in self.connection.retrying(_RETRYABLE):
                    with attempt:
                        await self._stream()
        except grpc.aio.AioRpcError as error:
            self._fail_all(self.connection.error(error, _RETRYABLE))
        except RingqError as error:
            self._fail_all(error)

    async def _stream(self) -> None:
        call = stub(self.connection).PublishStream()
        self._unsent = deque(sorted(self._unconfirmed))  # everything unconfirmed goes (again), in order

        async def write() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                while not self._closed:
                    if not self._unsent:
                        self._wake.clear()
                        await self._wake.wait()
                        continue
                    seqs = [self._unsent.popleft() for _ in range(min(self.batch, len(self._unsent)))]
                    seqs = [seq for seq in seqs if seq in self._unconfirmed]
                    if seqs:
                        await call.write(
                            stream_pb2.PublishStreamRequest(
                                stream=ref(self.connection, self.stream),
                                fencing_token=self.lease.token,
                                messages=[self._message(seq) for seq in seqs],
                            )
                        )

        writer = asyncio.ensure_future(write())
        try:
            async for response in call:
                self._confirmed(response.confirmed_through, response.group)
                if not self._unconfirmed:
                    self._idle.set()
        except grpc.aio.AioRpcError as error:
            if error.code() in _RETRYABLE:
                self.resends += 1
                self.connection.nodes.note(self.connection.address, error)
            raise
        finally:
            writer.cancel()
            call.cancel()

    def _message(self, seq: int) -> stream_pb2.StreamMessage:
        pending = self._unconfirmed[seq]
        message = stream_pb2.StreamMessage(stream_seq=seq, body=pending.body, persistent=pending.persistent)
        if pending.headers:  # as Producer._message: an empty map argument is the costliest part
            message.headers.update(pending.headers)
        return message

    def _confirmed(self, through: int, group: str) -> None:
        if not self.groups_used or self.groups_used[-1] != group:
            self.groups_used.append(group)
        for seq in sorted(s for s in self._unconfirmed if s <= through):
            pending = self._unconfirmed.pop(seq)
            self._room.release()
            if pending.span is not None or pending.started:
                self.connection.telemetry.stream_published(self.stream, pending.span, pending.started, group, None)
            if not pending.future.done():
                pending.future.set_result(seq)

    def _fail_all(self, error: RingqError) -> None:
        for pending in self._unconfirmed.values():
            self._room.release()
            if pending.span is not None or pending.started:
                telemetry = self.connection.telemetry
                telemetry.stream_published(self.stream, pending.span, pending.started, "", error.code.name)
            if not pending.future.done():
                pending.future.set_exception(error)
        self._unconfirmed.clear()
        self._idle.set()


# ---------------------------------------------------------------------- consumer


class StreamConsumer:
    """The single active consumer of a stream (see the module docstring); made by
    `await connection.stream_consumer(stream)`, which returns once it holds the consumer lease."""

    def __init__(self, connection: Connection, stream: str, holder: str, lease_ttl_ms: int, prefetch: int) -> None:
        self.connection = connection
        self.stream = stream
        self.lease = _Lease(connection, stream, "consumer", holder, lease_ttl_ms)
        self.prefetch = prefetch
        self.duplicates_dropped = 0  # copies dropped, by the broker (copies_dropped) or by this SDK
        self.redeliveries = 0
        self.waiting = ""  # why nothing is delivered now, as the broker said last
        self.last_seq = 0
        self._unacked: set[int] = set()  # seqs delivered to the application, not yet acknowledged
        self._inbox: asyncio.Queue[StreamMessage | RingqError | None] = asyncio.Queue()  # None: closed
        self._acks: asyncio.Queue[stream_pb2.StreamAck | None] = asyncio.Queue()  # None: half-close
        self._call = 0
        self._runner: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def fencing_token(self) -> int:
        return self.lease.token

    async def start(self) -> StreamConsumer:
        await self.lease.acquire()
        self.lease.on_lost.append(self._inbox.put_nowait)
        self._runner = asyncio.ensure_future(self._run())
        return self

    def __aiter__(self) -> AsyncIterator[StreamMessage]:
        return self

    async def __anext__(self) -> StreamMessage:
        if self._closed:
            raise StopAsyncIteration
        item = await self._inbox.get()
        if item is None:  # closed while waiting
            raise StopAsyncIteration
        if isinstance(item, RingqError):
            raise item
        return item

    async def next(self, timeout: float | None = None) -> StreamMessage | None:
        """The next message, or None after `timeout` seconds without one."""
        try:
            return await asyncio.wait_for(self.__anext__(), timeout)
        except TimeoutError:
            return None

    def ack(self, message: StreamMessage) -> None:
        self._unacked.discard(message.stream_seq)
        if message._call == self._call:  # a delivery of an earlier call comes again: nothing to ack there
            self._acks.put_nowait(stream_pb2.StreamAck(group=message.group, delivery_tag=message.delivery_tag))

    async def close(self) -> None:
        """Send the acks, stop, and give the lease up (a standby takes over at once); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put_nowait(None)  # an iteration waiting for a message ends
        self._acks.put_nowait(None)  # after the acks: half-close, so the node settles them, then ends the call
        if self._runner is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, grpc.aio.AioRpcError, RingqError):
                await asyncio.wait_for(asyncio.shield(self._runner), CLOSE_TIMEOUT_S)
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._runner
        await self.lease.release()
        self.connection._closed(self.close)

    async def __aenter__(self) -> StreamConsumer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _run(self) -> None:
        try:
            while not self._closed:
                async for attempt in self.connection.retrying(_RETRYABLE):
                    with attempt:
                        await self._consume()
        except grpc.aio.AioRpcError as error:
            self._inbox.put_nowait(self.connection.error(error, _RETRYABLE))
        except RingqError as error:
            self._inbox.put_nowait(error)

    async def _consume(self) -> None:
        self._call += 1
        this_call = self._call
        self._acks = asyncio.Queue()
        if self._closed:
            return
        call = stub(self.connection).ConsumeStream()
        await call.write(
            stream_pb2.ConsumeStreamRequest(
                stream=ref(self.connection, self.stream), fencing_token=self.lease.token, prefetch=self.prefetch
            )
        )

        async def write_acks() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                closing = False
                while not closing:
                    acks = [await self._acks.get()]
                    while not self._acks.empty() and len(acks) < 256:
                        acks.append(self._acks.get_nowait())
                    closing = None in acks
                    batch = [ack for ack in acks if ack is not None]
                    if batch:
                        await call.write(stream_pb2.ConsumeStreamRequest(acks=batch))
                await call.done_writing()

        writer = asyncio.ensure_future(write_acks())
        try:
            async for response in call:
                self.waiting = response.waiting
                self.duplicates_dropped += response.copies_dropped  # the broker dropped these for us
                for d in response.deliveries:
                    self._receive(d, this_call)
        finally:
            writer.cancel()
            call.cancel()

    def _receive(self, d: stream_pb2.StreamDelivery, this_call: int) -> None:
        message = StreamMessage(
            d.stream_seq, d.body, dict(d.headers), d.group, d.redelivered, d.delivery_tag, self, this_call
        )
        copy = d.stream_seq <= self.last_seq and d.stream_seq not in self._unacked
        telemetry = self.connection.telemetry
        if telemetry.tracing or telemetry.metering:
            telemetry.stream_received(self.stream, d.headers, d.group, d.stream_seq, d.redelivered, copy, len(d.body))
        history = self.connection.history
        if d.stream_seq <= self.last_seq:
            if d.stream_seq in self._unacked:  # the application has it, unacknowledged: it comes again
                self.redeliveries += 1
                message.redelivered = True
                self._deliver(message)
                return
            self.duplicates_dropped += 1  # a copy (a resend after a lost confirm): drop it
            self._acks.put_nowait(stream_pb2.StreamAck(group=d.group, delivery_tag=d.delivery_tag))
            if history.on:
                history.record("stream_duplicate", stream=self.stream, stream_seq=d.stream_seq, group=d.group)
            return
        self.last_seq = d.stream_seq
        self._unacked.add(d.stream_seq)
        if d.redelivered:
            self.redeliveries += 1
        self._deliver(message)

    def _deliver(self, message: StreamMessage) -> None:
        """Hand `message` to the application (and say so in the history: pipeline/guarantees.py checks it)."""
        history = self.connection.history
        if history.on:
            history.record(
                "stream_deliver",
                stream=self.stream,
                stream_seq=message.stream_seq,
                group=message.group,
                redelivered=message.redelivered,
            )
        self._inbox.put_nowait(message)


# ---------------------------------------------------------------------- connection verbs


async def declare_stream(connection: Connection, stream: str, groups: int, durable: bool) -> StreamStatus:
    request = stream_pb2.DeclareStreamRequest(stream=ref(connection, stream), groups=groups, durable=durable)
    return StreamStatus.from_proto((await call(connection, "DeclareStream", request)).stream)


async def delete_stream(connection: Connection, stream: str) -> None:
    await call(connection, "DeleteStream", stream_pb2.DeleteStreamRequest(stream=ref(connection, stream)))


async def stream_status(connection: Connection, stream: str) -> StreamStatus:
    request = stream_pb2.StreamStatusRequest(stream=ref(connection, stream))
    return StreamStatus.from_proto((await call(connection, "StreamStatus", request)).stream)


async def list_streams(connection: Connection, vhost: str | None = None) -> list[StreamStatus]:
    request = stream_pb2.ListStreamsRequest(vhost=connection.vhost if vhost is None else vhost)
    return [StreamStatus.from_proto(s) for s in (await call(connection, "ListStreams", request)).streams]


def holder_id(connection: Connection) -> str:
    return f"{connection.name}.{uuid.uuid4().hex[:8]}"
