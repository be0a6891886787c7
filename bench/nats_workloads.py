"""The workloads of `make bench` against NATS JetStream: streams with 3 replicas, memory or file storage.

The method is the reference's (bench/reference/rabbitmq_workloads.py), imported from it as the ringq side
does: the result record, durations, body layout, in-flight bound (1000), prefetch (1000), the fixed rate
and its pacing, the producer's window (`AsyncWindowProducer`), the reports, the figures (`w1_result`,
`w2_result`) and the client processes' orchestration (`run_producer`, `run_pair`: the servers' CPU over
the window too). W1, W2 and W2 at the fixed rate; not W3, nor W2 with one ack per message (a JetStream
consumer with explicit acks acknowledges each message anyway).

- Cluster: bench/nats_cluster.py's 3 servers (Debian's nats-server, JetStream on) on 127.0.0.1, started
  afresh for each run of `run_nats`.
- Stream: one per workload, named after it, on one subject, 3 replicas, memory or file storage (the
  `storage` of the run), created through the servers before the clients start, once every replica is
  current, and deleted after. Both clients connect to the stream leader's server first (as the other
  systems' clients go to the queue's master).
- Client: nats-py (asyncio), producer and consumer in two separate processes.
- Producer: JetStream publishes with acknowledgements through the client's asynchronous publish
  (`JetStreamContext.publish_async`, its window `publish_async_max_pending` = 1000): a message counts
  when its PubAck (the stream's confirm, once stored on a quorum of replicas) arrives.
- Consumer: a durable pull consumer (explicit acks, max_ack_pending = prefetch 1000) read by continuous
  pull requests, as the NATS clients' `Consume` does: requests for 1000 messages in all outstanding,
  topped up when half of that has been delivered, each expiring after `PULL_EXPIRES_S`; messages are
  handled as they arrive, each acknowledged with `msg.ack()` (no reply awaited, like a basic.ack).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.synchronize
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib import metadata
from typing import Any

from bench.nats_cluster import NatsCluster
from bench.reference.rabbitmq_workloads import (
    FIXED_RATE,
    MAX_IN_FLIGHT,
    PAYLOAD_SIZE,
    PREFETCH,
    AsyncWindowProducer,
    ConsumerReport,
    Durations,
    PairSpec,
    ProducerReport,
    StopWhen,
    WorkloadResult,
    _cpu_seconds,
    check_workloads,
    make_body,
    put_report,
    run_pair,
    run_producer,
    w1_result,
    w2_result,
)

NODES = 3
STORAGES = ("memory", "file")
WORKLOADS = ("w1", "w2", "w2rate")  # what NATS runs of bench/reference's WORKLOADS
PUBLISH_BATCH = 100  # messages sent before the producer looks at its window again
DURABLE = "bench"
PULL_EXPIRES_S = 30.0  # a pull request's life (the NATS clients' default for Consume)
READY_TIMEOUT_S = 60.0  # JetStream answers once its meta group has a leader; a stream, once its replicas are
ACK_DESCRIPTION = "one ack per message (explicit acks, msg.ack())"


def stream_name(key: str) -> str:
    return f"bench-{key}"


def subject_of(key: str) -> str:
    return f"bench.{key}"


# --- producer (runs in its own process) ---------------------------------------------------------------


@dataclass
class ProducerConfig:
    urls: list[str]  # tried in order
    subject: str
    warmup_s: float
    measure_s: float
    rate: float | None = None  # msgs/s; None: as fast as the acknowledgements allow
    max_in_flight: int = MAX_IN_FLIGHT
    batch: int = PUBLISH_BATCH
    confirm_grace_s: float = 3.0


async def _connect(urls: Sequence[str], errors: list[str], closing: Callable[[], bool] = lambda: False) -> Any:
    """A connection to the servers, in order; its errors go to `errors` until `closing()` says the run is over
    (a callback still running when the connection closes fails, which says nothing of the run)."""
    import nats

    async def on_error(error: Exception) -> None:
        if len(errors) < 20 and not closing():
            errors.append(f"connection: {error!r}"[:200])

    return await nats.connect(
        servers=list(urls), dont_randomize=True, connect_timeout=2, max_reconnect_attempts=5, error_cb=on_error
    )


class _Producer(AsyncWindowProducer):
    cfg: ProducerConfig

    def __init__(self, cfg: ProducerConfig, started: Any) -> None:
        super().__init__(cfg, started, ProducerReport())
        self.js: Any = None

    async def run(self) -> ProducerReport:
        wall0, cpu0 = time.monotonic(), _cpu_seconds()
        nc = await _connect(self.cfg.urls, self.report.errors, lambda: self.done)
        try:
            self.js = nc.jetstream(publish_async_max_pending=self.cfg.max_in_flight)
            finisher = self.start()
            try:
                await self.produce()
                await finisher
            finally:
                finisher.cancel()
        finally:
            with contextlib.suppress(Exception):
                await nc.close()
        self.report.sequence_numbers = self.next_seq
        self.report.cpu_s = _cpu_seconds() - cpu0
        self.report.wall_s = time.monotonic() - wall0
        return self.report

    async def _send(self, keys: list[int]) -> None:
        for key in keys:
            future = await self.js.publish_async(self.cfg.subject, make_body(*self.pending[key]))
            future.add_done_callback(partial(self._on_ack, key))
        self.report.published += len(keys)

    def _on_ack(self, key: int, future: asyncio.Future[Any]) -> None:
        if self.done:
            return  # the run is over: what is still unacknowledged counts as not confirmed
        now = time.monotonic_ns()
        if self.settle(key) is None:
            return
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or error is not None:
            self.report.nacked += 1
            if len(self.report.errors) < 20:
                self.report.errors.append(f"publish: {error!r}"[:200])
            self.counted(0, now)
            return
        self.counted(1, now)


def _producer_main(cfg: ProducerConfig, started: Any, results: multiprocessing.Queue[Any]) -> None:
    put_report(
        results, "producer", lambda: asyncio.run(_Producer(cfg, started).run()), lambda e: ProducerReport(errors=e)
    )


# --- consumer (runs in its own process) ---------------------------------------------------------------


@dataclass
class ConsumerConfig:
    urls: list[str]
    stream: str
    durable: str = DURABLE
    prefetch: int = PREFETCH  # messages requested and not delivered yet, at most
    drain: bool = False  # after stop: keep consuming until idle_s without a delivery (at most drain_s)
    idle_s: float = 1.5
    drain_s: float = 30.0


class PullRequests:
    """The pull requests a consumer has outstanding, oldest first, each with the messages it may still bring
    (the server serves them in order). Pure: told what was asked and what came, it says what to ask next."""

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.remaining: deque[int] = deque()

    @property
    def outstanding(self) -> int:
        return sum(self.remaining)

    def top_up(self) -> int:
        """How many messages to request now (0: none): the rest up to `prefetch` once half of it has come."""
        outstanding = self.outstanding
        if outstanding > self.prefetch // 2:
            return 0
        wanted = self.prefetch - outstanding
        self.remaining.append(wanted)
        return wanted

    def delivered(self) -> None:
        if self.remaining:
            self.remaining[0] -= 1
            if self.remaining[0] <= 0:
                self.remaining.popleft()

    def ended(self) -> None:
        """The oldest request ended (expired, or the server ended it): it brings nothing more."""
        if self.remaining:
            self.remaining.popleft()


class _Consumer:
    def __init__(
        self, cfg: ConsumerConfig, ready: multiprocessing.synchronize.Event, stop: multiprocessing.synchronize.Event
    ) -> None:
        self.cfg = cfg
        self.ready = ready
        self.until = StopWhen(stop, cfg.drain, cfg.idle_s, cfg.drain_s)
        self.report = ConsumerReport()
        self.requests = PullRequests(cfg.prefetch)
        self.nc: Any = None
        self.closing = False
        self.inbox = ""
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{cfg.stream}.{cfg.durable}"

    async def run(self) -> ConsumerReport:
        wall0, cpu0 = time.monotonic(), _cpu_seconds()
        self.nc = await _connect(self.cfg.urls, self.report.errors, lambda: self.closing)
        try:
            self.inbox = self.nc.new_inbox()
            await self.nc.subscribe(self.inbox, cb=self._on_message, pending_msgs_limit=-1, pending_bytes_limit=-1)
            await self._pull()
            await self.nc.flush()
            self.ready.set()
            while not self.until.finished():
                await asyncio.sleep(0.05)
        finally:
            self.closing = True
            with contextlib.suppress(Exception):
                await self.nc.close()
        self.report.cpu_s = _cpu_seconds() - cpu0
        self.report.wall_s = time.monotonic() - wall0
        return self.report

    async def _pull(self) -> None:
        wanted = self.requests.top_up()
        if wanted:
            request = {"batch": wanted, "expires": int(PULL_EXPIRES_S * 1e9)}
            await self.nc.publish(self.next_subject, json.dumps(request).encode(), reply=self.inbox)

    async def _on_message(self, msg: Any) -> None:
        now = time.monotonic_ns()
        if self.closing:
            return
        if not msg.reply:  # a status: 408 (the request expired), 409 (the server ended it), 404, 100
            status = msg.headers.get("Status", "") if msg.headers else ""
            if status in ("408", "409"):
                self.requests.ended()
            elif len(self.report.errors) < 20:
                self.report.errors.append(f"pull status {status} {msg.headers.get('Description', '')}"[:200])
            await self._pull()
            return
        self.report.record(msg.data, now, msg.metadata.num_delivered > 1)
        self.until.delivered()
        await msg.ack()
        self.report.acks_sent += 1
        self.requests.delivered()
        await self._pull()


def _consumer_main(
    cfg: ConsumerConfig,
    ready: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[Any],
) -> None:
    put_report(
        results, "consumer", lambda: asyncio.run(_Consumer(cfg, ready, stop).run()), lambda e: ConsumerReport(errors=e)
    )


# --- orchestration (the parent process) ---------------------------------------------------------------


class NatsStreams:
    """Creates, inspects and deletes the workloads' streams on a running cluster (from the parent process)."""

    def __init__(self, cluster: NatsCluster, storage: str) -> None:
        if storage not in STORAGES:
            raise ValueError(f"storage is one of {STORAGES}, not {storage!r}")
        self.cluster = cluster
        self.storage = storage

    def _call(self, action: Callable[[Any], Any]) -> Any:
        async def run() -> Any:
            nc = await _connect(self.cluster.urls, [])
            try:
                return await action(nc.jetstream(timeout=10))
            finally:
                await nc.close()

        return asyncio.run(run())

    def create(self, key: str, consumer: bool) -> int:
        """The stream of workload `key` (and its durable pull consumer); the index of its leader's server,
        once every replica is current."""
        from nats.js.api import AckPolicy, StorageType, StreamConfig
        from nats.js.api import ConsumerConfig as JsConsumerConfig

        storage = StorageType.MEMORY if self.storage == "memory" else StorageType.FILE
        name = stream_name(key)

        async def create(js: Any) -> str:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                try:
                    await js.add_stream(
                        StreamConfig(name=name, subjects=[subject_of(key)], storage=storage, num_replicas=NODES)
                    )
                    if consumer:
                        await js.add_consumer(
                            name,
                            JsConsumerConfig(
                                durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=PREFETCH
                            ),
                        )
                    info = await js.stream_info(name)
                    cluster = info.cluster
                    current = [r for r in (cluster.replicas or []) if r.current] if cluster else []
                    if cluster is not None and cluster.leader and len(current) >= NODES - 1:
                        return str(cluster.leader)
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: no leader with every replica current after {READY_TIMEOUT_S:g} s")
                await asyncio.sleep(0.2)

        leader: str = self._call(create)
        return self.cluster.index_of(leader)

    def delete(self, key: str) -> None:
        async def delete(js: Any) -> None:
            await js.delete_stream(stream_name(key))

        with contextlib.suppress(Exception):
            self._call(delete)


