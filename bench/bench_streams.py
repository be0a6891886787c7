"""`make bench-streams`: ordered streams, ringq against a RabbitMQ quorum queue and a NATS JetStream stream.

In one run on this machine, for each of
- RabbitMQ: a quorum queue (3 replicas on a 3-node cluster, Debian's rabbitmq-server via bench/reference)
  with a single active consumer (x-single-active-consumer);
- NATS: a JetStream stream with 3 replicas and file storage on a 3-server cluster (Debian's nats-server,
  bench/nats_cluster.py), read through a durable push consumer with explicit acks;
- ringq: an ordered stream of 3 groups on a 4-node cluster (plaintext, like the other two),
two workloads (clients: bench/stream_clients.py; figures: bench/stream_metrics.py):
- throughput: one producer, publisher confirms, at most 1000 unconfirmed, 256-byte bodies, unthrottled for
  `--seconds` (or `--messages`), and one consumer reading in order at once (prefetch 500, one ack per
  message): confirmed msgs/s and delivered msgs/s over the run after a 1 s warm-up;
- failover: the same at a steady `--rate` (2,000 msgs/s), and after `--kill-after` seconds the leader is
  SIGKILLed (RabbitMQ: the quorum queue's leader node; NATS: the stream leader's server; ringq: the master
  node of the head send group), sending goes on for `--after-kill` seconds: the gap (longest interval
  without a confirm or without a delivery, from 1 s before the kill), lost (confirmed, never delivered),
  order violations, duplicates delivered to the application.
Clients connect to the node or server that is killed first (they fail over to the others). Each system's
cluster is started afresh for each repeat, runs both workloads and is stopped; the systems take turns
(repeat 1: RabbitMQ, NATS, ringq; repeat 2: ...), `--runs` repeats (3): median (min-max). Every process
listens on 127.0.0.1 only and is stopped at the end, also on failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

from bench.bench_gm import machine
from bench.bench_queues import _StopOnSignal, markdown_table, text_table
from bench.markdown import command_line, replace_marked
from bench.reference.rabbitmq_workloads import _CTX, _await_start, _collect, _join, client_process
from bench.stream_clients import (
    CONFIRM_GRACE_S,
    MAX_IN_FLIGHT,
    NATS_ACK_TIMEOUT_S,
    PREFETCH,
    ClientConfig,
    ConsumerRecord,
    ProducerRecord,
    consumer_main,
    producer_main,
)
from bench.stream_metrics import NS, FailoverFigures, Spread, failover_figures, per_second, rate, ratio, spread
from ringq import aio

MARK_BEGIN = "<!-- bench-streams:begin -->"
MARK_END = "<!-- bench-streams:end -->"
SECTION_TITLE = "## Ordered streams: ringq vs RabbitMQ quorum queue vs NATS JetStream (`make bench-streams`)"
SYSTEMS = ("rabbitmq", "nats", "ringq")
LABELS = {"rabbitmq": "RabbitMQ quorum", "nats": "NATS R3 file", "ringq": "ringq"}
RINGQ_NODES = 4
RINGQ_GROUPS = 3
NATS_ACK_WAIT_S = 5.0  # the NATS consumer's ack_wait: a delivery not acknowledged in time comes again
WARMUP_S = 1.0
WORKLOADS = ("throughput", "failover")
T = TypeVar("T")


# --- the systems ----------------------------------------------------------------------------------


class System(Protocol):
    key: str

    def __enter__(self) -> Self: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def describe(self) -> str: ...

    def prepare(self, name: str, cfg: ClientConfig) -> None:
        """Create the queue or stream `name` (empty); complete `cfg` if the clients need more."""

    def leader(self, name: str) -> tuple[int, str]:
        """The index and name of the node to kill: the leader or master of `name`."""

    def addresses_from(self, index: int) -> list[str]: ...

    def kill(self, index: int) -> float: ...

    def cleanup(self, name: str) -> None: ...


class RabbitSystem:
    key = "rabbitmq"

    def __init__(self) -> None:
        from bench.reference.rabbitmq_cluster import RabbitCluster

        self.cluster = RabbitCluster(3, policy=False)

    def __enter__(self) -> Self:
        self.cluster.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cluster.stop()

    def describe(self) -> str:
        import pika  # type: ignore[import-untyped]

        return (
            f"RabbitMQ {self.cluster.version} on Erlang/OTP {self.cluster.erlang_version}, {self.cluster.size} nodes; "
            f"a durable quorum queue (x-queue-type quorum, 3 members, x-single-active-consumer), declared through "
            f"node 1; pika {pika.__version__} SelectConnection (bench/reference's clients), persistent messages; the "
            f"producer publishes a nacked message again on a new channel (RabbitMQ 3.10 goes on nacking every "
            f"publish on a channel that published while the queue had no leader)"
        )

    def _channel_do(self, index: int, action: Callable[[Any], None]) -> None:
        import pika

        from bench.reference.rabbitmq_workloads import _parameters

        connection = pika.BlockingConnection(_parameters(self.cluster.amqp_ports[index]))
        try:
            action(connection.channel())
        finally:
            connection.close()

    def prepare(self, name: str, cfg: ClientConfig) -> None:
        arguments = {"x-queue-type": "quorum", "x-single-active-consumer": True}
        self._channel_do(0, lambda ch: ch.queue_declare(name, durable=True, arguments=arguments))

    def leader(self, name: str) -> tuple[int, str]:
        deadline = time.monotonic() + 30
        while True:
            alive = [i for i in range(self.cluster.size) if self.cluster.alive(i)]
            out = self.cluster.ctl(alive[0], "list_queues", "name", "leader", "--formatter", "json", timeout=20)
            for row in json.loads(out or "[]"):
                if row.get("name") == name and row.get("leader"):
                    node = str(row["leader"])
                    return self.cluster.node_index(node), node
            if time.monotonic() > deadline:
                raise RuntimeError(f"no leader for the quorum queue {name}: {out}")
            time.sleep(0.5)

    def addresses_from(self, index: int) -> list[str]:
        ports = [str(p) for p in self.cluster.amqp_ports]
        return ports[index:] + ports[:index]

    def kill(self, index: int) -> float:
        return self.cluster.kill_node(index)

    def cleanup(self, name: str) -> None:
        for i in range(self.cluster.size):
            if self.cluster.alive(i):
                with contextlib.suppress(Exception):
                    self._channel_do(i, lambda ch: ch.queue_delete(name))
                    return


class NatsSystem:
    key = "nats"

    def __init__(self) -> None:
        from bench.nats_cluster import NatsCluster

        self.cluster = NatsCluster(3)

    def __enter__(self) -> Self:
        self.cluster.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cluster.stop()

    def describe(self) -> str:
        return (
            f"NATS server {self.cluster.version}, {self.cluster.size} servers with JetStream; a stream with "
            f"3 replicas, file storage, a 2-minute duplicate window; a durable push consumer (3 replicas, explicit "
            f"acks, max_ack_pending {PREFETCH}, ack_wait {NATS_ACK_WAIT_S:g} s); nats-py {metadata.version('nats-py')} "
            f"(asyncio): asynchronous publishes with Nats-Msg-Id, sent again after {NATS_ACK_TIMEOUT_S:g} s "
            f"without a confirm, after an error reply and after a reconnect"
        )

    async def _with_js(self, action: Callable[[Any], Any], urls: Sequence[str] | None = None) -> Any:
        import nats

        live = [u for i, u in enumerate(self.cluster.urls) if self.cluster.alive(i)]
        nc = await nats.connect(servers=list(urls or live), connect_timeout=2, max_reconnect_attempts=5)
        try:
            return await action(nc.jetstream(timeout=10))
        finally:
            await nc.close()

    def prepare(self, name: str, cfg: ClientConfig) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

        deliver = f"deliver.{name}"
        cfg.nats_deliver_subject = deliver

        async def create(js: Any) -> None:
            deadline = time.monotonic() + 60
            while True:  # JetStream answers once its meta group has a leader
                try:
                    await js.add_stream(
                        StreamConfig(
                            name=name,
                            subjects=[name],
                            storage=StorageType.FILE,
                            num_replicas=3,
                            duplicate_window=120.0,
                        )
                    )
                    await js.add_consumer(
                        name,
                        ConsumerConfig(
                            durable_name="reader",
                            deliver_subject=deliver,
                            ack_policy=AckPolicy.EXPLICIT,
                            ack_wait=NATS_ACK_WAIT_S,
                            max_ack_pending=cfg.prefetch,
                        ),
                    )
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)

        asyncio.run(self._with_js(create))

    def leader(self, name: str) -> tuple[int, str]:
        async def ask(js: Any) -> str:
            info = await js.stream_info(name)
            return str(info.cluster.leader)

        leader = str(asyncio.run(self._with_js(ask)))
        return self.cluster.index_of(leader), leader

    def addresses_from(self, index: int) -> list[str]:
        return self.cluster.urls_from(index)

    def kill(self, index: int) -> float:
        return self.cluster.kill_server(index)

    def cleanup(self, name: str) -> None:
        async def delete(js: Any) -> None:
            await js.delete_stream(name)

        with contextlib.suppress(Exception):
            asyncio.run(self._with_js(delete))


class RingqSystem:
    key = "ringq"

    def __init__(self) -> None:
        from bench.ringq_workloads import RingqCluster

        self.cluster = RingqCluster(RINGQ_NODES, tls=False)

    def __enter__(self) -> Self:
        self.cluster.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cluster.stop()

    def describe(self) -> str:
        from bench.ringq_workloads import NODE_ARGS, ringq_version

        version, commit = ringq_version()
        return (
            f"ringq {version} ({commit}), {RINGQ_NODES} nodes and a coordinator, plaintext (node flags "
            f"{' '.join(NODE_ARGS)}); a durable ordered stream of {RINGQ_GROUPS} groups (2 replicas each); "
            f"Python SDK ringq.aio: stream_producer / send() futures, stream_consumer(prefetch={PREFETCH}), "
            f"one ack() per message (the SDK drops duplicate copies by stream_seq)"
        )

    def _run(self, action: Callable[[aio.Connection], Awaitable[T]]) -> T:
        async def run() -> T:
            connection = aio.Connection(self.cluster.live_addresses(), retry_for=30)
            try:
                return await asyncio.wait_for(action(connection), 60)
            finally:
                await connection.close()

        return asyncio.run(run())

    def prepare(self, name: str, cfg: ClientConfig) -> None:
        async def declare(connection: aio.Connection) -> None:
            await connection.declare_stream(name, groups=RINGQ_GROUPS, durable=True)

        self._run(declare)

    def leader(self, name: str) -> tuple[int, str]:
        async def status(connection: aio.Connection) -> str:
            deadline = time.monotonic() + 30
            while True:
                info = await connection.stream_status(name)
                if info.send_list:
                    for group in info.groups:
                        if group.group == info.send_list[0] and group.master_node:
                            return group.master_node
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stream {name}: no master for the head send group: {info}")
                await asyncio.sleep(0.2)

        node = self._run(status)
        return self.cluster.node_names.index(node), node

    def addresses_from(self, index: int) -> list[str]:
        return self.cluster.addresses_from(self.cluster.node_names[index])

    def kill(self, index: int) -> float:
        return self.cluster.kill_node(self.cluster.node_names[index])

    def cleanup(self, name: str) -> None:
        async def delete(connection: aio.Connection) -> None:
            await connection.delete_stream(name)

        with contextlib.suppress(Exception):
            self._run(delete)


def make_system(key: str) -> System:
    if key == "rabbitmq":
        return RabbitSystem()
    if key == "nats":
        return NatsSystem()
    if key == "ringq":
        return RingqSystem()
    raise ValueError(key)


def unavailable_reason(key: str) -> str | None:
    """Why `key` cannot run here, or None."""
    if key == "rabbitmq":
        from bench.reference.rabbitmq_cluster import SETUP_HINT
        from bench.reference.rabbitmq_cluster import unavailable_reason as rabbit_problem

        problem = rabbit_problem()
        return f"{problem}; {SETUP_HINT}" if problem else None
    if key == "nats":
        from bench.nats_cluster import SETUP_HINT as NATS_HINT
        from bench.nats_cluster import unavailable_reason as nats_problem

        problem = nats_problem()
        return f"{problem}; {NATS_HINT}" if problem else None
    return None


# --- one run: a producer and a consumer, maybe a kill ------------------------------------------------


@dataclass
class Outcome:
    producer: ProducerRecord
    consumer: ConsumerRecord
    killed: str = ""
    killed_at_ns: int | None = None
    leader_after: str = ""


def run_clients(
    system: System, name: str, cfg: ClientConfig, *, kill_after_s: float | None, say: Callable[[str], None]
) -> Outcome:
    """Start the consumer, then the producer, on the leader's node first; kill the leader `kill_after_s` after
    the producer's start if asked; collect both records."""
    index, leader = system.leader(name)
    cfg.addresses = system.addresses_from(index)
    results: Any = _CTX.Queue()
    ready, stop = _CTX.Event(), _CTX.Event()
    started = _CTX.Value("d", 0.0)
    expected = _CTX.Value("q", 0)
    consumer = _CTX.Process(
        target=client_process, args=(consumer_main, cfg, ready, stop, expected, results), name="consumer"
    )
    producer = _CTX.Process(target=client_process, args=(producer_main, cfg, started, results), name="producer")
    killed_at: float | None = None
    try:
        consumer.start()
        if not ready.wait(60):
            raise RuntimeError(f"the consumer did not attach to {name} within 60 s")
        producer.start()
        started_s = _await_start(started, producer, timeout=60)
        if kill_after_s is not None:
            time.sleep(max(0.0, started_s + kill_after_s - time.monotonic()))
            killed_at = system.kill(index)
            say(f"SIGKILLed {leader} (leader of {name}) {killed_at - started_s:.2f} s in")
        sending = cfg.seconds if cfg.messages is None else 600.0
        got = _collect(results, {"producer"}, sending + CONFIRM_GRACE_S + 120)
        record: ProducerRecord = got["producer"]
        expected.value = len(set(record.confirmed))
        stop.set()
        got.update(_collect(results, {"consumer"}, cfg.drain_s + cfg.idle_s + 60))
    finally:
        stop.set()
        _join([consumer, producer])
    outcome = Outcome(producer=got["producer"], consumer=got["consumer"])
    if killed_at is not None:
        outcome.killed = leader
        outcome.killed_at_ns = int(killed_at * NS)
        with contextlib.suppress(Exception):
            outcome.leader_after = system.leader(name)[1]
    return outcome


