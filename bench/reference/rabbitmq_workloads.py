"""The reference workloads (ARCHITECTURE section 10) against a RabbitMQ cluster of classic mirrored queues.

Method, the same for every workload:
- Client: pika 1.x with its asynchronous SelectConnection (one connection and
  one channel per client). It was the fastest Python client measured here for
  pipelined publisher confirms (one comparison run on this cluster, W1: pika SelectConnection
  4-8k confirmed msgs/s, aiormq about 3.6k, aio-pika about 1.2k); pika's
  BlockingConnection cannot keep more than one confirm in flight.
- Producer and consumer run in two separate processes (multiprocessing
  "spawn"), so the two clients do not share one Python interpreter; the parent
  process only orchestrates (and, in W3, kills a node). A script calling these
  functions needs the `if __name__ == "__main__":` guard that spawn requires.
- Bodies: 256 bytes: an 8-byte sequence number, an 8-byte send timestamp
  (CLOCK_MONOTONIC nanoseconds, which is system-wide on Linux, so the consumer's
  clock is the producer's), then padding. Messages are transient
  (delivery_mode 1, "persistent=false"); the queue is durable, classic, and
  mirrored on every node by the cluster's policy (ha-mode all, ha-sync-mode
  automatic); it is declared through node 1, so its master is on node 1.
- Publisher confirms with at most 1000 unconfirmed messages in flight; a
  publish is counted when its confirm (basic.ack) arrives.
- Consumer: prefetch 1000, manual acknowledgements, as the workload says
  (bench/ack_batching.py): batched (one basic.ack with `multiple` every 100
  messages or 50 ms, whichever first, as pika users configure for throughput)
  or one basic.ack per message. A message's latency is from its send timestamp (the moment the
  producer hands it to its client library) to its arrival in the consumer's
  callback. With a fixed rate, each message also has a scheduled send time
  (time zero + its sequence number / the rate): the latency from it adds the
  producer's pacing delay (up to a tick and the producer's own stalls;
  `schedule_figures`) and is reported beside the first, so a stalled producer cannot hide
  latency (coordinated omission), and `behind_schedule` counts what it held
  back.
- Rates count confirms (W1) or deliveries (W2) whose arrival falls inside the
  measured window, which begins after the warm-up.

Workloads:
- W1: one producer, no consumer: confirmed msgs/s.
- W2: producer and consumer at once, producer unthrottled (bounded only by the
  1000 confirms in flight), batched acks: delivered msgs/s and latency p50/p99.
  The producer may outrun the consumer, in which case the queue grows and so
  does latency.
- W2 ack each: W2 with one ack per message.
- W2@rate: W2 with the producer paced at a fixed rate (2,000 msgs/s), batched
  acks: latency.
- W3: W2 at the fixed rate, one ack per message (so that a duplicate is the
  broker's, not a batch's unacknowledged deliveries), with both clients connected to the master's node;
  after a warm-up the master's node is SIGKILLed. Each client reconnects to
  the next node (retrying) and continues: the producer republishes what was
  unconfirmed when its connection died (an at-least-once producer), the
  consumer re-subscribes. Reported: the longest gap between consecutive
  deliveries from 1 s before the kill on (seconds without service), messages
  lost (confirmed, never delivered) and duplicates (deliveries of a sequence
  number already delivered).

Every workload also records the CPU the brokers used (all nodes together, in
cores) over its measured window; in W3, the survivors' from the kill to the end.

Shared with the other systems' workloads (bench/ringq_workloads.py,
bench/nats_workloads.py), so that the method is one: the result record, the
body layout, the reports and how they are filled, the client processes'
orchestration (`run_producer`, `run_pair`), the result builders (`w1_result`,
`w2_result`, `_w3_result`) and the asyncio producers' window and pacing
(`AsyncWindowProducer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import math
import multiprocessing
import multiprocessing.synchronize
import queue as queue_module
import resource
import struct
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from multiprocessing.context import SpawnProcess
from typing import Any, Protocol

import pika  # type: ignore[import-untyped]

from bench.ack_batching import BATCHED, EACH, Ack, AckPolicy, AckTimer
from bench.reference.rabbitmq_cluster import HA_POLICY, HA_POLICY_NAME, HOST, RabbitCluster, RabbitClusterError

PAYLOAD_SIZE = 256
HEADER = struct.Struct("!QQ")  # sequence number, send time (CLOCK_MONOTONIC ns)
PADDING = b"\x00" * (PAYLOAD_SIZE - HEADER.size)
MAX_IN_FLIGHT = 1000
PREFETCH = 1000
FIXED_RATE = 2000.0
PACE_TICK_S = 0.001
NS = 1_000_000_000


@dataclass
class WorkloadResult:
    """One workload's measurements; None where a figure does not apply."""

    name: str
    rate: float | None = None  # msgs/s: confirmed (W1) or delivered (W2, W3)
    p50_ms: float | None = None  # latency from each message's send stamp
    p99_ms: float | None = None
    p50_from_schedule_ms: float | None = None  # at a fixed rate: latency from each message's scheduled send time
    p99_from_schedule_ms: float | None = None
    gap_s: float | None = None  # W3: longest time without a delivery around the kill
    lost: int | None = None  # W3: confirmed but never delivered
    duplicates: int | None = None  # deliveries of an already delivered sequence number
    broker_cores: float | None = None  # CPU of all the system's server processes over the measured window
    notes: str = ""
    details: dict[str, float | int | str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Durations:
    warmup_s: float = 1.0
    measure_s: float = 5.0
    w3_warmup_s: float = 2.0  # W3: from the producer's start to the kill
    w3_after_kill_s: float = 8.0  # W3: how long the producer goes on after the kill
    drain_s: float = 30.0  # W3: longest wait for the consumer to catch up at the end

    @classmethod
    def quick(cls) -> Durations:
        return cls(warmup_s=0.5, measure_s=1.5, w3_warmup_s=1.0, w3_after_kill_s=4.0, drain_s=15.0)


def make_body(seq: int, sent_ns: int) -> bytes:
    return HEADER.pack(seq, sent_ns) + PADDING


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of already sorted values, nearest-rank."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[rank]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _parameters(port: int) -> Any:
    return pika.ConnectionParameters(
        host=HOST,
        port=port,
        credentials=pika.PlainCredentials("guest", "guest"),
        connection_attempts=1,
        socket_timeout=2.0,
        stack_timeout=5.0,
        heartbeat=10,
    )


# --- producer (runs in its own process) ------------------------------------------------


@dataclass
class ProducerConfig:
    ports: list[int]  # tried in order; on a failure the next one
    queue: str
    warmup_s: float
    measure_s: float
    rate: float | None = None  # msgs/s; None: as fast as the confirms allow
    max_in_flight: int = MAX_IN_FLIGHT
    record_confirmed: bool = False
    republish_unconfirmed: bool = True
    confirm_grace_s: float = 3.0  # after the run, how long to wait for outstanding confirms
    give_up_s: float = 60.0  # reconnecting for longer than this ends the run


@dataclass
class ProducerReport:
    started_ns: int = 0  # CLOCK_MONOTONIC when the first channel was ready to publish: the run's time zero
    window_start_ns: int = 0
    window_end_ns: int = 0
    published: int = 0  # publishes, republishes included
    sequence_numbers: int = 0  # distinct messages published (0 .. sequence_numbers - 1)
    republished: int = 0
    confirmed: int = 0
    confirmed_in_window: int = 0
    nacked: int = 0
    reconnects: int = 0
    longest_confirm_gap_s: float = 0.0  # after the warm-up
    behind_schedule: int = 0  # paced: messages due but held back by the in-flight bound at the end
    cpu_s: float = 0.0
    wall_s: float = 0.0
    confirmed_seqs: array[int] = field(default_factory=lambda: array("q"))
    errors: list[str] = field(default_factory=list)
    last_confirm_ns: int = 0

    def start_window(self, now_ns: int, warmup_s: float, measure_s: float, started: Any) -> None:
        """Time zero is now: the measured window follows the warm-up; the parent learns it through `started`."""
        self.started_ns = now_ns
        self.window_start_ns = now_ns + int(warmup_s * NS)
        self.window_end_ns = self.window_start_ns + int(measure_s * NS)
        self.last_confirm_ns = now_ns
        started.value = now_ns / NS

    def count_confirms(self, count: int, now_ns: int) -> None:
        """`count` messages confirmed at `now_ns`: the totals, the window's count, the longest confirm gap."""
        if not count:
            return
        self.confirmed += count
        if self.window_start_ns <= now_ns < self.window_end_ns:
            self.confirmed_in_window += count
        if now_ns > self.window_start_ns:
            gap = (now_ns - max(self.last_confirm_ns, self.window_start_ns)) / NS
            self.longest_confirm_gap_s = max(self.longest_confirm_gap_s, gap)
        self.last_confirm_ns = now_ns


class _PikaClient:
    """Connection and channel callbacks shared by the producer and the consumer:
    failures are recorded in the report and stop the I/O loop."""

    report: ProducerReport | ConsumerReport
    done: bool
    connection: Any

    def _on_channel(self, channel: Any) -> None:
        raise NotImplementedError  # each client sets its channel up

    def _on_open(self, connection: Any) -> None:
        connection.channel(on_open_callback=self._on_channel)

    def _on_open_error(self, connection: Any, error: BaseException) -> None:
        self.report.errors.append(f"connect: {error!r}"[:200])
        connection.ioloop.stop()

    def _on_closed(self, connection: Any, reason: BaseException) -> None:
        if not self.done:
            self.report.errors.append(f"connection lost: {reason!r}"[:200])
        connection.ioloop.stop()

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if not self.done:
            self.report.errors.append(f"channel closed: {reason!r}"[:200])
        if self.connection is not None and self.connection.is_open:
            self.connection.close()


class _Producer(_PikaClient):
    report: ProducerReport

    def __init__(self, cfg: ProducerConfig, started: Any) -> None:
        self.cfg = cfg
        self.started_shared = started  # multiprocessing Value('d'): seconds, set at time zero
        self.report = ProducerReport()
        self.channel: Any = None
        self.connection: Any = None
        self.next_seq = 0
        self.pending: dict[int, tuple[int, int]] = {}  # delivery tag -> (seq, stamp) on the current channel
        self.low_tag = 1
        self.next_tag = 1
        self.retry: deque[tuple[int, int]] = deque()  # (seq, stamp) to publish again after a reconnect
        self.finishing = False
        self.done = False
        self.properties = pika.BasicProperties(delivery_mode=1)

    # lifecycle

    def run(self) -> ProducerReport:
        wall0, cpu0 = time.monotonic(), _cpu_seconds()
        index = 0
        lost_since: float | None = None
        while not self.done:
            port = self.cfg.ports[index % len(self.cfg.ports)]
            self.connection = pika.SelectConnection(
                _parameters(port),
                on_open_callback=self._on_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_closed,
            )
            self.connection.ioloop.start()
            if self.done:
                break
            if self.channel is not None or lost_since is None:  # it had worked: a new outage starts now
                lost_since = time.monotonic()
            self.channel = None
            self._requeue_pending()
            if time.monotonic() - lost_since > self.cfg.give_up_s:
                self.report.errors.append(f"gave up reconnecting after {self.cfg.give_up_s:.0f} s")
                break
            if self.finishing or (
                self.report.started_ns
                and time.monotonic_ns() > self.report.window_end_ns + int(self.cfg.give_up_s * NS)
            ):
                break
            index += 1
            self.report.reconnects += 1
            time.sleep(0.05)
        self.report.sequence_numbers = self.next_seq
        self.report.cpu_s = _cpu_seconds() - cpu0
        self.report.wall_s = time.monotonic() - wall0
        return self.report

    def _on_channel(self, channel: Any) -> None:
        self.channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.confirm_delivery(self._on_confirm, callback=self._on_confirm_mode)

    def _on_confirm_mode(self, _frame: Any) -> None:
        self.pending.clear()
        self.low_tag = self.next_tag = 1
        if not self.report.started_ns:
            self.report.start_window(time.monotonic_ns(), self.cfg.warmup_s, self.cfg.measure_s, self.started_shared)
        remaining = (self.report.window_end_ns - time.monotonic_ns()) / NS
        self.connection.ioloop.call_later(max(0.0, remaining), self._finish)
        if self.cfg.rate is not None:
            self.connection.ioloop.call_later(0.0, self._pace)
        else:
            self._publish_more()

    # publishing

    def _publish(self, seq: int, stamp: int) -> None:
        self.channel.basic_publish("", self.cfg.queue, make_body(seq, stamp), self.properties)
        self.pending[self.next_tag] = (seq, stamp)
        self.next_tag += 1
        self.report.published += 1

    def _publish_more(self) -> None:
        channel = self.channel
        if channel is None or not channel.is_open or self.finishing:
            return
        limit = self.cfg.max_in_flight
        while self.retry and len(self.pending) < limit:
            seq, stamp = self.retry.popleft()
            self._publish(seq, stamp)
            self.report.republished += 1
        if self.cfg.rate is not None:
            return
        while len(self.pending) < limit:
            self._publish(self.next_seq, time.monotonic_ns())
            self.next_seq += 1

    def _pace(self) -> None:
        channel = self.channel
        if channel is None or not channel.is_open or self.finishing:
            return
        assert self.cfg.rate is not None
        self._publish_more()  # republishes first
        now = time.monotonic_ns()
        due = int((now - self.report.started_ns) / NS * self.cfg.rate) + 1
        while self.next_seq < due and len(self.pending) < self.cfg.max_in_flight:
            self._publish(self.next_seq, time.monotonic_ns())  # stamped as handed to pika (the module's text)
            self.next_seq += 1
        self.report.behind_schedule = max(0, due - self.next_seq)
        self.connection.ioloop.call_later(PACE_TICK_S, self._pace)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag: int = method.delivery_tag
        acked = isinstance(method, pika.spec.Basic.Ack)
        if method.multiple:
            tags: Sequence[int] = range(self.low_tag, tag + 1)
            self.low_tag = max(self.low_tag, tag + 1)
        else:
            tags = (tag,)
            if tag == self.low_tag:
                self.low_tag += 1
        now = time.monotonic_ns()
        count = 0
        for t in tags:
            entry = self.pending.pop(t, None)
            if entry is None:
                continue
            count += 1
            if acked and self.cfg.record_confirmed:
                self.report.confirmed_seqs.append(entry[0])
        if acked:
            self.report.count_confirms(count, now)
        else:
            self.report.nacked += count
        if self.finishing:
            if not self.pending:
                self._close()
        elif self.cfg.rate is None:
            self._publish_more()

    def _requeue_pending(self) -> None:
        """The connection died: what it had unconfirmed is published again on the next one (at least once)."""
        if self.cfg.republish_unconfirmed and not self.finishing:
            self.retry.extend(self.pending[t] for t in sorted(self.pending))
        self.pending.clear()

    def _finish(self) -> None:
        if self.finishing:
            return
        self.finishing = True
        if not self.pending:
            self._close()
        else:
            self.connection.ioloop.call_later(self.cfg.confirm_grace_s, self._close)

    def _close(self) -> None:
        if self.done:
            return
        self.done = True
        if self.connection.is_open:
            self.connection.close()
        else:
            self.connection.ioloop.stop()


def put_report(
    results: multiprocessing.Queue[Any],
    kind: str,
    run: Callable[[], ProducerReport | ConsumerReport],
    crashed: Callable[[list[str]], ProducerReport | ConsumerReport],
) -> None:
    """A client process's end, every system's: run the client, send its report (`kind`: "producer" or
    "consumer") to the parent; if it crashed, a report saying so (`crashed(errors)`)."""
    try:
        report = run()
    except BaseException as exc:
        report = crashed([f"{kind} crashed: {exc!r}"])
    results.put((kind, report))


def _producer_main(cfg: ProducerConfig, started: Any, results: multiprocessing.Queue[Any]) -> None:
    put_report(results, "producer", lambda: _Producer(cfg, started).run(), lambda e: ProducerReport(errors=e))


# --- the asyncio producers' window and pacing (bench/ringq_workloads.py, bench/nats_workloads.py) ----------


class WindowSettings(Protocol):
    """What `AsyncWindowProducer` reads of its producer's config."""

    warmup_s: float
    measure_s: float
    rate: float | None  # msgs/s; None: as fast as the confirms allow
    max_in_flight: int
    batch: int  # messages sent together at most
    confirm_grace_s: float


class AsyncWindowProducer:
    """The pika producer's method for an asyncio client: at most `max_in_flight` unconfirmed messages;
    unthrottled, the window kept full (`batch` messages per send at most); paced, every PACE_TICK_S what has
    fallen due; each message stamped as it is handed to the client; at the window's end, no more sends and
    `confirm_grace_s` at most for the outstanding confirms. A subclass connects, sends (`_send`, the keys of
    `pending`), and reports what its broker confirmed (`settle`, then `counted`)."""

    def __init__(self, cfg: WindowSettings, started: Any, report: ProducerReport) -> None:
        self.cfg = cfg
        self.started_shared = started  # multiprocessing Value('d'): seconds, set at time zero
        self.report = report
        # key (sequence number + 1, as a publisher seq starts at 1) -> (sequence number, send stamp)
        self.pending: dict[int, tuple[int, int]] = {}
        self.next_seq = 0
        self.space = asyncio.Event()  # set when confirms free room in the window (or when finishing)
        self.all_confirmed = asyncio.Event()
        self.finishing = False
        self.done = False

    def start(self) -> asyncio.Future[None]:
        """Time zero is now: the window starts; returns the task that ends it."""
        self.report.start_window(time.monotonic_ns(), self.cfg.warmup_s, self.cfg.measure_s, self.started_shared)
        return asyncio.ensure_future(self._finish())

    async def _send(self, keys: list[int]) -> None:
        """Send these messages of `pending` (the subclass's broker)."""
        raise NotImplementedError

    def _finished(self) -> None:
        """The run is over (the window ended and the confirms came, or the grace passed)."""

    def settle(self, key: int) -> tuple[int, int] | None:
        """A confirm (or a refusal) for `key` came: its (sequence number, stamp), None if it was not pending."""
        return self.pending.pop(key, None)

    def counted(self, count: int, now_ns: int) -> None:
        """`count` of the settled messages were confirmed at `now_ns`; the window has room again."""
        self.report.count_confirms(count, now_ns)
        self.space.set()
        if not self.pending:
            self.all_confirmed.set()

    def _take(self, count: int, stamp: int) -> list[int]:
        """Number the next `count` messages, stamped `stamp` (now: they are handed to the client), and put them
        in the window."""
        keys = []
        for _ in range(count):
            seq = self.next_seq
            self.next_seq += 1
            self.pending[seq + 1] = (seq, stamp)
            keys.append(seq + 1)
        return keys

    async def produce(self) -> None:
        """Send new messages until the window ends: unthrottled or paced."""
        if self.cfg.rate is None:
            await self._fill()
        else:
            await self._pace()

    async def _fill(self) -> None:
        while not self.finishing:
            room = self.cfg.max_in_flight - len(self.pending)
            if room <= 0:
                self.space.clear()
                await self.space.wait()
                continue
            await self._send(self._take(min(self.cfg.batch, room), time.monotonic_ns()))

    async def _pace(self) -> None:
        assert self.cfg.rate is not None
        while not self.finishing:
            due = int((time.monotonic_ns() - self.report.started_ns) / NS * self.cfg.rate) + 1
            while self.next_seq < due and len(self.pending) < self.cfg.max_in_flight:
                count = min(self.cfg.batch, due - self.next_seq, self.cfg.max_in_flight - len(self.pending))
                await self._send(self._take(count, time.monotonic_ns()))
            self.report.behind_schedule = max(0, due - self.next_seq)
            await asyncio.sleep(PACE_TICK_S)

    async def _finish(self) -> None:
        await asyncio.sleep(max(0.0, (self.report.window_end_ns - time.monotonic_ns()) / NS))
        self.finishing = True
        self.space.set()
        if self.pending:
            self.all_confirmed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.all_confirmed.wait(), self.cfg.confirm_grace_s)
        self.done = True
        self._finished()


