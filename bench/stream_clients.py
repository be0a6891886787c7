"""The producer and consumer of `make bench-streams`, one pair per broker, each run in its own process.

Every producer: one connection, publisher confirms with at most `max_in_flight` unconfirmed, 256-byte
bodies (bench/reference's layout: an 8-byte application sequence number 0, 1, 2, ..., an 8-byte send
time, padding), unthrottled or paced at a fixed rate (a 1 ms tick, as bench/reference), for `seconds` or
for `messages`; it records each confirm's arrival time and sequence number. Every consumer reads in order
with `prefetch` unacknowledged at most, acknowledges each message, and records each delivery's arrival
time, application and broker sequence numbers. After the parent sets `stop`, a consumer goes on until it
holds every message the producer had confirmed (the parent says how many) or `idle_s` passed without a
delivery, `drain_s` at most.

- RabbitMQ (pika SelectConnection): bench/reference's producer and consumer, subclassed: the producer
  records confirm times and sends persistent messages (a quorum queue stores every message anyway); on a
  lost connection both go to the next node, the producer publishing again what was unconfirmed.
- NATS JetStream (nats-py, asyncio): core publishes with a reply subject per message (what the client's
  publish_async does), `Nats-Msg-Id` set to the sequence number so that a message sent again within the
  stream's duplicate window is stored once; a message is sent again when its confirm has not come within
  `NATS_ACK_TIMEOUT_S` or the reply is an error (in order, at most every `NATS_RESEND_PAUSE_S`), and at
  once after a reconnect. The consumer reads a
  durable push consumer (created by the parent: explicit acks, max_ack_pending = prefetch) on a plain
  subscription and acknowledges each message.
- ringq (ringq.aio ordered streams): `stream_producer(window=max_in_flight)` / `send` futures,
  `stream_consumer(prefetch=...)` with one `ack()` per message; the SDK fails over (retrying for
  `RINGQ_RETRY_FOR_S`), resends what was unconfirmed, and drops duplicate copies by stream_seq itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.synchronize
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.reference.rabbitmq_workloads import HEADER, NS, PACE_TICK_S, make_body
from ringq.streams import StreamConsumer

MAX_IN_FLIGHT = 1000
PREFETCH = 500
NATS_ACK_TIMEOUT_S = 1.0
NATS_RESEND_PAUSE_S = 0.1
RINGQ_RETRY_FOR_S = 60.0  # how long the ringq SDK's calls and streams keep retrying through a failover
CONFIRM_GRACE_S = 10.0  # after the last send, how long a producer waits for outstanding confirms


@dataclass
class ClientConfig:
    """What the parent tells a client process (picklable)."""

    system: str  # "rabbitmq" | "nats" | "ringq"
    addresses: list[str]  # tried in this order; RabbitMQ: AMQP ports as strings
    name: str  # queue, stream, or (NATS) the stream whose subject is the same name
    rate: float | None = None  # msgs/s; None: as fast as the confirms allow
    seconds: float = 10.0  # how long to send (ignored when `messages` is set)
    messages: int | None = None
    max_in_flight: int = MAX_IN_FLIGHT
    prefetch: int = PREFETCH
    idle_s: float = 6.0
    drain_s: float = 30.0
    nats_deliver_subject: str = ""


@dataclass
class ProducerRecord:
    started_ns: int = 0  # when it could first publish: the run's time zero
    ended_ns: int = 0  # when it stopped sending new messages: the end of its --seconds, or its last message
    published: int = 0  # distinct messages sent (0 .. published - 1)
    resent: int = 0
    confirm_ns: array[int] = field(default_factory=lambda: array("q"))
    confirmed: array[int] = field(default_factory=lambda: array("q"))
    reconnects: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class ConsumerRecord:
    delivered_ns: array[int] = field(default_factory=lambda: array("q"))
    delivered: array[int] = field(default_factory=lambda: array("q"))
    broker_seqs: array[int] = field(default_factory=lambda: array("q"))  # stream_seq (NATS, ringq); empty: RabbitMQ
    redelivered: int = 0
    dropped_by_client: int | None = None  # copies the client library dropped (ringq SDK)
    reconnects: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _error(where: str, error: BaseException) -> str:
    return f"{where}: {error!r}"[:300]


# --- the entry points of the client processes -------------------------------------------------


def producer_main(cfg: ClientConfig, started: Any, results: multiprocessing.Queue[Any]) -> None:
    wall0, cpu0 = time.monotonic(), _cpu_seconds()
    try:
        if cfg.system == "rabbitmq":
            record = _rabbitmq_producer(cfg, started)
        elif cfg.system == "nats":
            record = asyncio.run(_NatsProducer(cfg, started).run())
        elif cfg.system == "ringq":
            record = asyncio.run(_RingqProducer(cfg, started).run())
        else:
            raise ValueError(f"unknown system {cfg.system!r}")
    except BaseException as error:
        record = ProducerRecord(errors=[_error("producer crashed", error)])
    record.cpu_s = _cpu_seconds() - cpu0
    record.wall_s = time.monotonic() - wall0
    results.put(("producer", record))


def consumer_main(
    cfg: ClientConfig,
    ready: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
    expected: Any,
    results: multiprocessing.Queue[Any],
) -> None:
    """`expected`: a shared integer, the number of distinct messages confirmed (set by the parent with stop)."""
    wall0, cpu0 = time.monotonic(), _cpu_seconds()
    try:
        if cfg.system == "rabbitmq":
            record = _rabbitmq_consumer(cfg, ready, stop, expected)
        elif cfg.system == "nats":
            record = asyncio.run(_NatsConsumer(cfg, ready, stop, expected).run())
        elif cfg.system == "ringq":
            record = asyncio.run(_RingqConsumer(cfg, ready, stop, expected).run())
        else:
            raise ValueError(f"unknown system {cfg.system!r}")
    except BaseException as error:
        record = ConsumerRecord(errors=[_error("consumer crashed", error)])
    record.cpu_s = _cpu_seconds() - cpu0
    record.wall_s = time.monotonic() - wall0
    results.put(("consumer", record))


class _Drain:
    """When a consumer may stop: once stopped, when it holds every confirmed message, or after `idle_s`
    without a delivery, or `drain_s` after the stop."""

    def __init__(self, cfg: ClientConfig, stop: multiprocessing.synchronize.Event, expected: Any) -> None:
        self.cfg = cfg
        self.stop = stop
        self.expected = expected
        self.stopped_at: float | None = None
        self.last_delivery = time.monotonic()
        self.seen: set[int] = set()

    def delivered(self, seq: int) -> None:
        self.seen.add(seq)
        self.last_delivery = time.monotonic()

    def finished(self) -> bool:
        if not self.stop.is_set():
            return False
        now = time.monotonic()
        if self.stopped_at is None:
            self.stopped_at = now
        if len(self.seen) >= int(self.expected.value):
            return True
        return now - self.last_delivery > self.cfg.idle_s or now - self.stopped_at > self.cfg.drain_s


# --- RabbitMQ ------------------------------------------------------------------------------------


def _rabbitmq_producer(cfg: ClientConfig, started: Any) -> ProducerRecord:
    import pika  # type: ignore[import-untyped]

    from bench.reference import rabbitmq_workloads as ref

    count_mode = cfg.messages is not None and cfg.rate is None
    measure_s = 24 * 3600.0 if count_mode else cfg.seconds

    class Producer(ref._Producer):
        """bench/reference's producer, persistent messages, confirm times recorded, optionally `messages` only."""

        def __init__(self) -> None:
            ref_cfg = ref.ProducerConfig(
                ports=[int(a) for a in cfg.addresses],
                queue=cfg.name,
                warmup_s=0.0,
                measure_s=measure_s,
                rate=cfg.rate,
                max_in_flight=cfg.max_in_flight,
                record_confirmed=True,
                republish_unconfirmed=True,
                confirm_grace_s=CONFIRM_GRACE_S,
            )
            super().__init__(ref_cfg, started)
            self.properties = pika.BasicProperties(delivery_mode=2)
            self.confirm_ns: array[int] = array("q")
            self.distinct: set[int] = set()
            self.last_new_ns = 0

        def _publish(self, seq: int, stamp: int) -> None:
            if seq == self.next_seq:  # a new message, not a republish
                self.last_new_ns = time.monotonic_ns()
            super()._publish(seq, stamp)

        def _publish_more(self) -> None:
            if not count_mode:
                super()._publish_more()
                return
            assert cfg.messages is not None
            channel = self.channel
            if channel is None or not channel.is_open or self.finishing:
                return
            while self.retry and len(self.pending) < cfg.max_in_flight:
                seq, stamp = self.retry.popleft()
                self._publish(seq, stamp)
                self.report.republished += 1
            while len(self.pending) < cfg.max_in_flight and self.next_seq < cfg.messages:
                self._publish(self.next_seq, time.monotonic_ns())
                self.next_seq += 1

        def _requeue_pending(self) -> None:
            super()._requeue_pending()
            self.retry = deque(sorted(self.retry))  # nacked and unconfirmed, published again in order

        def _on_confirm(self, frame: Any) -> None:
            """bench/reference's, but a nacked message is published again (an at-least-once producer)."""
            now = time.monotonic_ns()
            method = frame.method
            tag: int = method.delivery_tag
            if method.multiple:
                tags: Sequence[int] = range(self.low_tag, tag + 1)
                self.low_tag = max(self.low_tag, tag + 1)
            else:
                tags = (tag,)
                if tag == self.low_tag:
                    self.low_tag += 1
            acked = isinstance(method, pika.spec.Basic.Ack)
            for t in tags:
                entry = self.pending.pop(t, None)
                if entry is None:
                    continue
                if acked:
                    self.report.confirmed += 1
                    self.report.confirmed_seqs.append(entry[0])
                    self.confirm_ns.append(now)
                    self.distinct.add(entry[0])
                else:
                    self.report.nacked += 1
                    self.retry.append(entry)
            if not acked and self.channel is not None and self.channel.is_open and not self.finishing:
                # RabbitMQ 3.10 nacks every later publish on a channel that published to a quorum queue while
                # it had no leader (measured here: 15 s on, after the new leader was elected); a new channel
                # is served at once. Closing the channel makes the run loop reconnect and publish again.
                self.channel.close()
                return
            if self.finishing:
                if not self.pending:
                    self._close()
                return
            if count_mode and cfg.messages is not None and len(self.distinct) >= cfg.messages:
                self._finish()
            elif cfg.rate is None:
                self._publish_more()

    producer = Producer()
    report = producer.run()
    if report.nacked:
        report.errors.append(f"{report.nacked} nacked (published again)")
    return ProducerRecord(
        started_ns=report.started_ns,
        ended_ns=producer.last_new_ns if count_mode else report.window_end_ns,
        published=report.sequence_numbers,
        resent=report.republished,
        confirm_ns=producer.confirm_ns,
        confirmed=report.confirmed_seqs,
        reconnects=report.reconnects,
        errors=report.errors,
    )


