"""`make bench-scale`: how ringq's mirrored queues scale (ARCHITECTURE section 10, issue 13 item 5).

Responsible for the four scale measurements and their section "Scale (`make bench-scale`)" of
docs/benchmarks.md. Every cluster is bench/ringq_workloads.py's RingqCluster (nodes and a coordinator on
127.0.0.1, default node settings) and is started afresh for each part:

1. replicas: W1 (bench/ringq_workloads.py's producer and method: confirms with up to 1000 in flight, 256-byte
   transient bodies, nobody consuming) on a queue mirrored by a policy with ha-mode exactly and ha-params
   1 / 2 / 3 / 5: on a 3-node cluster for up to 3 replicas, on a 5-node cluster for 5.
2. queues: 1 / 100 / 1,000 queues mirrored on all 3 nodes, their masters spread over the nodes. With the
   queues declared and idle, the CPU of each node (percent of one core) over `--idle-seconds`, and the same
   with no queue at all; then the aggregate confirmed throughput with `--producers` producer processes, each
   publishing round-robin over its share of the queues (one Publish stream a queue, to the queue's master's
   node) with one window of 1000 unconfirmed messages for all its queues, requests of up to 100 messages
   going to its queues in turn (as an application publishing to many queues batches per queue).
3. bodies: 256 B / 64 KiB / 1 MiB bodies, one producer and one queue as in part 2: msgs/s and MB/s. A
   request carries at most 4 MiB of bodies and at most 64 MiB are unconfirmed (1 MiB bodies: 4 a request,
   64 in flight), as the nodes take gRPC messages of at most 64 MiB.
4. memory: `--messages` (1,000,000) transient 256-byte messages published into one queue with no consumer;
   the RSS of the master and of each mirror once settled before, when the queue is full, and after a
   consumer drained it: bytes per queued message ((full - before) / messages) and the share of the growth
   given back to the operating system after the drain.

The producer of parts 2-4 (`_SpreadProducer`) runs in spawned processes, which all start their windows when
this process says go, so the aggregate counts confirms in one common window after the warm-up.
"""

from __future__ import annotations

import ringq  # noqa: F401 (first, as a user's program would: the SDK chooses gRPC's I/O path before grpc loads)

# isort: split
import argparse
import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.synchronize
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.bench_gm import machine
from bench.bench_queues import _StopOnSignal, markdown_table, text_table
from bench.markdown import command_line, replace_marked
from bench.process_stats import MIB, cpu_percent, node_pids, settled_rss
from bench.reference.rabbitmq_workloads import (
    _CTX,
    HEADER,
    MAX_IN_FLIGHT,
    NS,
    PAYLOAD_SIZE,
    Durations,
    ProducerReport,
    _collect,
    _cpu_seconds,
    _join,
    broker_cores,
    client_process,
    run_producer,
    w1_result,
)
from bench.ringq_workloads import (
    MASTER_NODE,
    NODES,
    PLAINTEXT,
    POLICY,
    PUBLISH_BATCH,
    Access,
    ProducerConfig,
    RingqCluster,
    _producer_main,
    ringq_version,
    take_leftovers,
)
from ringq import aio
from ringq.v1 import queue_pb2
from services.node import CHECKS_PER_VERIFY_WHILE_WATCHING, NodeSettings

PARTS = ("replicas", "queues", "bodies", "memory")
REPLICAS = (1, 2, 3, 5)
QUEUE_COUNTS = (1, 100, 1000)
BODY_SIZES = (256, 64 * 1024, 1024 * 1024)
MESSAGES = 1_000_000
PRODUCERS = 3
WARMUP_S = 2.0
MEASURE_S = 10.0
IDLE_S = 20.0
# The goal's figure (1,000 idle queues) spans a whole period of the nodes' fallback listing of their groups
# (services/node.py: every CHECKS_PER_VERIFY_WHILE_WATCHING failure timeouts while the group watch is up), so
# that what an idle node does only every two minutes is in it too.
IDLE_GOAL_S = CHECKS_PER_VERIFY_WHILE_WATCHING * NodeSettings().failure_timeout + 10.0
SETTLE_S = 5.0  # after declaring queues, before the idle CPU is measured
MAX_REQUEST_BYTES = 4 * MIB
MAX_IN_FLIGHT_BYTES = 64 * MIB
DECLARE_CONCURRENCY = 32
SYNC_TIMEOUT_S = 120.0
# Issue 13's goals.
IDLE_GOAL_PERCENT = 2.0  # of a core per node, with IDLE_GOAL_QUEUES idle queues
IDLE_GOAL_QUEUES = 1000
BYTES_PER_MESSAGE_GOAL = 512
RETURNED_GOAL = 0.9  # the share of the growth given back after the drain that counts as "returned"
MARK_BEGIN = "<!-- bench-scale:begin -->"
MARK_END = "<!-- bench-scale:end -->"
SECTION_TITLE = "## Scale (`make bench-scale`)"
_CONFIRMED = (queue_pb2.PUBLISH_OUTCOME_CONFIRMED, queue_pb2.PUBLISH_OUTCOME_DUPLICATE)