@dataclass
class ThroughputResult:
    confirmed_rate: float
    delivered_rate: float
    notes: str


@dataclass
class FailoverResult:
    figures: FailoverFigures
    notes: str


def _errors(outcome: Outcome) -> list[str]:
    return outcome.producer.errors + outcome.consumer.errors


def throughput_result(outcome: Outcome, cfg: ClientConfig) -> ThroughputResult:
    p, c = outcome.producer, outcome.consumer
    if cfg.messages is None:
        start, end = p.started_ns + int(WARMUP_S * NS), p.started_ns + int(cfg.seconds * NS)
        confirmed = rate(p.confirm_ns, start, end)
        delivered = rate(c.delivered_ns, start, end)
        window = f"{cfg.seconds - WARMUP_S:g} s after a {WARMUP_S:g} s warm-up"
    else:
        confirmed = rate(p.confirm_ns, p.started_ns, max(p.confirm_ns, default=p.started_ns) + 1)
        delivered = rate(c.delivered_ns, p.started_ns, max(c.delivered_ns, default=p.started_ns) + 1)
        window = f"{cfg.messages} messages from the first send to the last confirm / delivery"
    notes = [
        window,
        f"{len(p.confirmed)} confirmed, {len(c.delivered)} delivered",
        f"producer CPU {100 * p.cpu_s / p.wall_s:.0f}%" if p.wall_s else "",
        f"consumer CPU {100 * c.cpu_s / c.wall_s:.0f}%" if c.wall_s else "",
    ]
    errors = _errors(outcome)
    if errors:
        notes.append(f"{len(errors)} client errors, e.g. {errors[0]}")
    return ThroughputResult(confirmed, delivered, ", ".join(n for n in notes if n))