def run_w1(streams: NatsStreams, durations: Durations) -> WorkloadResult:
    """One producer, acknowledgements with up to 1000 outstanding, nobody consuming: confirmed msgs/s."""
    leader = streams.create("w1", consumer=False)
    cfg = ProducerConfig(streams.cluster.urls_from(leader), subject_of("w1"), durations.warmup_s, durations.measure_s)
    try:
        report, cores = run_producer(_producer_main, cfg, streams.cluster.cpu_seconds, durations)
    finally:
        streams.delete("w1")
    return w1_result(report, durations, cores)


def run_w2(streams: NatsStreams, durations: Durations, *, rate: float | None = None) -> WorkloadResult:
    """Producer and consumer at once (1000 pulled at most, explicit acks): delivered msgs/s, latency p50/p99."""
    key = "w2" if rate is None else "w2rate"
    leader = streams.create(key, consumer=True)
    urls = streams.cluster.urls_from(leader)
    spec = PairSpec(
        producer_main=_producer_main,
        producer_cfg=ProducerConfig(urls, subject_of(key), durations.warmup_s, durations.measure_s, rate=rate),
        consumer_main=_consumer_main,
        consumer_cfg=ConsumerConfig(urls, stream_name(key)),
        cpu_seconds=streams.cluster.cpu_seconds,
        warmup_s=durations.warmup_s,
        measure_s=durations.measure_s,
    )
    try:
        run = run_pair(spec)
    finally:
        streams.delete(key)
    return w2_result(run, durations, rate, extra_notes=[ACK_DESCRIPTION])