# --- the pure parts: how the spread producer sizes its requests, and the memory figures -----------------


def deal(items: Sequence[str], hands: int) -> list[list[str]]:
    """`items` dealt round-robin into at most `hands` non-empty lists (item i to hand i % hands)."""
    hands = max(1, min(hands, len(items)))
    return [list(items[h::hands]) for h in range(hands)]


@dataclass(frozen=True)
class Window:
    """How a producer process publishes: unconfirmed messages at most (over all its queues), per request at most."""

    total: int
    batch: int


def window(queues: int, body_size: int, max_in_flight: int = MAX_IN_FLIGHT) -> Window:
    """A process's window (`max_in_flight` messages, at most MAX_IN_FLIGHT_BYTES of bodies) for all its
    `queues` together; requests of at most PUBLISH_BATCH messages and MAX_REQUEST_BYTES of bodies (one
    message at least), to the queues in turn. (Sharing the window evenly instead left 2 messages per
    request with 1,000 queues: the brokers then measured their per-request cost, not their throughput.)"""
    if queues < 1 or body_size < HEADER.size:
        raise ValueError(f"need a queue and bodies of at least {HEADER.size} bytes")
    total = min(max_in_flight, max(1, MAX_IN_FLIGHT_BYTES // body_size))
    batch = max(1, min(PUBLISH_BATCH, total, MAX_REQUEST_BYTES // body_size))
    return Window(total, batch)


@dataclass
class NodeMemory:
    """One node's RSS around a full queue: before publishing, full, and after the drain (bytes)."""

    node: str
    role: str  # "master" or "mirror"
    before: int
    full: int
    after: int

    def per_message(self, messages: int) -> float:
        return (self.full - self.before) / messages if messages else 0.0

    @property
    def returned(self) -> float | None:
        """The share of the growth given back after the drain (None if it did not grow)."""
        grown = self.full - self.before
        return (self.full - self.after) / grown if grown > 0 else None


def memory_goal(nodes: Sequence[NodeMemory], messages: int) -> tuple[bool, str]:
    """Issue 13: under BYTES_PER_MESSAGE_GOAL bytes a queued message on every node, and the growth returned."""
    if not nodes or not messages:
        return False, "not measured"
    worst = max(nodes, key=lambda n: n.per_message(messages))
    kept = [n for n in nodes if (n.returned or 0.0) < RETURNED_GOAL]
    per_message_ok = worst.per_message(messages) < BYTES_PER_MESSAGE_GOAL
    text = f"at most {worst.per_message(messages):,.0f} bytes a message ({worst.node})"
    if kept:
        text += "; kept after the drain: " + ", ".join(f"{n.node} {_share(n.returned)} returned" for n in kept)
    else:
        text += f"; every node gave back at least {RETURNED_GOAL:.0%} of the growth".replace("%", " %")
    return per_message_ok and not kept, text


def idle_goal(idle: Mapping[int, Mapping[str, float]]) -> tuple[bool | None, str]:
    """Issue 13: with 1,000 idle queues, under IDLE_GOAL_PERCENT of a core on every node."""
    with_most = max(idle, default=0)
    if with_most < IDLE_GOAL_QUEUES:
        return None, f"not measured with {IDLE_GOAL_QUEUES:,} queues"
    worst_node, worst = max(idle[with_most].items(), key=lambda kv: kv[1])
    return worst < IDLE_GOAL_PERCENT, f"{worst:.1f} % of a core at the most ({worst_node}, {with_most:,} queues)"


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f} %"


# --- declaring many queues ----------------------------------------------------------------------------


async def _declare_all(
    rc: RingqCluster, placement: Sequence[tuple[str, str]], mirrors: int, timeout: float
) -> dict[str, str]:
    """Declare each (queue, node) durable through that node; wait until each has `mirrors` synchronised
    mirrors and runs. Returns each queue's master's node."""
    nodes = sorted({node for _, node in placement})
    connections = {node: rc.access.connection([rc.address(node)], retry_for=30.0) for node in nodes}
    gate = asyncio.Semaphore(DECLARE_CONCURRENCY)
    deadline = time.monotonic() + timeout

    async def one(queue: str, node: str) -> tuple[str, str]:
        async with gate:
            await connections[node].declare_queue(queue, durable=True)
        while True:
            async with gate:
                status = await connections[node].queue_status(queue)
            if len(status.synchronised_mirrors) >= mirrors and status.status == "running":
                return queue, str(status.master_node)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{queue}: mirrors {list(status.mirrors)}, synchronised {list(status.synchronised_mirrors)}, "
                    f"status {status.status!r} after {timeout:g} s"
                )
            await asyncio.sleep(0.2)

    try:
        return dict(await asyncio.gather(*(one(q, n) for q, n in placement)))
    finally:
        for connection in connections.values():
            await connection.close()


def declare_queues(
    rc: RingqCluster, placement: Sequence[tuple[str, str]], mirrors: int, timeout: float = SYNC_TIMEOUT_S
) -> dict[str, str]:
    return asyncio.run(_declare_all(rc, placement, mirrors, timeout))


def delete_queues(rc: RingqCluster, queues: Sequence[str]) -> None:
    async def delete() -> None:
        connection = rc.access.connection(rc.live_addresses(), retry_for=10.0)
        gate = asyncio.Semaphore(DECLARE_CONCURRENCY)

        async def one(queue: str) -> None:
            async with gate:
                await connection.delete_queue(queue)

        try:
            await asyncio.gather(*(one(q) for q in queues), return_exceptions=True)
        finally:
            await connection.close()

    asyncio.run(delete())


def set_policy(rc: RingqCluster, name: str, pattern: str, definition: Mapping[str, Any]) -> None:
    async def configure() -> None:
        info = rc.info
        assert info is not None
        access = rc.access
        async with aio.Admin(info.node_addresses, tls=access.tls, credentials=access.credentials, timeout=10) as admin:
            await admin.set_policy(name, pattern, definition, priority=1)

    asyncio.run(configure())


# --- the spread producer (runs in its own process) ----------------------------------------------------


@dataclass
class SpreadConfig:
    targets: list[tuple[str, str]]  # (queue, the address of its master's node)
    warmup_s: float
    measure_s: float
    body_size: int = PAYLOAD_SIZE
    max_in_flight: int = MAX_IN_FLIGHT  # the process's, over all its queues
    count: int | None = None  # publish exactly this many, then wait for their confirms (the window ends early)
    confirm_grace_s: float = 3.0
    access: Access = PLAINTEXT
    go: Any = None  # a multiprocessing Event: the windows of every producer process start when it is set
    ready: Any = None  # a multiprocessing Semaphore released once this process's streams are open


@dataclass
class SpreadReport(ProducerReport):
    requests: int = 0


class _Lane:
    """One queue's Publish stream."""

    def __init__(self, queue: str, call: Any, ref: queue_pb2.QueueRef) -> None:
        self.queue = queue
        self.call = call
        self.ref = ref
        self.publisher = f"scale-{os.getpid()}-{queue}"
        self.next_seq = 1
        self.in_flight = 0
        self.alive = True


class _SpreadProducer:
    def __init__(self, cfg: SpreadConfig, started: Any) -> None:
        self.cfg = cfg
        self.started = started
        self.report = SpreadReport()
        self.window = window(len(cfg.targets), cfg.body_size, cfg.max_in_flight)
        self.padding = b"\x00" * (cfg.body_size - HEADER.size)
        self.space = asyncio.Event()
        self.body_seq = 0
        self.in_flight = 0  # over every lane

    async def run(self) -> SpreadReport:
        wall0, cpu0 = time.monotonic(), _cpu_seconds()
        addresses = sorted({address for _, address in self.cfg.targets})
        connections = {a: self.cfg.access.connection([a]) for a in addresses}
        lanes: list[_Lane] = []
        readers: list[asyncio.Future[None]] = []
        try:
            for queue, address in self.cfg.targets:
                connection = connections[address]
                await connection.reach()
                lanes.append(_Lane(queue, connection.stub().Publish(), connection.ref(queue)))
            readers = [asyncio.ensure_future(self._read(lane)) for lane in lanes]
            self.cfg.ready.release()
            while not self.cfg.go.wait(0):
                await asyncio.sleep(0.005)
            self.report.start_window(time.monotonic_ns(), self.cfg.warmup_s, self.cfg.measure_s, self.started)
            await self._write(lanes)
            await self._await_confirms(lanes)
        finally:
            for lane in lanes:
                lane.call.cancel()
            for reader in readers:
                reader.cancel()
            for connection in connections.values():
                await connection.close()
        self.report.sequence_numbers = self.body_seq
        self.report.cpu_s = _cpu_seconds() - cpu0
        self.report.wall_s = time.monotonic() - wall0
        return self.report

    def _more(self) -> bool:
        if self.cfg.count is not None and self.body_seq >= self.cfg.count:
            return False
        return time.monotonic_ns() < self.report.window_end_ns

    async def _write(self, lanes: list[_Lane]) -> None:
        total, batch = self.window.total, self.window.batch
        while self._more():
            sent = False
            for lane in lanes:
                room = total - self.in_flight
                if lane.alive and room > 0 and self._more():
                    count = min(batch, room)
                    if self.cfg.count is not None:
                        count = min(count, self.cfg.count - self.body_seq)
                    await self._send(lane, count)
                    sent = True
            if not sent:
                self.space.clear()
                remaining = (self.report.window_end_ns - time.monotonic_ns()) / NS
                try:
                    await asyncio.wait_for(self.space.wait(), max(0.001, remaining))
                except TimeoutError:
                    break

    async def _send(self, lane: _Lane, count: int) -> None:
        now = time.monotonic_ns()
        messages = []
        for _ in range(count):
            body = HEADER.pack(self.body_seq, now) + self.padding
            messages.append(queue_pb2.OutgoingMessage(body=body, seq=lane.next_seq))
            self.body_seq += 1
            lane.next_seq += 1
        lane.in_flight += count
        self.in_flight += count
        self.report.published += count
        self.report.requests += 1
        try:
            await lane.call.write(queue_pb2.PublishRequest(queue=lane.ref, publisher=lane.publisher, messages=messages))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
            self._lost(lane, error)

    async def _read(self, lane: _Lane) -> None:
        try:
            while True:
                response = await lane.call.read()
                if response is grpc.aio.EOF:  # type: ignore[attr-defined]
                    self._lost(lane, "the publish stream ended")
                    return
                confirmed = sum(1 for outcome in response.outcomes if outcome in _CONFIRMED)
                self.report.nacked += len(response.outcomes) - confirmed
                lane.in_flight -= len(response.seqs)
                self.in_flight -= len(response.seqs)
                self.report.count_confirms(confirmed, time.monotonic_ns())
                self.space.set()
        except grpc.aio.AioRpcError as error:
            self._lost(lane, error)

    def _lost(self, lane: _Lane, error: object) -> None:
        if lane.alive:
            lane.alive = False
            text = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else error
            self.report.errors.append(f"{lane.queue}: {text}"[:200])
        self.space.set()

    async def _await_confirms(self, lanes: list[_Lane]) -> None:
        grace = self.cfg.confirm_grace_s if self.cfg.count is None else 120.0
        deadline = time.monotonic() + grace
        while any(lane.alive and lane.in_flight for lane in lanes) and time.monotonic() < deadline:
            self.space.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.space.wait(), max(0.001, deadline - time.monotonic()))


def _spread_main(cfg: SpreadConfig, started: Any, results: multiprocessing.Queue[Any]) -> None:
    try:
        report = asyncio.run(_SpreadProducer(cfg, started).run())
    except BaseException as exc:
        report = SpreadReport(errors=[f"producer crashed: {exc!r}"])
    results.put((f"producer-{os.getpid()}", report))


# --- running the spread producers (this process) ----------------------------------------------------


@dataclass
class SpreadRun:
    reports: list[SpreadReport]
    cores: float  # the nodes' and the coordinator's, over the window
    measure_s: float

    @property
    def rate(self) -> float:
        return sum(r.confirmed_in_window for r in self.reports) / self.measure_s

    @property
    def confirmed(self) -> int:
        return sum(r.confirmed for r in self.reports)

    @property
    def errors(self) -> list[str]:
        return [e for r in self.reports for e in r.errors]

    @property
    def producers_cpu(self) -> float:
        return sum(r.cpu_s for r in self.reports) / max(r.wall_s for r in self.reports) if self.reports else 0.0


def run_spread(
    rc: RingqCluster,
    masters: Mapping[str, str],
    producers: int,
    durations: Durations,
    *,
    body_size: int = PAYLOAD_SIZE,
    count: int | None = None,
) -> SpreadRun:
    """`producers` processes publishing round-robin over the queues of `masters` (queue -> master's node), each
    to its queue's master's node; their windows start together. With `count` one process publishes that many."""
    hands = deal(sorted(masters), 1 if count is not None else producers)
    results: multiprocessing.Queue[Any] = _CTX.Queue()
    go, ready = _CTX.Event(), _CTX.Semaphore(0)
    processes = []
    starts = []  # kept here: a Process forgets its arguments once started, and each child needs its Value
    for i, hand in enumerate(hands):
        cfg = SpreadConfig(
            [(q, rc.address(masters[q])) for q in hand],
            durations.warmup_s,
            durations.measure_s,
            body_size=body_size,
            count=count,
            access=rc.access,
            go=go,
            ready=ready,
        )
        starts.append(_CTX.Value("d", 0.0))
        processes.append(
            _CTX.Process(target=client_process, args=(_spread_main, cfg, starts[-1], results), name=f"producer-{i}")
        )
    try:
        for process in processes:
            process.start()
        for process in processes:
            if not ready.acquire(timeout=120):
                raise RuntimeError(f"{process.name}: its publish streams did not open within 120 s")
        go.set()
        at = time.monotonic() + durations.warmup_s
        cores = 0.0 if count is not None else broker_cores(rc.cpu_seconds, at, at + durations.measure_s)
        timeout = durations.warmup_s + durations.measure_s + 180
        got = _collect(results, {f"producer-{p.pid}" for p in processes}, timeout)
    finally:
        _join(processes)
    return SpreadRun([got[f"producer-{p.pid}"] for p in processes], cores, durations.measure_s)


# --- the parts ----------------------------------------------------------------------------------------


@dataclass
class ReplicasRow:
    replicas: int
    cluster_nodes: int
    rate: float
    cores: float | None
    notes: str


@dataclass
class QueuesRow:
    queues: int
    producers: int
    in_flight: int  # a producer process's window, over all its queues
    batch: int
    rate: float
    cores: float
    producers_cpu: float
    errors: list[str] = field(default_factory=list)


@dataclass
class BodyRow:
    body_size: int
    rate: float
    cores: float
    in_flight: int  # a producer process's window, over all its queues
    batch: int
    errors: list[str] = field(default_factory=list)

    @property
    def megabytes(self) -> float:
        return self.rate * self.body_size / 1e6


@dataclass
class MemoryPart:
    messages: int
    confirmed: int
    depth: int | None
    drained: int | None
    nodes: list[NodeMemory] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class ScaleRun:
    command: str
    began: str
    version: str
    commit: str
    durations: Durations
    idle_s: float
    idle_goal_s: float  # the window of the idle figure with IDLE_GOAL_QUEUES queues or more
    producers: int
    replicas: list[ReplicasRow] = field(default_factory=list)
    idle: dict[int, dict[str, float]] = field(default_factory=dict)  # queues declared -> node -> % of a core
    queues: list[QueuesRow] = field(default_factory=list)
    bodies: list[BodyRow] = field(default_factory=list)
    memory: MemoryPart | None = None
    seconds: float = 0.0


Say = Callable[[str], None]


def run_replicas(run: ScaleRun, replicas: Sequence[int], say: Say) -> None:
    """W1 on a queue with `ha-mode exactly` N, N in `replicas`: a 3-node cluster up to 3, else N nodes."""
    by_size: dict[int, list[int]] = {}
    for n in replicas:
        by_size.setdefault(max(NODES, n), []).append(n)
    for size, counts in sorted(by_size.items()):
        say(f"replicas {counts}: a {size}-node cluster")
        with RingqCluster(size) as rc:
            for n in counts:
                queue = f"scale.r{n}"
                definition = {"ha-mode": "exactly", "ha-params": n, "ha-sync-mode": "automatic"}
                set_policy(rc, f"scale-r{n}", rf"^scale\.r{n}$", definition)
                declare_queues(rc, [(queue, MASTER_NODE)], n - 1)
                cfg = ProducerConfig(
                    rc.addresses_from(MASTER_NODE),
                    queue,
                    run.durations.warmup_s,
                    run.durations.measure_s,
                    access=rc.access,
                )
                try:
                    report, cores = run_producer(_producer_main, cfg, rc.cpu_seconds, run.durations)
                finally:
                    delete_queues(rc, [queue])
                result = w1_result(report, run.durations, cores)
                run.replicas.append(ReplicasRow(n, size, result.rate or 0.0, result.broker_cores, result.notes))
                say(f"replicas {n}: {run.replicas[-1].rate:,.0f} confirmed msgs/s")


def _idle(rc: RingqCluster, seconds: float) -> dict[str, float]:
    pids = node_pids(rc.info)
    by_pid = cpu_percent(list(pids.values()), seconds)
    return {name: by_pid.get(pid, 0.0) for name, pid in pids.items()}


def run_queues(run: ScaleRun, counts: Sequence[int], say: Say) -> None:
    """Idle CPU with no queue and with each count declared, then the spread throughput over that many queues."""
    with RingqCluster(NODES) as rc:
        time.sleep(SETTLE_S)
        run.idle[0] = _idle(rc, run.idle_s)
        say(f"idle, no queue: {_idle_text(run.idle[0])}")
        nodes = rc.node_names
        for n in counts:
            names = [f"ha.scale.q{n}.{i}" for i in range(n)]
            say(f"declaring {n} queues")
            masters = declare_queues(rc, [(q, nodes[i % len(nodes)]) for i, q in enumerate(names)], len(nodes) - 1)
            try:
                time.sleep(SETTLE_S)
                run.idle[n] = _idle(rc, run.idle_goal_s if n >= IDLE_GOAL_QUEUES else run.idle_s)
                say(f"idle, {n} queues: {_idle_text(run.idle[n])}")
                spread = run_spread(rc, masters, run.producers, run.durations)
            finally:
                delete_queues(rc, names)
            shape = window(len(deal(names, run.producers)[0]), PAYLOAD_SIZE)
            run.queues.append(
                QueuesRow(
                    n,
                    len(spread.reports),
                    shape.total,
                    shape.batch,
                    spread.rate,
                    spread.cores,
                    spread.producers_cpu,
                    spread.errors[:3],
                )
            )
            say(f"{n} queues: {spread.rate:,.0f} confirmed msgs/s")


def run_bodies(run: ScaleRun, sizes: Sequence[int], say: Say) -> None:
    with RingqCluster(NODES) as rc:
        for size in sizes:
            queue = f"ha.scale.body{size}"
            masters = declare_queues(rc, [(queue, MASTER_NODE)], NODES - 1)
            try:
                spread = run_spread(rc, masters, 1, run.durations, body_size=size)
            finally:
                delete_queues(rc, [queue])
            shape = window(1, size)
            run.bodies.append(BodyRow(size, spread.rate, spread.cores, shape.total, shape.batch, spread.errors[:3]))
            say(f"{size}-byte bodies: {spread.rate:,.0f} msgs/s, {run.bodies[-1].megabytes:,.1f} MB/s")


def run_memory(run: ScaleRun, messages: int, say: Say) -> None:
    with RingqCluster(NODES) as rc:
        queue = "ha.scale.memory"
        masters = declare_queues(rc, [(queue, MASTER_NODE)], NODES - 1)
        pids = node_pids(rc.info)
        before = settled_rss(list(pids.values()), quiet_s=SETTLE_S)
        say(f"publishing {messages:,} messages")
        spread = run_spread(rc, masters, 1, Durations(warmup_s=0.0, measure_s=3600.0), count=messages)
        full = settled_rss(list(pids.values()), quiet_s=SETTLE_S)
        depth = _depth(rc, queue)
        say(f"draining {depth} messages")
        drained = take_leftovers(rc, queue, idle_s=2.0, limit_s=1800.0)
        after = settled_rss(list(pids.values()), quiet_s=SETTLE_S, timeout_s=120.0)
        delete_queues(rc, [queue])
    run.memory = MemoryPart(
        messages,
        spread.confirmed,
        depth,
        None if drained is None else len(drained),
        [
            NodeMemory(name, "master" if name == masters[queue] else "mirror", before[pid], full[pid], after[pid])
            for name, pid in pids.items()
            if pid in before and pid in full and pid in after
        ],
        spread.errors[:3],
    )


def _depth(rc: RingqCluster, queue: str) -> int | None:
    async def status() -> int:
        connection = rc.access.connection(rc.live_addresses())
        try:
            return (await connection.queue_status(queue)).depth
        finally:
            await connection.close()

    try:
        return asyncio.run(status())
    except Exception:
        return None


# --- the report -----------------------------------------------------------------------------------------


def _idle_text(by_node: Mapping[str, float]) -> str:
    return ", ".join(f"{node} {value:.1f} %" for node, value in by_node.items())


def _size(size: int) -> str:
    if size % MIB == 0:
        return f"{size // MIB} MiB"
    if size % 1024 == 0:
        return f"{size // 1024} KiB"
    return f"{size} B"


def _errors(errors: Sequence[str]) -> str:
    return "; ".join(errors) if errors else ""


def tables(run: ScaleRun) -> list[tuple[str, Sequence[str], list[list[str]], Sequence[bool]]]:
    """(title, header, rows, right-aligned) of each table the run has figures for."""
    out: list[tuple[str, Sequence[str], list[list[str]], Sequence[bool]]] = []
    if run.replicas:
        rows = [
            [str(r.replicas), str(r.cluster_nodes), f"{r.rate:,.0f}", "-" if r.cores is None else f"{r.cores:.2f}"]
            for r in run.replicas
        ]
        out.append(
            (
                "W1 by replicas (policy ha-mode exactly, ha-params N)",
                ("replicas", "cluster nodes", "confirmed msgs/s", "brokers cores"),
                rows,
                (True, True, True, True),
            )
        )
    if run.idle:
        nodes = list(next(iter(run.idle.values())))
        rows = [[f"{n:,}", *(f"{run.idle[n].get(node, 0.0):.1f}" for node in nodes)] for n in sorted(run.idle)]
        out.append(
            (
                f"Idle CPU, percent of one core over {run.idle_s:g} s ({IDLE_GOAL_QUEUES:,} queues and more: over "
                f"{run.idle_goal_s:g} s)",
                ("idle queues", *(f"{node} %" for node in nodes)),
                rows,
                (True,) * (len(nodes) + 1),
            )
        )
    if run.queues:
        rows = [
            [
                f"{r.queues:,}",
                str(r.producers),
                str(r.in_flight),
                str(r.batch),
                f"{r.rate:,.0f}",
                f"{r.cores:.2f}",
                f"{r.producers_cpu:.2f}",
                _errors(r.errors),
            ]
            for r in run.queues
        ]
        out.append(
            (
                "Aggregate confirmed throughput over many queues",
                (
                    "queues",
                    "producer processes",
                    "in flight a producer",
                    "messages a request",
                    "confirmed msgs/s",
                    "brokers cores",
                    "producers cores",
                    "errors",
                ),
                rows,
                (True, True, True, True, True, True, True, False),
            )
        )
    if run.bodies:
        rows = [
            [
                _size(b.body_size),
                str(b.in_flight),
                str(b.batch),
                f"{b.rate:,.0f}",
                f"{b.megabytes:,.1f}",
                f"{b.cores:.2f}",
                _errors(b.errors),
            ]
            for b in run.bodies
        ]
        out.append(
            (
                "W1 by body size",
                ("body", "in flight", "messages a request", "confirmed msgs/s", "MB/s", "brokers cores", "errors"),
                rows,
                (True, True, True, True, True, True, False),
            )
        )
    memory = run.memory
    if memory is not None:
        rows = [
            [
                f"{n.node} ({n.role})",
                f"{n.before / MIB:,.1f}",
                f"{n.full / MIB:,.1f}",
                f"{n.after / MIB:,.1f}",
                f"{n.per_message(memory.messages):,.0f}",
                _share(n.returned),
            ]
            for n in memory.nodes
        ]
        out.append(
            (
                f"Memory with {memory.messages:,} queued 256-byte messages",
                ("node", "RSS before MiB", "full MiB", "after the drain MiB", "bytes a message", "growth returned"),
                rows,
                (False, True, True, True, True, True),
            )
        )
    return out


def goal_rows(run: ScaleRun) -> list[list[str]]:
    rows = []
    met, text = idle_goal(run.idle)
    rows.append([f"idle CPU with 1,000 idle queues < {IDLE_GOAL_PERCENT:g} % of a core per node", text, _verdict(met)])
    if run.memory is not None:
        met, text = memory_goal(run.memory.nodes, run.memory.messages)
    else:
        met, text = None, "not measured"
    rows.append(
        [
            f"memory per queued 256-byte message < {BYTES_PER_MESSAGE_GOAL} bytes, returned after the drain",
            text,
            _verdict(met),
        ]
    )
    return rows


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "missed")