def failover_result(outcome: Outcome) -> FailoverResult:
    p, c = outcome.producer, outcome.consumer
    assert outcome.killed_at_ns is not None
    figures = failover_figures(p.confirm_ns, p.confirmed, c.delivered_ns, c.delivered, outcome.killed_at_ns, p.ended_ns)
    k0 = outcome.killed_at_ns - NS
    span = max(1, math.ceil((p.ended_ns - k0) / NS))
    notes = [
        f"killed {outcome.killed}, leader after: {outcome.leader_after or '?'}",
        f"confirms resumed {figures.confirms_resumed_s:.2f} s and deliveries {figures.deliveries_resumed_s:.2f} s "
        "after the kill (end of the longest gaps)",
        f"{p.published} sent, {figures.confirmed} confirmed, {figures.delivered} delivered, {p.resent} sent again, "
        f"{c.redelivered} redelivered",
        f"reconnects: producer {p.reconnects}, consumer {c.reconnects}",
        f"confirms per second from 1 s before the kill: {' '.join(map(str, per_second(p.confirm_ns, k0, span)))}",
        f"deliveries: {' '.join(map(str, per_second(c.delivered_ns, k0, span)))}",
    ]
    if c.dropped_by_client is not None:
        notes.append(f"{c.dropped_by_client} duplicate copies dropped by the SDK")
    notes.extend(p.notes)
    errors = _errors(outcome)
    if errors:
        notes.append(f"{len(errors)} client errors, e.g. {errors[0]}")
    return FailoverResult(figures, "; ".join(notes))