# --- everything, one run ------------------------------------------------------------------------------


@dataclass
class NatsReport:
    """One run of NATS JetStream in `make bench`: what ran, on what, and its measurements."""

    version: str
    storage: str
    nodes: int
    setup: str
    results: list[WorkloadResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_nats(
    storage: str,
    *,
    durations: Durations | None = None,
    only: Sequence[str] = WORKLOADS,
    rate: float = FIXED_RATE,
    progress: Callable[[str], None] | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> NatsReport:
    """Start a 3-server NATS cluster, run the chosen workloads on streams of `storage`, stop the cluster."""
    check_workloads(only, WORKLOADS)
    durations = durations or Durations()
    say = progress or (lambda _message: None)
    results: list[WorkloadResult] = []
    say(f"starting a {NODES}-server NATS cluster on 127.0.0.1 ({storage} storage)")
    with NatsCluster(NODES) as cluster:
        streams = NatsStreams(cluster, storage)
        say(f"NATS server {cluster.version}: {', '.join(cluster.names)} in {cluster.directory}")
        steps: dict[str, Callable[[], WorkloadResult]] = {
            "w1": lambda: run_w1(streams, durations),
            "w2": lambda: run_w2(streams, durations),
            "w2rate": lambda: run_w2(streams, durations, rate=rate),
        }
        for key in WORKLOADS:
            if key in only:
                if stop_requested():
                    raise KeyboardInterrupt
                say(f"running {key}")
                try:
                    results.append(steps[key]())
                except Exception as error:
                    raise RuntimeError(f"NATS {storage} {key} failed: {error}\n{cluster.log_tails()}") from error
        version = cluster.version
    setup = (
        f"{NODES} nats-server {version} processes with JetStream on 127.0.0.1, a stream per workload with "
        f"{NODES} replicas and {storage} storage; nats-py {metadata.version('nats-py')} (asyncio), producer and "
        f"consumer in separate processes; {PAYLOAD_SIZE}-byte bodies; JetStream publishes with acks "
        f"(publish_async) <= {MAX_IN_FLIGHT} outstanding; a durable pull consumer (explicit acks, max_ack_pending "
        f"{PREFETCH}) read by continuous pull requests of {PREFETCH} messages in all, topped up at half; "
        f"{ACK_DESCRIPTION}"
    )
    return NatsReport(version=version, storage=storage, nodes=NODES, setup=setup, results=results)