def notes(run: ScaleRun) -> list[str]:
    lines = [f"- replicas {r.replicas}: {r.notes}" for r in run.replicas]
    memory = run.memory
    if memory is not None:
        lines.append(
            f"- memory: {memory.confirmed:,} of {memory.messages:,} confirmed, depth when full {_count(memory.depth)}, "
            f"{_count(memory.drained)} drained by the consumer"
            + (f"; errors: {_errors(memory.errors)}" if memory.errors else "")
        )
    return lines


def setup_text(run: ScaleRun) -> str:
    d = run.durations
    return (
        f"Clusters of nodes and a coordinator on 127.0.0.1 with default node settings, started afresh for each "
        f"part; queues durable, mirrored on all nodes ({json.dumps(POLICY)}) unless the policy says otherwise; "
        f"256-byte transient bodies unless said; throughput counts confirms in {d.measure_s:g} s after "
        f"{d.warmup_s:g} s of warm-up, nobody consuming. Replicas: bench/ringq_workloads.py's W1 (one producer, "
        f"{MAX_IN_FLIGHT} unconfirmed at most, {PUBLISH_BATCH} a request), master on node1. Queues: masters spread "
        f"over the nodes; {run.producers} producer processes (fewer if fewer queues), queues dealt round-robin, "
        f"each process publishing round-robin over its queues (one Publish stream a queue, to its master's node) "
        f"in requests of up to {PUBLISH_BATCH} messages, with {MAX_IN_FLIGHT} unconfirmed at most over all its "
        f"queues; idle CPU of each node process "
        f"over {run.idle_s:g} s ({IDLE_GOAL_QUEUES:,} queues and more: {run.idle_goal_s:g} s, a whole period of the "
        f"nodes' fallback listing of their groups), {SETTLE_S:g} s after the queues were declared and "
        f"synchronised. Bodies: the same "
        f"producer with one queue; a request holds at most {MAX_REQUEST_BYTES // MIB} MiB of bodies and at most "
        f"{MAX_IN_FLIGHT_BYTES // MIB} MiB are unconfirmed. Brokers cores: the CPU of the nodes and the "
        f"coordinator over the measured window. Memory: VmRSS of each node's process once it moved "
        f"less than 1 % over {SETTLE_S:g} s; drained by one consumer (prefetch 1000, an ack with multiple every "
        "500 messages)."
    )