# --- consumer (runs in its own process) ---------------------------------------------------


@dataclass
class ConsumerConfig:
    ports: list[int]
    queue: str
    prefetch: int = PREFETCH
    acks: AckPolicy = EACH
    drain: bool = False  # after stop: keep consuming until idle_s without a delivery (at most drain_s)
    idle_s: float = 1.5
    drain_s: float = 30.0
    give_up_s: float = 60.0


@dataclass
class ConsumerReport:
    received_ns: array[int] = field(default_factory=lambda: array("q"))
    sent_ns: array[int] = field(default_factory=lambda: array("q"))
    seqs: array[int] = field(default_factory=lambda: array("q"))
    redelivered_flags: array[int] = field(default_factory=lambda: array("b"))  # per delivery: 1 if redelivered
    redelivered: int = 0
    acks_sent: int = 0  # acknowledgements sent (one may cover many deliveries)
    reconnects: int = 0
    cancels: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def record(self, body: bytes, now_ns: int, redelivered: bool) -> None:
        """A delivery taken at `now_ns`: its sequence number and send time (from the body), its flag."""
        seq, sent = HEADER.unpack_from(body)
        self.received_ns.append(now_ns)
        self.sent_ns.append(sent)
        self.seqs.append(seq)
        self.redelivered_flags.append(1 if redelivered else 0)
        if redelivered:
            self.redelivered += 1