def _rabbitmq_consumer(
    cfg: ClientConfig, ready: multiprocessing.synchronize.Event, stop: multiprocessing.synchronize.Event, expected: Any
) -> ConsumerRecord:
    from bench.reference import rabbitmq_workloads as ref

    drain = _Drain(cfg, stop, expected)

    class Consumer(ref._Consumer):
        """bench/reference's consumer; it stops as soon as it holds every confirmed message."""

        def _on_message(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
            super()._on_message(channel, method, properties, body)
            drain.delivered(self.report.seqs[-1])

        def _check_stop(self) -> None:
            if drain.finished():
                self.done = True
                if self.connection.is_open:
                    self.connection.close()
                else:
                    self.connection.ioloop.stop()
                return
            self.connection.ioloop.call_later(0.05, self._check_stop)

    ref_cfg = ref.ConsumerConfig(
        ports=[int(a) for a in cfg.addresses],
        queue=cfg.name,
        prefetch=cfg.prefetch,
        drain=True,
        idle_s=cfg.idle_s,
        drain_s=cfg.drain_s,
    )
    report = Consumer(ref_cfg, ready, stop).run()
    return ConsumerRecord(
        delivered_ns=report.received_ns,
        delivered=report.seqs,
        redelivered=report.redelivered,
        reconnects=report.reconnects,
        errors=report.errors,
    )


# --- paced or windowed sending, shared by the asyncio producers ------------------------------------


class _Schedule:
    """Which new messages are due: all the window allows (unthrottled) or what the rate has made due."""

    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        self.started_ns = 0
        self.next_seq = 0
        self.last_new_ns = 0

    def start(self) -> None:
        self.started_ns = time.monotonic_ns()

    def sending_over(self) -> bool:
        if self.cfg.messages is not None and self.cfg.rate is None:
            return self.next_seq >= self.cfg.messages
        return time.monotonic_ns() - self.started_ns >= self.cfg.seconds * NS

    def due(self, in_flight: int) -> list[tuple[int, int]]:
        """(seq, stamp) of the new messages to send now."""
        if self.sending_over():
            return []
        room = self.cfg.max_in_flight - in_flight
        if self.cfg.rate is None:
            if self.cfg.messages is not None:
                room = min(room, self.cfg.messages - self.next_seq)
            now = time.monotonic_ns()
            out = [(self.next_seq + i, now) for i in range(max(0, room))]
        else:
            interval = NS / self.cfg.rate
            due = int((time.monotonic_ns() - self.started_ns) / NS * self.cfg.rate) + 1
            count = max(0, min(room, due - self.next_seq))
            out = [(self.next_seq + i, self.started_ns + int((self.next_seq + i) * interval)) for i in range(count)]
        if out:
            self.next_seq += len(out)
            self.last_new_ns = time.monotonic_ns()
        return out


# --- NATS JetStream --------------------------------------------------------------------------------


class _NatsProducer:
    def __init__(self, cfg: ClientConfig, started: Any) -> None:
        self.cfg = cfg
        self.started_shared = started
        self.record = ProducerRecord()
        self.schedule = _Schedule(cfg)
        self.pending: dict[int, tuple[int, int]] = {}  # seq -> (stamp, last sent ns)
        self.resend: set[int] = set()
        self.next_resend = 0.0
        self.room = asyncio.Event()
        self.nc: Any = None
        self.prefix = ""

    async def run(self) -> ProducerRecord:
        import nats

        self.nc = await nats.connect(
            servers=self.cfg.addresses,
            reconnect_time_wait=0.05,
            max_reconnect_attempts=-1,
            connect_timeout=2,
            allow_reconnect=True,
            dont_randomize=True,
            reconnected_cb=self._on_reconnected,
            disconnected_cb=self._on_disconnected,
            error_cb=self._on_error,
        )
        try:
            self.prefix = self.nc.new_inbox()
            await self.nc.subscribe(self.prefix + ".*", cb=self._on_reply)
            await self.nc.flush()
            self.schedule.start()
            self.record.started_ns = self.schedule.started_ns
            self.started_shared.value = self.schedule.started_ns / NS
            checker = asyncio.create_task(self._check_timeouts())
            try:
                await self._send_loop()
                self.record.ended_ns = time.monotonic_ns()
                deadline = time.monotonic() + CONFIRM_GRACE_S
                while self.pending and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            finally:
                checker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checker
        finally:
            with contextlib.suppress(Exception):
                await self.nc.close()
        self.record.published = self.schedule.next_seq
        return self.record

    async def _send_loop(self) -> None:
        while not self.schedule.sending_over():
            await self._resend()
            batch = self.schedule.due(len(self.pending))
            for seq, stamp in batch:
                await self._publish(seq, stamp)
            if self.cfg.rate is not None:
                await asyncio.sleep(PACE_TICK_S)
            elif not batch:
                self.room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.room.wait(), 0.05)

    async def _publish(self, seq: int, stamp: int) -> None:
        self.pending[seq] = (stamp, time.monotonic_ns())
        try:
            await self.nc.publish(
                self.cfg.name,
                make_body(seq, stamp),
                reply=f"{self.prefix}.{seq}",
                headers={"Nats-Msg-Id": str(seq)},
            )
        except Exception as error:  # disconnected with a full buffer, ...: sent again by the checker
            if len(self.record.errors) < 20:
                self.record.errors.append(_error("publish", error))

    async def _on_reply(self, msg: Any) -> None:
        now = time.monotonic_ns()
        try:
            seq = int(msg.subject.rsplit(".", 1)[1])
        except ValueError:
            return
        if seq not in self.pending:
            return  # a late reply to a copy already confirmed
        failed = bool(msg.headers and msg.headers.get("Status") == "503")
        if not failed:
            try:
                reply = json.loads(msg.data)
            except ValueError:
                reply = {"error": "not JSON"}
            failed = "error" in reply
        if failed:
            self.resend.add(seq)
            return
        del self.pending[seq]
        self.record.confirm_ns.append(now)
        self.record.confirmed.append(seq)
        self.room.set()

    async def _check_timeouts(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            limit = time.monotonic_ns() - int(NATS_ACK_TIMEOUT_S * NS)
            self.resend.update(seq for seq, (_, sent) in self.pending.items() if sent < limit)
            if self.schedule.sending_over():  # the send loop is over: resend here
                await self._resend()

    async def _resend(self) -> None:
        """Send again, in order, what failed or timed out; at most every NATS_RESEND_PAUSE_S (an error reply
        comes at once while the stream has no leader: sending again at once would only spin)."""
        if not self.resend or time.monotonic() < self.next_resend:
            return
        self.next_resend = time.monotonic() + NATS_RESEND_PAUSE_S
        for seq in sorted(self.resend):
            if seq in self.pending:
                await self._publish(seq, self.pending[seq][0])
                self.record.resent += 1
        self.resend.clear()

    async def _on_reconnected(self) -> None:
        self.record.reconnects += 1
        self.resend.update(self.pending)
        self.next_resend = 0.0  # at once

    async def _on_disconnected(self) -> None:
        pass

    async def _on_error(self, error: Exception) -> None:
        if len(self.record.errors) < 20:
            self.record.errors.append(_error("connection", error))


class _NatsConsumer:
    def __init__(
        self,
        cfg: ClientConfig,
        ready: multiprocessing.synchronize.Event,
        stop: multiprocessing.synchronize.Event,
        expected: Any,
    ) -> None:
        self.cfg = cfg
        self.ready = ready
        self.drain = _Drain(cfg, stop, expected)
        self.record = ConsumerRecord()

    async def run(self) -> ConsumerRecord:
        import nats

        async def on_reconnected() -> None:
            self.record.reconnects += 1

        async def on_error(error: Exception) -> None:
            if len(self.record.errors) < 20:
                self.record.errors.append(_error("connection", error))

        nc = await nats.connect(
            servers=self.cfg.addresses,
            reconnect_time_wait=0.05,
            max_reconnect_attempts=-1,
            connect_timeout=2,
            dont_randomize=True,
            reconnected_cb=on_reconnected,
            error_cb=on_error,
        )
        try:
            await nc.subscribe(self.cfg.nats_deliver_subject, cb=self._on_message, pending_msgs_limit=-1)
            await nc.flush()
            self.ready.set()
            while not self.drain.finished():
                await asyncio.sleep(0.05)
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        return self.record

    async def _on_message(self, msg: Any) -> None:
        now = time.monotonic_ns()
        if not msg.reply or not msg.data:
            return  # a status message (heartbeat, flow control): none are configured
        seq, _sent = HEADER.unpack_from(msg.data)
        meta = msg.metadata
        self.record.delivered_ns.append(now)
        self.record.delivered.append(seq)
        self.record.broker_seqs.append(meta.sequence.stream)
        if meta.num_delivered > 1:
            self.record.redelivered += 1
        self.drain.delivered(seq)
        await msg.ack()


# --- ringq ordered streams -------------------------------------------------------------------------


class _RingqProducer:
    def __init__(self, cfg: ClientConfig, started: Any) -> None:
        self.cfg = cfg
        self.started_shared = started
        self.record = ProducerRecord()
        self.schedule = _Schedule(cfg)
        self.in_flight = 0
        self.room = asyncio.Event()

    def _on_done(self, seq: int) -> Callable[[asyncio.Future[Any]], None]:
        def done(future: asyncio.Future[Any]) -> None:
            self.in_flight -= 1
            self.room.set()
            if future.cancelled():
                return
            error = future.exception()
            if error is not None:
                if len(self.record.errors) < 20:
                    self.record.errors.append(_error(f"confirm of {seq}", error))
                return
            self.record.confirm_ns.append(time.monotonic_ns())
            self.record.confirmed.append(seq)

        return done

    async def run(self) -> ProducerRecord:
        from ringq import aio

        connection = aio.Connection(self.cfg.addresses, retry_for=RINGQ_RETRY_FOR_S)
        try:
            producer = await connection.stream_producer(self.cfg.name, window=self.cfg.max_in_flight)
            try:
                self.schedule.start()
                self.record.started_ns = self.schedule.started_ns
                self.started_shared.value = self.schedule.started_ns / NS
                while not self.schedule.sending_over():
                    batch = self.schedule.due(self.in_flight)
                    for seq, stamp in batch:
                        self.in_flight += 1
                        future = await producer.send(make_body(seq, stamp))
                        future.add_done_callback(self._on_done(seq))
                    if self.cfg.rate is not None:
                        await asyncio.sleep(PACE_TICK_S)
                    elif not batch:
                        self.room.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.room.wait(), 0.05)
                self.record.ended_ns = time.monotonic_ns()
                deadline = time.monotonic() + CONFIRM_GRACE_S
                while self.in_flight > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            finally:
                self.record.notes.append(
                    f"SDK: {producer.resends} publish streams reopened, send groups used {producer.groups_used}"
                )
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(producer.close(), 10)
        finally:
            await connection.close()
        self.record.published = self.schedule.next_seq
        return self.record