def report_text(run: ScaleRun) -> str:
    lines = [f"ringq {run.version} ({run.commit}); {machine()}; {run.began}; {run.seconds:.0f} s", setup_text(run)]
    for title, header, rows, right in tables(run):
        lines += ["", title, text_table(header, rows, right)]
    lines += ["", text_table(("goal (issue 13)", "measured", "verdict"), goal_rows(run), (False, False, False))]
    lines += ["", *notes(run)]
    return "\n".join(lines)


def section(run: ScaleRun) -> str:
    lines = [
        MARK_BEGIN,
        SECTION_TITLE,
        "",
        f"Command: `{run.command}`  ",
        f"Machine: {machine()}  ",
        f"ringq {run.version} ({run.commit})  ",
        f"Measured: {run.began} ({run.seconds:.0f} s in all)",
        "",
        setup_text(run),
    ]
    for title, header, rows, right in tables(run):
        lines += ["", f"{title}:", "", markdown_table(header, rows, right)]
    lines += [
        "",
        markdown_table(("goal (issue 13)", "measured", "verdict"), goal_rows(run), (False, False, False)),
        "",
        *notes(run),
        MARK_END,
    ]
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--replicas", default=",".join(map(str, REPLICAS)), help="replica counts of W1")
    parser.add_argument("--queues", default=",".join(map(str, QUEUE_COUNTS)), help="queue counts")
    parser.add_argument("--bodies", default=",".join(map(str, BODY_SIZES)), help="body sizes in bytes")
    parser.add_argument("--messages", type=int, default=MESSAGES, help="messages queued by the memory part")
    parser.add_argument("--producers", type=int, default=PRODUCERS, help="producer processes of the queues part")
    parser.add_argument("--seconds", type=float, default=MEASURE_S, help="measured seconds of each throughput run")
    parser.add_argument("--warmup", type=float, default=WARMUP_S, help="warm-up seconds of each throughput run")
    parser.add_argument("--idle-seconds", type=float, default=IDLE_S, help="the window of each idle CPU figure")
    parser.add_argument(
        "--idle-goal-seconds",
        type=float,
        default=IDLE_GOAL_S,
        help=f"the window of the idle CPU figure with {IDLE_GOAL_QUEUES:,} queues or more",
    )
    parser.add_argument("--write", type=Path, help="put the section into this Markdown file (docs/benchmarks.md)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file as JSON")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    if args.producers < 1 or args.messages < 1:
        parser.error("--producers and --messages must be at least 1")
    say: Say = lambda message: print(f"[scale] {message}", file=sys.stderr, flush=True)  # noqa: E731
    version, commit = ringq_version()
    run = ScaleRun(
        command_line("bench.bench_scale", "bench-scale", argv),
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        version,
        commit,
        Durations(warmup_s=args.warmup, measure_s=args.seconds),
        args.idle_seconds,
        args.idle_goal_seconds,
        args.producers,
    )
    started = time.monotonic()
    steps: dict[str, Callable[[], None]] = {
        "replicas": lambda: run_replicas(run, _ints(args.replicas), say),
        "queues": lambda: run_queues(run, _ints(args.queues), say),
        "bodies": lambda: run_bodies(run, _ints(args.bodies), say),
        "memory": lambda: run_memory(run, args.messages, say),
    }
    _StopOnSignal()  # Ctrl-C and SIGTERM unwind through the clusters, which stop every process they started
    try:
        for part in PARTS:
            if part in parts:
                steps[part]()
    except KeyboardInterrupt:
        print("interrupted: every process this run started has been stopped", file=sys.stderr)
        return 130
    run.seconds = time.monotonic() - started
    print(report_text(run))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(run), indent=2, default=str) + "\n")
    if args.write is not None:
        replace_marked(args.write, MARK_BEGIN, MARK_END, section(run))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