class StopWhen:
    """When a consumer ends after the parent's `stop`: at once, or with `drain` once `idle_s` passed without a
    delivery (`drain_s` after the stop at most)."""

    def __init__(self, stop: multiprocessing.synchronize.Event, drain: bool, idle_s: float, drain_s: float) -> None:
        self.stop = stop
        self.drain = drain
        self.idle_s = idle_s
        self.drain_s = drain_s
        self.stop_seen_at: float | None = None
        self.last_delivery = time.monotonic()

    def delivered(self) -> None:
        self.last_delivery = time.monotonic()

    def stopping(self) -> bool:
        """True once the parent has said stop (remembering when it was first seen)."""
        if not self.stop.is_set():
            return False
        if self.stop_seen_at is None:
            self.stop_seen_at = time.monotonic()
        return True

    def finished(self) -> bool:
        if not self.stopping():
            return False
        assert self.stop_seen_at is not None
        now = time.monotonic()
        return not self.drain or now - self.last_delivery > self.idle_s or now - self.stop_seen_at > self.drain_s


class _Consumer(_PikaClient):
    report: ConsumerReport

    def __init__(
        self, cfg: ConsumerConfig, ready: multiprocessing.synchronize.Event, stop: multiprocessing.synchronize.Event
    ) -> None:
        self.cfg = cfg
        self.ready = ready
        self.stop = stop
        self.report = ConsumerReport()
        self.connection: Any = None
        self.channel: Any = None
        self.done = False
        self.until = StopWhen(stop, cfg.drain, cfg.idle_s, cfg.drain_s)
        self.acks = AckTimer(cfg.acks, self._call_later, self._ack)

    def run(self) -> ConsumerReport:
        wall0, cpu0 = time.monotonic(), _cpu_seconds()
        index = 0
        lost_since: float | None = None
        while not self.done:
            port = self.cfg.ports[index % len(self.cfg.ports)]
            self.connection = pika.SelectConnection(
                _parameters(port),
                on_open_callback=self._on_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_closed,
            )
            self.connection.ioloop.call_later(0.05, self._check_stop)
            self.connection.ioloop.start()
            if self.done:
                break
            if self.channel is not None or lost_since is None:  # it had worked: a new outage starts now
                lost_since = time.monotonic()
            self.channel = None
            if time.monotonic() - lost_since > self.cfg.give_up_s:
                self.report.errors.append(f"gave up reconnecting after {self.cfg.give_up_s:.0f} s")
                break
            if self.until.stopping():
                assert self.until.stop_seen_at is not None
                if not self.cfg.drain or time.monotonic() - self.until.stop_seen_at > self.cfg.drain_s:
                    break
            index += 1
            self.report.reconnects += 1
            time.sleep(0.05)
        self.report.cpu_s = _cpu_seconds() - cpu0
        self.report.wall_s = time.monotonic() - wall0
        return self.report

    def _on_channel(self, channel: Any) -> None:
        self.channel = channel
        self.acks.reset()  # delivery tags start again on a new channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_cancel_callback(self._on_cancelled)
        channel.basic_qos(prefetch_count=self.cfg.prefetch, callback=lambda _frame: self._consume())

    def _consume(self) -> None:
        self.channel.basic_consume(self.cfg.queue, self._on_message, auto_ack=False, callback=self._on_consume_ok)

    def _on_consume_ok(self, _frame: Any) -> None:
        self.ready.set()

    def _on_cancelled(self, _frame: Any) -> None:
        """The broker cancelled our consumer (e.g. the queue moved): subscribe again shortly."""
        self.report.cancels += 1
        self.connection.ioloop.call_later(0.1, self._consume)

    def _on_message(self, channel: Any, method: Any, _properties: Any, body: bytes) -> None:
        self.report.record(body, time.monotonic_ns(), method.redelivered)
        self.acks.delivered(method.delivery_tag)
        self.until.delivered()

    def _call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.connection.ioloop.call_later(delay, callback)

    def _ack(self, ack: Ack) -> None:
        channel = self.channel
        if channel is not None and channel.is_open:
            channel.basic_ack(ack.tag, multiple=ack.multiple)
            self.report.acks_sent += 1

    def _check_stop(self) -> None:
        if self.until.finished():
            ack = self.acks.batching.flush()
            if ack is not None:
                self._ack(ack)
            self.done = True
            if self.connection.is_open:
                self.connection.close()
            else:
                self.connection.ioloop.stop()
            return
        self.connection.ioloop.call_later(0.05, self._check_stop)