class _RingqConsumer:
    def __init__(
        self,
        cfg: ClientConfig,
        ready: multiprocessing.synchronize.Event,
        stop: multiprocessing.synchronize.Event,
        expected: Any,
    ) -> None:
        self.cfg = cfg
        self.ready = ready
        self.drain = _Drain(cfg, stop, expected)
        self.record = ConsumerRecord()

    async def run(self) -> ConsumerRecord:
        from ringq import aio

        connection = aio.Connection(self.cfg.addresses, retry_for=RINGQ_RETRY_FOR_S)
        try:
            consumer = await connection.stream_consumer(self.cfg.name, prefetch=self.cfg.prefetch)
            self.ready.set()
            reading = asyncio.create_task(self._read(consumer))
            try:
                while not self.drain.finished() and not reading.done():
                    await asyncio.sleep(0.05)
            finally:
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
                if reading.done() and not reading.cancelled() and reading.exception() is not None:
                    self.record.errors.append(_error("consumer", reading.exception() or RuntimeError()))
                self.record.dropped_by_client = consumer.duplicates_dropped
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(consumer.close(), 10)
        finally:
            await connection.close()
        return self.record

    async def _read(self, consumer: StreamConsumer) -> None:
        async for message in consumer:
            now = time.monotonic_ns()
            seq, _sent = HEADER.unpack_from(message.body)
            self.record.delivered_ns.append(now)
            self.record.delivered.append(seq)
            self.record.broker_seqs.append(message.stream_seq)
            if message.redelivered:
                self.record.redelivered += 1
            self.drain.delivered(seq)
            message.ack()