# --- the whole run ----------------------------------------------------------------------------------


@dataclass
class Settings:
    seconds: float = 10.0
    messages: int | None = None
    rate: float = 2000.0
    kill_after: float = 3.0
    after_kill: float = 8.0
    runs: int = 3
    workloads: tuple[str, ...] = WORKLOADS


@dataclass
class SystemResults:
    description: str = ""
    throughput: list[ThroughputResult] = field(default_factory=list)
    failover: list[FailoverResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def run_system_once(
    key: str, settings: Settings, repeat: int, results: SystemResults, say: Callable[[str], None]
) -> None:
    say(f"run {repeat}: starting the {LABELS[key]} cluster")
    with make_system(key) as system:
        results.description = system.describe()
        if "throughput" in settings.workloads:
            name = f"bench_streams_tp_{repeat}"
            cfg = ClientConfig(
                system=key, addresses=[], name=name, seconds=settings.seconds, messages=settings.messages
            )
            system.prepare(name, cfg)
            say(f"run {repeat}: throughput")
            outcome = run_clients(system, name, cfg, kill_after_s=None, say=say)
            tp = throughput_result(outcome, cfg)
            say(f"run {repeat}: confirmed {tp.confirmed_rate:,.0f}/s, delivered {tp.delivered_rate:,.0f}/s; {tp.notes}")
            results.throughput.append(tp)
            system.cleanup(name)
        if "failover" in settings.workloads:
            run_failover(system, key, settings, repeat, results, say)
    say(f"run {repeat}: {LABELS[key]} stopped")


def run_failover(
    system: System, key: str, settings: Settings, repeat: int, results: SystemResults, say: Callable[[str], None]
) -> None:
    name = f"bench_streams_fo_{repeat}"
    cfg = ClientConfig(
        system=key,
        addresses=[],
        name=name,
        rate=settings.rate,
        seconds=settings.kill_after + settings.after_kill,
    )
    system.prepare(name, cfg)
    say(f"run {repeat}: failover at {settings.rate:g} msgs/s")
    outcome = run_clients(system, name, cfg, kill_after_s=settings.kill_after, say=say)
    fo = failover_result(outcome)
    f = fo.figures
    say(
        f"run {repeat}: gap {f.gap_s:.2f} s (confirms {f.confirm_gap_s:.2f}, deliveries {f.delivery_gap_s:.2f}), "
        f"lost {f.lost}, order violations {f.order_violations}, duplicates {f.duplicates}; {fo.notes}"
    )
    results.failover.append(fo)


ROWS: list[tuple[str, str, Callable[[SystemResults], list[float | int | None]], str, bool]] = [
    ("throughput", "confirmed msgs/s", lambda r: [t.confirmed_rate for t in r.throughput], ",.0f", True),
    ("throughput", "delivered msgs/s", lambda r: [t.delivered_rate for t in r.throughput], ",.0f", True),
    ("failover", "gap s (confirms or deliveries)", lambda r: [f.figures.gap_s for f in r.failover], ".2f", True),
    ("failover", "longest confirm gap s", lambda r: [f.figures.confirm_gap_s for f in r.failover], ".2f", True),
    ("failover", "longest delivery gap s", lambda r: [f.figures.delivery_gap_s for f in r.failover], ".2f", True),
    ("failover", "lost", lambda r: [f.figures.lost for f in r.failover], ",.0f", False),
    ("failover", "order violations", lambda r: [f.figures.order_violations for f in r.failover], ",.0f", False),
    ("failover", "duplicates delivered", lambda r: [f.figures.duplicates for f in r.failover], ",.0f", False),
]


def table_rows(results: dict[str, SystemResults], systems: Sequence[str]) -> list[list[str]]:
    rows = []
    for workload, metric, values, fmt, with_ratio in ROWS:
        spreads: dict[str, Spread] = {k: spread(values(results[k])) for k in systems}
        cells = [workload, metric, *(spreads[k].text(fmt) for k in SYSTEMS if k in systems)]
        for other in ("rabbitmq", "nats"):
            if "ringq" not in systems or other not in systems:
                continue
            r = ratio(spreads["ringq"], spreads[other]) if with_ratio else None
            cells.append("-" if r is None else f"{r:.2f}x")
        rows.append(cells)
    return rows


def table_header(systems: Sequence[str]) -> tuple[list[str], list[bool]]:
    header = ["workload", "metric", *(LABELS[k] for k in SYSTEMS if k in systems)]
    header += [f"ringq / {LABELS[o]}" for o in ("rabbitmq", "nats") if "ringq" in systems and o in systems]
    return header, [False, False, *([True] * (len(header) - 2))]


@dataclass
class Run:
    command: str
    began: str
    seconds: float
    load: tuple[float, float, float]
    load_after: tuple[float, float, float]
    settings: Settings
    systems: list[str]
    results: dict[str, SystemResults]
    skipped: dict[str, str]


def method_text(run: Run) -> str:
    s = run.settings
    amount = f"{s.messages} messages" if s.messages is not None else f"{s.seconds:g} s"
    return (
        f"Each repeat starts each system's cluster afresh on 127.0.0.1, runs both workloads and stops it; the "
        f"systems take turns ({', '.join(LABELS[k] for k in run.systems)}), {s.runs} repeats, figures are "
        f"median (min-max). Producer and consumer are separate processes, connected first to the node that the "
        f"failover run kills (they fail over to the others). Throughput: one producer with publisher confirms, "
        f"at most {MAX_IN_FLIGHT} unconfirmed, 256-byte bodies, unthrottled for {amount}, and one consumer at "
        f"once reading in order, prefetch {PREFETCH}, one ack per message; rates count confirms and deliveries "
        f"arriving in the run after a {WARMUP_S:g} s warm-up. Failover: the same at {s.rate:g} msgs/s (scheduled "
        f"every 1 ms); {s.kill_after:g} s in, the leader is SIGKILLed (RabbitMQ: the quorum queue's leader node; "
        f"NATS: the stream leader's server; ringq: the master node of the stream's head send group), sending "
        f"goes on {s.after_kill:g} s, then the consumer reads until it holds every confirmed message (or 6 s "
        f"without a delivery, 30 s at most). Gap: the longest interval without a confirm, or without a "
        f"delivery, from 1 s before the kill to the end of sending (the larger of the two). Lost: confirmed, "
        f"never delivered. Order violations: first deliveries of a message numbered (by the producer) below one "
        f"delivered before it. Duplicates: deliveries of an already delivered message, as the application saw "
        f"them (after any dropping the client library does). Ratios are ringq's median over the other's; for a "
        f"gap, above 1 means ringq stalls longer."
    )


def section(run: Run) -> str:
    header, right = table_header(run.systems)
    rows = table_rows(run.results, run.systems)
    lines = [
        MARK_BEGIN,
        SECTION_TITLE,
        "",
        f"Command: `{run.command}`  ",
        f"Machine: {machine()}  ",
        f"Measured: {run.began} ({run.seconds:.0f} s in all; load average before the run "
        f"{_load(run.load)}, after it {_load(run.load_after)}; anything else running on the machine shares its "
        f"{os.cpu_count()} cores with the brokers and clients)",
        "",
        method_text(run),
        "",
        *(f"- {LABELS[k]}: {run.results[k].description}" for k in run.systems),
        *(f"- {LABELS[k]}: not run: {why}" for k, why in run.skipped.items()),
        "",
        markdown_table(header, rows, right),
        "",
        "Notes per run:",
        "",
        *notes_lines(run),
        MARK_END,
    ]
    return "\n".join(lines)


def notes_lines(run: Run) -> list[str]:
    out = []
    for k in run.systems:
        r = run.results[k]
        for i, t in enumerate(r.throughput, 1):
            out.append(f"- {LABELS[k]} throughput {i}: {t.notes}")
        for i, f in enumerate(r.failover, 1):
            out.append(f"- {LABELS[k]} failover {i}: {f.notes}")
        for failure in r.failures:
            out.append(f"- {LABELS[k]}: FAILED: {failure}")
    return out


def report_text(run: Run) -> str:
    header, right = table_header(run.systems)
    return "\n".join(
        [
            "",
            f"{machine()}; load average before the run {_load(run.load)}, after it {_load(run.load_after)}; "
            f"{run.seconds:.0f} s in all",
            *(f"{LABELS[k]}: {run.results[k].description}" for k in run.systems),
            *(f"{LABELS[k]}: not run: {why}" for k, why in run.skipped.items()),
            "",
            text_table(header, table_rows(run.results, run.systems), right),
            "",
            *notes_lines(run),
        ]
    )


def _load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_streams", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="repeats of every system's runs (default 3)")
    parser.add_argument("--seconds", type=float, default=10.0, help="throughput run: how long to send (default 10)")
    parser.add_argument("--messages", type=int, help="throughput run: send this many messages instead of --seconds")
    parser.add_argument("--rate", type=float, default=2000.0, help="failover run: msgs/s (default 2000)")
    parser.add_argument("--kill-after", type=float, default=3.0, help="failover run: seconds before the kill")
    parser.add_argument("--after-kill", type=float, default=8.0, help="failover run: seconds of sending after it")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of throughput,failover"
    )
    parser.add_argument("--write", type=Path, help="put the section into this Markdown file (docs/benchmarks.md)")
    parser.add_argument("--json", type=Path, help="also write every run's figures to this file as JSON")
    args = parser.parse_args(argv)
    wanted = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = set(wanted) - set(SYSTEMS)
    if unknown or not wanted:
        parser.error(f"--systems: choose from {','.join(SYSTEMS)}")
    if args.runs < 1 or args.seconds <= WARMUP_S or (args.messages is not None and args.messages < 1):
        parser.error("--runs >= 1, --seconds above the 1 s warm-up, --messages >= 1")
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    if not workloads or set(workloads) - set(WORKLOADS):
        parser.error(f"--workloads: choose from {','.join(WORKLOADS)}")
    settings = Settings(args.seconds, args.messages, args.rate, args.kill_after, args.after_kill, args.runs, workloads)
    skipped = {k: why for k in wanted if (why := unavailable_reason(k)) is not None}
    for k, why in skipped.items():
        print(f"[{k}] not run: {why}", file=sys.stderr)
    systems = [k for k in SYSTEMS if k in wanted and k not in skipped]
    if not systems:
        return 2
    stop = _StopOnSignal()
    load = os.getloadavg()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    started = time.monotonic()
    results = {k: SystemResults() for k in systems}
    try:
        for repeat in range(1, settings.runs + 1):
            for key in systems:
                if stop.signalled:
                    raise KeyboardInterrupt

                def say(message: str, key: str = key) -> None:
                    print(f"[{key}] {message}", file=sys.stderr, flush=True)

                try:
                    run_system_once(key, settings, repeat, results[key], say)
                except KeyboardInterrupt:
                    raise
                except Exception as error:
                    say(f"run {repeat} FAILED: {error!r}")
                    results[key].failures.append(f"run {repeat}: {error!r}"[:500])
    except KeyboardInterrupt:
        print("interrupted: every process this run started has been stopped", file=sys.stderr)
        return 130
    run = Run(
        command=command_line("bench.bench_streams", "bench-streams", argv),
        began=began,
        seconds=time.monotonic() - started,
        load=load,
        load_after=os.getloadavg(),
        settings=settings,
        systems=systems,
        results=results,
        skipped=skipped,
    )
    print(report_text(run))
    if args.json is not None:
        payload = {k: asdict(v) for k, v in results.items()}
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    failed = any(r.failures for r in results.values())
    if args.write is not None:
        replace_marked(args.write, MARK_BEGIN, MARK_END, section(run))
        print(f"wrote {args.write}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