def _consumer_main(
    cfg: ConsumerConfig,
    ready: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[Any],
) -> None:
    put_report(results, "consumer", lambda: _Consumer(cfg, ready, stop).run(), lambda e: ConsumerReport(errors=e))


# --- orchestration (the parent process) -------------------------------------------------

_CTX = multiprocessing.get_context("spawn")


def prepare_queue(cluster: RabbitCluster, queue: str, node: int = 0, timeout: float = 30.0) -> list[str]:
    """(Re)declare `queue` through `node` (so its master is there) and wait until every mirror is synchronised."""
    connection = pika.BlockingConnection(_parameters(cluster.amqp_ports[node]))
    try:
        channel = connection.channel()
        channel.queue_delete(queue)
        channel.queue_declare(queue, durable=True)
    finally:
        connection.close()
    deadline = time.monotonic() + timeout
    wanted = cluster.size - 1
    while True:
        info = cluster.queue_info(queue)
        if len(info.synchronised) >= wanted:
            return info.synchronised
        if time.monotonic() > deadline:
            raise RabbitClusterError(
                f"{queue}: mirrors {info.mirrors}, synchronised {info.synchronised} after {timeout} s"
            )
        time.sleep(0.2)


def delete_queue(cluster: RabbitCluster, queue: str) -> None:
    for i in range(cluster.size):
        if not cluster.alive(i):
            continue
        with contextlib.suppress(Exception):
            connection = pika.BlockingConnection(_parameters(cluster.amqp_ports[i]))
            try:
                connection.channel().queue_delete(queue)
            finally:
                connection.close()
            return


def _ports_from(cluster: RabbitCluster, first: int) -> list[int]:
    ports = cluster.amqp_ports
    return ports[first:] + ports[:first]


def _collect(results: multiprocessing.Queue[Any], names: set[str], timeout: float) -> dict[str, Any]:
    got: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while names - got.keys():
        try:
            name, report = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue_module.Empty:
            raise RuntimeError(f"no report from {sorted(names - got.keys())} within {timeout:.0f} s") from None
        got[name] = report
    return got


def _join(processes: Sequence[SpawnProcess]) -> None:
    for p in processes:
        if p.pid is None:  # never started
            continue
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def _cpu_note(name: str, cpu_s: float, wall_s: float) -> str:
    return f"{name} CPU {100 * cpu_s / wall_s:.0f}%" if wall_s > 0 else ""


def _await_start(started: Any, process: SpawnProcess, timeout: float = 30.0) -> float:
    """The producer's time zero (CLOCK_MONOTONIC seconds), once it has published its first message."""
    deadline = time.monotonic() + timeout
    while started.value == 0.0:
        if time.monotonic() > deadline or not process.is_alive():
            raise RuntimeError(f"{process.name} did not start publishing within {timeout:.0f} s")
        time.sleep(0.01)
    return float(started.value)


CpuClock = Callable[[], float]  # CPU seconds all of a system's server processes have used so far


def broker_cores(cpu_seconds: CpuClock, from_s: float, to_s: float) -> float:
    """The cores a system's servers used from `from_s` to `to_s` (CLOCK_MONOTONIC seconds; sleeps until each)."""
    time.sleep(max(0.0, from_s - time.monotonic()))
    cpu0, t0 = cpu_seconds(), time.monotonic()
    time.sleep(max(0.0, to_s - time.monotonic()))
    elapsed = time.monotonic() - t0
    return (cpu_seconds() - cpu0) / elapsed if elapsed > 0 else 0.0


ProducerMain = Callable[[Any, Any, "multiprocessing.Queue[Any]"], None]
ConsumerMain = Callable[..., None]  # (cfg, ready, stop, results)


def client_process(main: Callable[..., None], *args: Any) -> None:
    """A client process's entry, for every system's `main`: what its imports allocated (the client library,
    gRPC and protobuf, pika or nats-py: tens of thousands of objects) is moved out of the collector's reach
    before the run, as the ringq nodes do at start (services/node.py). The run's collections then scan only
    the run's objects. Without it, one client's first full collection took 33-37 ms near the start of the
    measured window: a pause of the harness, counted in the broker's latency."""
    gc.freeze()
    main(*args)


def run_producer(main: ProducerMain, cfg: Any, cpu_seconds: CpuClock, durations: Durations) -> tuple[Any, float]:
    """W1's processes: the producer `main(cfg, started, results)` alone; its report and the brokers' cores."""
    results: multiprocessing.Queue[Any] = _CTX.Queue()
    started = _CTX.Value("d", 0.0)
    producer = _CTX.Process(target=client_process, args=(main, cfg, started, results), name="w1-producer")
    producer.start()
    try:
        started_s = _await_start(started, producer)
        window = started_s + durations.warmup_s
        cores = broker_cores(cpu_seconds, window, window + durations.measure_s)
        report = _collect(results, {"producer"}, durations.warmup_s + durations.measure_s + 60)["producer"]
    finally:
        _join([producer])
    return report, cores


@dataclass
class _RunOutcome:
    producer: ProducerReport
    consumer: ConsumerReport
    killed_at_ns: int | None = None
    killed_node: str = ""
    master_before: str = ""
    master_after: str = ""
    broker_cores: float | None = None


@dataclass
class _KillInfo:
    node: str
    at_ns: int


@dataclass
class PairSpec:
    """What W2 and W3 run: a consumer, then a producer, each `main` in its own process."""

    producer_main: ProducerMain
    producer_cfg: Any
    consumer_main: ConsumerMain
    consumer_cfg: Any
    cpu_seconds: CpuClock
    warmup_s: float
    measure_s: float
    drain_s: float = 30.0
    subscribe_timeout_s: float = 30.0


def run_pair(spec: PairSpec, on_started: Callable[[float], _KillInfo | None] | None = None) -> _RunOutcome:
    """Start the consumer, wait until it is subscribed, start the producer; measure the brokers' cores over
    the window (with `on_started`, which kills a node at the end of the warm-up: from its return to the
    window's end); collect both reports (the consumer's after the parent's stop, and its drain)."""
    results: multiprocessing.Queue[Any] = _CTX.Queue()
    ready, stop = _CTX.Event(), _CTX.Event()
    started = _CTX.Value("d", 0.0)
    consumer_args = (spec.consumer_main, spec.consumer_cfg, ready, stop, results)
    producer_args = (spec.producer_main, spec.producer_cfg, started, results)
    consumer = _CTX.Process(target=client_process, args=consumer_args, name="consumer")
    producer = _CTX.Process(target=client_process, args=producer_args, name="producer")
    kill: _KillInfo | None = None
    got: dict[str, Any] = {}
    try:
        consumer.start()
        if not ready.wait(spec.subscribe_timeout_s):
            raise RuntimeError(f"the consumer did not subscribe within {spec.subscribe_timeout_s:g} s")
        producer.start()
        started_s = _await_start(started, producer)
        window_end = started_s + spec.warmup_s + spec.measure_s
        if on_started is not None:
            kill = on_started(started_s)
            cores = broker_cores(spec.cpu_seconds, time.monotonic(), window_end)
        else:
            cores = broker_cores(spec.cpu_seconds, started_s + spec.warmup_s, window_end)
        got = _collect(results, {"producer"}, spec.warmup_s + spec.measure_s + 120)
        stop.set()
        got.update(_collect(results, {"consumer"}, spec.drain_s + 60))
    finally:
        stop.set()
        _join([consumer, producer])
    outcome = _RunOutcome(producer=got["producer"], consumer=got["consumer"], broker_cores=cores)
    if kill is not None:
        outcome.killed_at_ns = kill.at_ns
        outcome.killed_node = kill.node
    return outcome


def _cores_note(cores: float | None) -> str:
    return f"brokers {cores or 0:.2f} cores"


def w1_result(
    report: ProducerReport,
    durations: Durations,
    cores: float,
    extra_notes: Sequence[str] = (),
    extra_details: dict[str, Any] | None = None,
) -> WorkloadResult:
    """The W1 result record from the producer's report (shared by every system's workloads)."""
    notes = [
        f"{report.confirmed_in_window} confirmed in {durations.measure_s:g} s after {durations.warmup_s:g} s warm-up",
        _cpu_note("producer", report.cpu_s, report.wall_s),
        _cores_note(cores),
    ]
    if report.nacked:
        notes.append(f"{report.nacked} nacked")
    notes.extend(extra_notes)
    if report.errors:
        notes.append("errors: " + "; ".join(report.errors[:3]))
    return WorkloadResult(
        name=workload_name("w1"),
        rate=report.confirmed_in_window / durations.measure_s,
        broker_cores=cores,
        notes=", ".join(n for n in notes if n),
        details={
            "confirmed": report.confirmed,
            "published": report.published,
            "producer_cpu_s": round(report.cpu_s, 3),
            "producer_wall_s": round(report.wall_s, 3),
            **(extra_details or {}),
        },
    )


def run_w1(cluster: RabbitCluster, durations: Durations, queue: str = "bench.w1") -> WorkloadResult:
    """One producer, confirms with up to 1000 in flight, nobody consuming: confirmed msgs/s."""
    prepare_queue(cluster, queue)
    cfg = ProducerConfig(_ports_from(cluster, 0), queue, durations.warmup_s, durations.measure_s)
    try:
        report, cores = run_producer(_producer_main, cfg, cluster.cpu_seconds, durations)
    finally:
        delete_queue(cluster, queue)
    return w1_result(report, durations, cores)


def _run_pair(
    cluster: RabbitCluster,
    queue: str,
    warmup_s: float,
    measure_s: float,
    *,
    rate: float | None,
    drain: bool,
    record_confirmed: bool,
    acks: AckPolicy,
    drain_s: float = 30.0,
    on_started: Callable[[float], _KillInfo | None] | None = None,
) -> _RunOutcome:
    master_before = cluster.queue_info(queue).master
    ports = _ports_from(cluster, cluster.node_index(master_before))
    spec = PairSpec(
        producer_main=_producer_main,
        producer_cfg=ProducerConfig(ports, queue, warmup_s, measure_s, rate=rate, record_confirmed=record_confirmed),
        consumer_main=_consumer_main,
        consumer_cfg=ConsumerConfig(ports, queue, acks=acks, drain=drain, drain_s=drain_s),
        cpu_seconds=cluster.cpu_seconds,
        warmup_s=warmup_s,
        measure_s=measure_s,
        drain_s=drain_s,
    )
    outcome = run_pair(spec, on_started)
    outcome.master_before = master_before
    if outcome.killed_at_ns is not None:
        with contextlib.suppress(Exception):
            outcome.master_after = cluster.queue_info(queue).master
    return outcome


def scheduled_ns(started_ns: int, rate: float, seq: int) -> int:
    """When a producer paced at `rate` from `started_ns` (time zero) is due to send message `seq`."""
    return started_ns + int(seq * NS / rate)


def _first_deliveries(consumer: ConsumerReport, start_ns: int, end_ns: int) -> list[tuple[int, int, int]]:
    """(received, send stamp, sequence number) of each first delivery received in [start_ns, end_ns)."""
    seen: set[int] = set()
    out: list[tuple[int, int, int]] = []
    for received, sent, seq in zip(consumer.received_ns, consumer.sent_ns, consumer.seqs, strict=True):
        if seq in seen:
            continue
        seen.add(seq)
        if start_ns <= received < end_ns:
            out.append((received, sent, seq))
    return out


def _latencies_ms(consumer: ConsumerReport, start_ns: int, end_ns: int) -> list[float]:
    """Latencies from the send stamp of first deliveries received in [start_ns, end_ns), sorted."""
    return sorted((received - sent) / 1e6 for received, sent, _ in _first_deliveries(consumer, start_ns, end_ns))


@dataclass(frozen=True)
class ScheduleFigures:
    """At a fixed rate, for the first deliveries of a window: the latency from each message's scheduled send
    time (p50, p99), and the producer's pacing delay, from the scheduled time to the send stamp (p50, p99), ms."""

    p50_ms: float
    p99_ms: float
    pacing_p50_ms: float
    pacing_p99_ms: float

    def note(self) -> str:
        return (
            f"from the scheduled send time p50 {self.p50_ms:.2f} p99 {self.p99_ms:.2f} ms (producer's pacing delay "
            f"p50 {self.pacing_p50_ms:.2f} p99 {self.pacing_p99_ms:.2f} ms)"
        )


def schedule_figures(
    consumer: ConsumerReport, started_ns: int, rate: float, start_ns: int, end_ns: int
) -> ScheduleFigures | None:
    """`ScheduleFigures` of the first deliveries received in [start_ns, end_ns) of a producer paced at `rate` from
    `started_ns`; None if there were none."""
    firsts = _first_deliveries(consumer, start_ns, end_ns)
    if not firsts:
        return None
    due = [scheduled_ns(started_ns, rate, seq) for _, _, seq in firsts]
    latencies = sorted((received - at) / 1e6 for (received, _, _), at in zip(firsts, due, strict=True))
    delays = sorted((sent - at) / 1e6 for (_, sent, _), at in zip(firsts, due, strict=True))
    return ScheduleFigures(
        percentile(latencies, 0.50), percentile(latencies, 0.99), percentile(delays, 0.50), percentile(delays, 0.99)
    )


def run_w2(
    cluster: RabbitCluster,
    durations: Durations,
    *,
    rate: float | None = None,
    queue: str = "bench.w2",
    acks: AckPolicy = BATCHED,
    name: str | None = None,
) -> WorkloadResult:
    """Producer and consumer at once (prefetch 1000, manual acks): delivered msgs/s and latency p50/p99."""
    prepare_queue(cluster, queue)
    try:
        run = _run_pair(
            cluster,
            queue,
            durations.warmup_s,
            durations.measure_s,
            rate=rate,
            drain=False,
            record_confirmed=False,
            acks=acks,
        )
    finally:
        delete_queue(cluster, queue)
    return w2_result(run, durations, rate, name=name, extra_notes=[acks.describe()])


def w2_result(
    run: Any,
    durations: Durations,
    rate: float | None,
    extra_notes: Sequence[str] = (),
    extra_details: dict[str, Any] | None = None,
    name: str | None = None,
) -> WorkloadResult:
    """The W2 result record from a producer/consumer run (shared by every system's workloads)."""
    producer, consumer = run.producer, run.consumer
    start, end = producer.window_start_ns, producer.window_end_ns
    delivered = sum(1 for t in consumer.received_ns if start <= t < end)
    latencies = _latencies_ms(consumer, start, end)
    scheduled = None if rate is None else schedule_figures(consumer, producer.started_ns, rate, start, end)
    notes = [
        f"{delivered} delivered in {durations.measure_s:g} s after {durations.warmup_s:g} s warm-up",
        f"confirmed {producer.confirmed_in_window / durations.measure_s:.0f}/s",
        *extra_notes[:1],
        _cpu_note("producer", producer.cpu_s, producer.wall_s),
        _cpu_note("consumer", consumer.cpu_s, consumer.wall_s),
        _cores_note(run.broker_cores),
    ]
    if scheduled is not None:
        notes.append(scheduled.note())
    if rate is not None and producer.behind_schedule:
        notes.append(f"producer {producer.behind_schedule} msgs behind schedule at the end")
    notes.extend(extra_notes[1:])
    errors = producer.errors + consumer.errors
    if errors:
        notes.append("errors: " + "; ".join(errors[:3]))
    return WorkloadResult(
        name=name or (workload_name("w2") if rate is None else workload_name("w2rate", rate)),
        rate=delivered / durations.measure_s,
        p50_ms=percentile(latencies, 0.50) if latencies else None,
        p99_ms=percentile(latencies, 0.99) if latencies else None,
        p50_from_schedule_ms=scheduled.p50_ms if scheduled is not None else None,
        p99_from_schedule_ms=scheduled.p99_ms if scheduled is not None else None,
        duplicates=len(consumer.seqs) - len(set(consumer.seqs)),
        broker_cores=run.broker_cores,
        notes=", ".join(n for n in notes if n),
        details={
            "delivered_in_window": delivered,
            "confirmed_in_window": producer.confirmed_in_window,
            "published": producer.published,
            "acks_sent": consumer.acks_sent,
            "target_rate": rate if rate is not None else "unbounded",
            **(extra_details or {}),
            "producer_cpu_s": round(producer.cpu_s, 3),
            "consumer_cpu_s": round(consumer.cpu_s, 3),
        },
    )


def run_w3(
    cluster: RabbitCluster,
    durations: Durations,
    *,
    rate: float = FIXED_RATE,
    queue: str = "bench.w3",
    acks: AckPolicy = EACH,
) -> WorkloadResult:
    """W2 at a fixed rate, SIGKILL the master's node: seconds without service, messages lost, duplicates."""
    prepare_queue(cluster, queue)
    master = cluster.queue_master(queue)  # asked before the clients start: rabbitmqctl costs CPU

    def kill_master(started_s: float) -> _KillInfo:
        time.sleep(max(0.0, started_s + durations.w3_warmup_s - time.monotonic()))
        at = cluster.kill_node(master)
        return _KillInfo(node=cluster.node_names[master], at_ns=int(at * NS))

    try:
        run = _run_pair(
            cluster,
            queue,
            durations.w3_warmup_s,
            durations.w3_after_kill_s,
            rate=rate,
            drain=True,
            record_confirmed=True,
            acks=acks,
            drain_s=durations.drain_s,
            on_started=kill_master,
        )
    finally:
        delete_queue(cluster, queue)
    result = _w3_result(run, rate, durations)
    result.notes += f", {acks.describe()}"
    return result


def _w3_result(run: _RunOutcome, rate: float, durations: Durations) -> WorkloadResult:
    producer, consumer = run.producer, run.consumer
    assert run.killed_at_ns is not None
    kill = run.killed_at_ns
    received = list(consumer.received_ns)
    # the longest stretch without a delivery, from 1 s before the kill to the last delivery
    around = [kill - NS, *(t for t in received if t >= kill - NS)]
    gap_ns, resumed_ns = 0, kill
    for a, b in itertools.pairwise(around):
        if b - a > gap_ns:
            gap_ns, resumed_ns = b - a, b
    seen: set[int] = set()
    redelivered_unseen = 0  # flagged redelivered, yet this is the first time the consumer sees them
    for seq, flag in zip(consumer.seqs, consumer.redelivered_flags, strict=True):
        if flag and seq not in seen:
            redelivered_unseen += 1
        seen.add(seq)
    delivered = set(consumer.seqs)
    confirmed = set(producer.confirmed_seqs)
    lost = len(confirmed - delivered)
    duplicates = len(consumer.seqs) - len(delivered)
    latencies = _latencies_ms(consumer, producer.started_ns, 2**62)
    run_s = (producer.window_end_ns - producer.started_ns) / NS
    notes = [
        f"SIGKILL {run.killed_node} (master) {durations.w3_warmup_s:g} s in; master now {run.master_after or '?'}",
        f"deliveries resumed {(resumed_ns - kill) / NS:.2f} s after the kill",
        f"longest confirm gap {producer.longest_confirm_gap_s:.2f} s",
        f"reconnects: producer {producer.reconnects}, consumer {consumer.reconnects}",
        f"republished {producer.republished}, redelivered {consumer.redelivered} ({redelivered_unseen} first seen)",
        f"{producer.sequence_numbers} published, {len(confirmed)} confirmed, {len(delivered)} delivered",
        f"surviving brokers {run.broker_cores or 0:.2f} cores from the kill to the window's end",
    ]
    if producer.nacked:
        notes.append(f"{producer.nacked} nacked")
    # losing the killed node's connection, and failing to reach it again, are what W3 is about
    expected = ("connection lost", "connect:", "channel closed: StreamLostError")
    errors = [e for e in producer.errors + consumer.errors if not e.startswith(expected)]
    if errors:
        notes.append("errors: " + "; ".join(errors[:3]))
    return WorkloadResult(
        name=f"W3@{rate:g}/s",
        rate=len(delivered) / run_s if run_s > 0 else None,
        p50_ms=percentile(latencies, 0.50) if latencies else None,
        p99_ms=percentile(latencies, 0.99) if latencies else None,
        gap_s=gap_ns / NS,
        lost=lost,
        duplicates=duplicates,
        broker_cores=run.broker_cores,
        notes=", ".join(notes),
        details={
            "killed_node": run.killed_node,
            "master_after": run.master_after,
            "published_unique": producer.sequence_numbers,
            "confirmed": len(confirmed),
            "delivered_unique": len(delivered),
            "deliveries": len(consumer.seqs),
            "republished": producer.republished,
            "redelivered": consumer.redelivered,
            "redelivered_first_seen": redelivered_unseen,
            "producer_reconnects": producer.reconnects,
            "consumer_reconnects": consumer.reconnects,
            "resumed_after_kill_s": round((resumed_ns - kill) / NS, 3),
            "longest_confirm_gap_s": round(producer.longest_confirm_gap_s, 3),
        },
    )


# --- everything, one run -------------------------------------------------------------------

WORKLOADS = ("w1", "w2", "w2each", "w2rate", "w3")  # W3 last: it kills a node
# Each workload's consumer's acknowledgements (W1 has no consumer): batched where users configure for
# throughput; one per message beside it, and in W3, whose duplicates must be the broker's.
WORKLOAD_ACKS = {"w2": BATCHED, "w2each": EACH, "w2rate": BATCHED, "w3": EACH}


def workload_name(key: str, rate: float = FIXED_RATE) -> str:
    """The name a workload's results carry ("W1", "W2", "W2 ack each", "W2@2000/s", "W3@2000/s")."""
    names = {
        "w1": "W1",
        "w2": "W2",
        "w2each": "W2 ack each",
        "w2rate": f"W2@{rate:g}/s",
        "w2rate_unbound": f"W2@{rate:g}/s unbound",  # ringq's nodes left unplaced (bench/ringq_workloads.py)
        "w3": f"W3@{rate:g}/s",
    }
    return names[key]


def queue_steps(
    w1: Callable[..., WorkloadResult],
    w2: Callable[..., WorkloadResult],
    w3: Callable[..., WorkloadResult],
    durations: Durations,
    rate: float,
    prefix: str,
) -> dict[str, Callable[[], WorkloadResult]]:
    """A queue broker's workloads by key, from its run_w1, run_w2 and run_w3 (bound to its cluster): each
    with its acknowledgements (`WORKLOAD_ACKS`) on a queue of its own (`prefix` + key)."""
    return {
        "w1": lambda: w1(durations),
        "w2": lambda: w2(durations, acks=WORKLOAD_ACKS["w2"]),
        "w2each": lambda: w2(
            durations, queue=f"{prefix}w2each", acks=WORKLOAD_ACKS["w2each"], name=workload_name("w2each")
        ),
        "w2rate": lambda: w2(durations, rate=rate, queue=f"{prefix}w2rate", acks=WORKLOAD_ACKS["w2rate"]),
        "w3": lambda: w3(durations, rate=rate, acks=WORKLOAD_ACKS["w3"]),
    }


def check_workloads(only: Sequence[str], supported: Sequence[str] = WORKLOADS) -> None:
    unknown = set(only) - set(supported)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {', '.join(supported)}")


@dataclass
class ReferenceReport:
    """The reference side of `make bench`: what ran, on what, and its measurements."""

    rabbitmq_version: str
    erlang_version: str
    nodes: int
    setup: str
    results: list[WorkloadResult]

    @property
    def version(self) -> str:
        return f"RabbitMQ {self.rabbitmq_version} on Erlang/OTP {self.erlang_version}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_reference(
    *,
    quick: bool = False,
    durations: Durations | None = None,
    only: Sequence[str] = WORKLOADS,
    rate: float = FIXED_RATE,
    progress: Callable[[str], None] | None = None,
) -> ReferenceReport:
    """Start a 3-node cluster, run the chosen workloads (W3 last: it kills a node), stop the cluster."""
    check_workloads(only)
    durations = durations or (Durations.quick() if quick else Durations())
    say = progress or (lambda _message: None)
    results: list[WorkloadResult] = []
    say("starting a 3-node RabbitMQ cluster on 127.0.0.1")
    with RabbitCluster(3) as cluster:
        say(f"RabbitMQ {cluster.version} on Erlang/OTP {cluster.erlang_version}: {', '.join(cluster.node_names)}")
        steps = queue_steps(
            partial(run_w1, cluster), partial(run_w2, cluster), partial(run_w3, cluster), durations, rate, "bench."
        )
        for key in WORKLOADS:
            if key in only:
                say(f"running {key}")
                results.append(steps[key]())
        setup = (
            f"{cluster.size} nodes on 127.0.0.1, classic queues mirrored by policy "
            f"{HA_POLICY_NAME} {json.dumps(HA_POLICY)}; pika {pika.__version__} SelectConnection, "
            f"producer and consumer in separate processes; {PAYLOAD_SIZE}-byte transient bodies; "
            f"confirms <= {MAX_IN_FLIGHT} in flight; prefetch {PREFETCH}; {BATCHED.describe()} "
            f"(W2 ack each and W3: {EACH.describe()})"
        )
        return ReferenceReport(
            rabbitmq_version=cluster.version,
            erlang_version=cluster.erlang_version,
            nodes=cluster.size,
            setup=setup,
            results=results,
        )


def format_table(results: Sequence[WorkloadResult]) -> str:
    """A plain-text table, one row per workload."""

    def cell(value: float | int | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    header = f"{'workload':<12} {'msgs/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'gap s':>7} {'lost':>6} {'dups':>6}  notes"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.name:<12} {cell(r.rate, '.0f'):>9} {cell(r.p50_ms, '.2f'):>9} {cell(r.p99_ms, '.2f'):>9} "
            f"{cell(r.gap_s, '.2f'):>7} {cell(r.lost, 'd'):>6} {cell(r.duplicates, 'd'):>6}  {r.notes}"
        )
    return "\n".join(lines)
