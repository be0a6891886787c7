"""The workloads of ARCHITECTURE section 10 against ringq: the same method as the RabbitMQ reference.

Everything that defines the method is the reference's (bench/reference/rabbitmq_workloads.py) and
is imported from it, not copied: the result record (`WorkloadResult`), the durations, the body
layout (256 bytes: sequence number, send timestamp, padding), the in-flight bound (1000), the
prefetch (1000), the fixed rate and its 1 ms pacing tick, the producer's window and pacing
(`AsyncWindowProducer`), the producer and consumer report records and how they are filled, how
latencies, percentiles and the W1-W3 figures are computed (`w1_result`, `w2_result`, `_w3_result`),
the process plumbing (`run_producer`, `run_pair`: spawn context, result collection, the brokers'
CPU over the window) and the acknowledgement policy of each workload (bench/ack_batching.py). Only
the clients and the cluster differ:

- Cluster: `services.cluster.up(3, ...)` on 127.0.0.1 with default node settings (only the log
  level set, `NODE_ARGS`), one coordinator; the policy `ha` (`^ha\\.`, ha-mode all, ha-sync-mode
  automatic) is set through the coordinator. Each node is bound to one CPU, round-robin over the CPUs
  (`RingqCluster.bind_nodes`, as `taskset` would), as docs/configuration.md recommends deploying nodes;
  "W2 at the fixed rate, nodes unbound" and W3 run with the nodes unbound, their default placement. A
  queue is declared (durable) through node1, so its master is on node1, and every workload waits until
  both mirrors are synchronised before it starts.
- Client: the Python ringq SDK's asyncio API (clients/python/ringq/aio.py, `ringq.aio.Connection`)
  over gRPC asyncio, producer and consumer in two separate processes (multiprocessing "spawn"), both
  connected to the master's node first and failing over to the next node in order.
- Producer: one Publish stream, messages numbered for an idempotent publisher id (as
  `ringq.aio.Producer` does), at most 1000 unconfirmed messages in flight, sent in requests of at
  most 100 messages (`Producer`'s default batch); when paced, each 1 ms tick sends what has fallen
  due in one request. Messages are transient (`persistent` false). A message counts when its
  confirm (outcome CONFIRMED, or DUPLICATE for a resend the queue already held) arrives. When the
  stream breaks, every unconfirmed message is sent again on a new stream through the next node
  (`Producer`'s resend on failover); the queue drops those it already has.
- Consumer: `Connection.consumer(prefetch=1000)` (it resumes on another node after a failover), its
  deliveries taken with `Consumer.run(callback)`, as the RabbitMQ and NATS consumers take theirs in
  a callback (pika's `basic_consume`, nats-py's `subscribe(cb=...)`), acknowledging as the workload
  says, like the reference's consumer: batched (`delivery.ack(multiple=True)` every 100 messages or
  50 ms) or one `delivery.ack()` per message, sent on the consumer's own Consume stream. The ack has
  no reply, as an AMQP basic.ack has none; the prefetch bounds how many are outstanding.

Beyond the reference's figures, for diagnosis (in each result's notes and details): the WARNING and
ERROR lines the nodes logged during the workload; in W3, the messages still in the queue after the
run (taken by a check consumer), so that "lost" (confirmed, never delivered) can be told apart from
"not taken before the drain ended"; and if no delivery came after the kill although the producer
went on, the gap is counted to the end of the producer's window (`_w3_result` counts it only up to
the last delivery, so a queue that never serves again would otherwise show a short gap). A queue
whose mirrors do not all synchronise within 10 s is replaced by a fresh one (the cluster is
restarted after every second such failure); the notes say so.
"""

from __future__ import annotations

import ringq  # noqa: F401 (first, as a user's program would: the SDK chooses gRPC's I/O path before grpc loads)

# isort: split
import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.synchronize
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc

from bench.ack_batching import BATCHED, EACH, Ack, AckBatching, AckPolicy, AckTimer
from bench.cpu_binding import available_cpus, bind_threads, round_robin
from bench.reference.rabbitmq_workloads import (
    FIXED_RATE,
    HEADER,
    MAX_IN_FLIGHT,
    NS,
    PAYLOAD_SIZE,
    PREFETCH,
    WORKLOAD_ACKS,
    WORKLOADS,
    AsyncWindowProducer,
    ConsumerReport,
    Durations,
    PairSpec,
    ProducerReport,
    StopWhen,
    WorkloadResult,
    _cpu_seconds,
    _KillInfo,
    _RunOutcome,
    _w3_result,
    check_workloads,
    make_body,
    put_report,
    queue_steps,
    run_pair,
    run_producer,
    w1_result,
    w2_result,
    workload_name,
)
from ringq import aio
from ringq.aio import STREAM_RETRYABLE
from ringq.errors import RingqError
from ringq.security import TLS, Credentials
from ringq.v1 import queue_pb2
from services import certs, cluster

NODES = 3
NODE_ARGS = ("--log-level", "WARNING")  # default settings otherwise
# The reference's workloads, and W2 at the fixed rate again with the nodes unbound (before W3: it kills a node).
# The others run with each node bound to a CPU of its own, as docs/configuration.md recommends deploying them;
# these two leave the nodes' placement to the system, as by default (W3 at default settings, as issue 13 asks).
RINGQ_WORKLOADS = (*WORKLOADS[:-1], "w2rate_unbound", WORKLOADS[-1])
UNBOUND_WORKLOADS = ("w2rate_unbound", "w3")
POLICY_NAME = "ha"
POLICY_PATTERN = r"^ha\."
POLICY = {"ha-mode": "all", "ha-sync-mode": "automatic"}
PUBLISH_BATCH = 100  # messages per PublishRequest at most: ringq.aio.Producer's default
MASTER_NODE = "node1"
ADMIN_TIMEOUT_S = 30.0
SYNC_TIMEOUT_S = 10.0
_CONFIRMED = (queue_pb2.PUBLISH_OUTCOME_CONFIRMED, queue_pb2.PUBLISH_OUTCOME_DUPLICATE)


# --- the cluster ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Access:
    """How the benchmark's clients reach the cluster: plaintext, or TLS as a user (picklable)."""

    tls: TLS | None = None
    credentials: Credentials | None = None

    def connection(self, addresses: Sequence[str], **options: Any) -> aio.Connection:
        return aio.Connection(addresses, tls=self.tls, credentials=self.credentials, **options)


PLAINTEXT = Access()


class RingqCluster:
    """A 3-node ringq cluster (plus its coordinator) on 127.0.0.1 in a temporary directory, with the
    mirroring policy set; a context manager that stops every process it started. With `tls`, every
    member uses mutual TLS and the clients TLS and the seeded user guest (from loopback)."""

    def __init__(
        self, size: int = NODES, node_args: Sequence[str] = NODE_ARGS, *, tls: bool = False, bind: bool = False
    ) -> None:
        self.size = size
        self.node_args = tuple(node_args)
        self.tls = tls
        self.bind = bind  # each node on a CPU of its own, round-robin (`bind_nodes`), while this holds
        self.placement: dict[str, int] = {}  # the CPU of each node when last bound
        self.access = PLAINTEXT
        self._directory: Path | None = None
        self.info: cluster.ClusterInfo | None = None

    def __enter__(self) -> Self:
        self._directory = Path(tempfile.mkdtemp(prefix="ringq-bench-queues-"))
        try:
            self.info = cluster.up(self.size, self._directory, node_args=self.node_args, timeout=60.0, tls=self.tls)
            if self.tls:
                ca = certs.ca_paths(self.info.tls_dir).certificate
                self.access = Access(TLS(ca=str(ca)), Credentials("guest", "guest"))
            asyncio.run(self._configure())
            if self.bind:
                self.bind_nodes()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def directory(self) -> Path:
        if self._directory is None:
            raise RuntimeError("the cluster was not started")
        return self._directory

    def stop(self) -> None:
        """Stop every process of the cluster and remove its directory (idempotent)."""
        directory, self._directory, self.info = self._directory, None, None
        if directory is None:
            return
        try:
            cluster.down(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def restart(self) -> None:
        """Stop every process and start a fresh cluster (new directory, same settings)."""
        self.stop()
        self.__enter__()

    def bind_nodes(self) -> dict[str, int]:
        """Bind every thread of each node to one CPU, round-robin over the CPUs this process may use (node1 on
        the first, node2 on the next, ...), as docs/configuration.md recommends placing co-located nodes;
        the coordinator stays unbound. Returns each node's CPU."""
        placement = round_robin(self.node_names, available_cpus())
        for node, cpu in placement.items():
            bind_threads(self._info().process(node).pid, {cpu})
        self.bind = True
        self.placement = placement
        return placement

    def unbind_nodes(self) -> None:
        """Let every live node run on any CPU this process may use again (the default placement)."""
        cpus = available_cpus()
        for process in self._info().nodes:
            if cluster.is_alive(process):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it died since
                    bind_threads(process.pid, cpus)
        self.bind = False

    def _info(self) -> cluster.ClusterInfo:
        if self.info is None:
            raise RuntimeError("the cluster is not running")
        return self.info

    async def _configure(self) -> None:
        """Set the policy, then wait until the coordinator sees every node alive (their heartbeats came)."""
        info = self._info()
        access = self.access
        async with aio.Admin(info.node_addresses, tls=access.tls, credentials=access.credentials, timeout=10) as admin:
            await admin.set_policy(POLICY_NAME, POLICY_PATTERN, POLICY)
            deadline = time.monotonic() + ADMIN_TIMEOUT_S
            while True:
                status = await admin.cluster_status()
                alive = {n.node for n in status.nodes if n.alive}
                if alive >= set(self.node_names):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nodes alive after {ADMIN_TIMEOUT_S:g} s: {sorted(alive)}")
                await asyncio.sleep(0.1)

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self._info().nodes]

    def address(self, node: str) -> str:
        return self._info().process(node).address

    def addresses_from(self, first: str) -> list[str]:
        """Every node's address, `first`'s first, then the others in order (the clients' failover order)."""
        names = self.node_names
        i = names.index(first)
        return [self.address(n) for n in names[i:] + names[:i]]

    def alive(self, node: str) -> bool:
        return cluster.is_alive(self._info().process(node))

    def live_addresses(self) -> list[str]:
        return [n.address for n in self._info().nodes if cluster.is_alive(n)]

    def kill_node(self, node: str) -> float:
        """SIGKILL `node` (services.cluster.kill waits until it is gone); returns time.monotonic() just
        before the signal is sent (the lock and record read before it take well under a millisecond)."""
        at = time.monotonic()
        if not cluster.kill(self.directory, node, signal.SIGKILL):
            raise RuntimeError(f"{node} was not running")
        return at

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the live nodes and the coordinator together."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for process in self._info().processes:
            if not cluster.is_alive(process):
                continue
            try:
                fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / ticks
        return total

    def log_offsets(self) -> dict[Path, int]:
        """Where each process's log ends now (see `log_problems`)."""
        offsets = {}
        for log in self._info().logs.glob("*.log"):
            with contextlib.suppress(OSError):
                offsets[log] = log.stat().st_size
        return offsets

    def log_problems(self, since: dict[Path, int]) -> list[str]:
        """The WARNING/ERROR lines the processes logged after `since` ("node2: <message>")."""
        found = []
        for log in sorted(self._info().logs.glob("*.log")):
            try:
                with log.open("rb") as f:
                    f.seek(since.get(log, 0))
                    text = f.read().decode(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                if " WARNING " in line or " ERROR " in line or "Traceback" in line:
                    found.append(f"{log.stem}: {line[24:].strip()}"[:300])
        return found

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for log in sorted(self._info().logs.glob("*.log")):
            with contextlib.suppress(OSError):
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)


def _admin(
    coroutine_factory: Callable[[aio.Connection], Any],
    addresses: Sequence[str],
    retry_for: float = ADMIN_TIMEOUT_S,
    access: Access = PLAINTEXT,
) -> Any:
    """Run one administrative coroutine with a fresh connection (its own event loop), in the parent process;
    its calls retry through a failover for `retry_for` seconds."""

    async def run() -> Any:
        connection = access.connection(addresses, retry_for=retry_for)
        try:
            return await asyncio.wait_for(coroutine_factory(connection), ADMIN_TIMEOUT_S + 10)
        finally:
            await connection.close()

    return asyncio.run(run())


class QueueNotSynchronised(RuntimeError):
    """A declared queue's mirrors did not all become synchronised in time."""


def _declare_synchronised(rc: RingqCluster, queue: str, node: str, timeout: float) -> str:
    """Declare `queue` (durable) through `node` and wait until every mirror is synchronised; its master's node."""

    async def declare(connection: aio.Connection) -> str:
        info = await connection.declare_queue(queue, durable=True)
        deadline = time.monotonic() + timeout
        while True:
            status = await connection.queue_status(queue)
            if len(status.synchronised_mirrors) >= rc.size - 1 and status.status == "running":
                return str(status.master_node)
            if time.monotonic() > deadline:
                raise QueueNotSynchronised(
                    f"{queue}: master {info.master_node}, mirrors {list(status.mirrors)}, synchronised "
                    f"{list(status.synchronised_mirrors)}, status {status.status!r} after {timeout:g} s"
                )
            await asyncio.sleep(0.05)

    master: str = _admin(declare, [rc.address(node)], access=rc.access)
    return master


def prepare_queue(
    rc: RingqCluster, queue: str, node: str = MASTER_NODE, timeout: float = SYNC_TIMEOUT_S, attempts: int = 5
) -> tuple[str, str, list[str]]:
    """Declare a queue named `queue` (durable) through `node`, so its master is there, and wait until every
    mirror is synchronised. Returns (the queue's name, its master's node, the problems met on the way).

    An empty queue's mirrors normally synchronise within 0.2 s. If one does not within `timeout`, that
    queue is deleted and a fresh one (`queue`.2, ...) declared instead; after every second such failure
    the whole cluster is restarted first (the race that strands a mirror can repeat on one cluster). At
    most `attempts` declarations; each retry is returned among the problems, for the workload's notes."""
    problems: list[str] = []
    for attempt in range(1, attempts + 1):
        name = queue if attempt == 1 else f"{queue}.{attempt}"
        try:
            master = _declare_synchronised(rc, name, node, timeout)
        except QueueNotSynchronised as error:
            problems.append(str(error))
            if attempt % 2 == 0 and attempt < attempts:
                problems[-1] += " (cluster restarted)"
                rc.restart()
            else:
                delete_queue(rc, name)
            continue
        if master != node:
            raise RuntimeError(f"{name} was declared through {node} but its master is on {master}")
        return name, master, problems
    raise RuntimeError(f"no queue with every mirror synchronised after {attempts} declarations: {problems}")


def queue_master(rc: RingqCluster, queue: str) -> str:
    async def status(connection: aio.Connection) -> str:
        return str((await connection.queue_status(queue)).master_node)

    master: str = _admin(status, rc.live_addresses(), access=rc.access)
    return master


def take_leftovers(rc: RingqCluster, queue: str, idle_s: float = 1.0, limit_s: float = 120.0) -> list[int] | None:
    """After a run: consume what `queue` still holds (acknowledging with `multiple` every 500, which is
    not the workloads' method but only a check) until `idle_s` passes without a delivery; the sequence
    numbers taken, or None if the queue could not be read. This tells a message the run's consumer had
    no time to take (still queued) from one that is gone."""

    async def take(connection: aio.Connection) -> list[int]:
        await connection.queue_status(queue)  # fails (-> None) if the queue cannot be read
        seqs: list[int] = []
        consumer = connection.consumer(queue, prefetch=PREFETCH)
        # every 500 with multiple; at the end only what is still pending (a tag acknowledged twice is refused)
        batching = AckBatching(AckPolicy(every=500, interval_s=limit_s))
        last: aio.Delivery | None = None
        deadline = time.monotonic() + limit_s
        try:
            while time.monotonic() < deadline:
                try:
                    delivery = await asyncio.wait_for(anext(consumer), idle_s)
                except (TimeoutError, StopAsyncIteration):
                    break
                seqs.append(HEADER.unpack_from(delivery.body)[0])
                last = delivery
                if batching.delivered(delivery.delivery_tag, time.monotonic()) is not None:
                    delivery.ack(multiple=True)
            if batching.flush() is not None and last is not None:
                last.ack(multiple=True)
        finally:
            await consumer.close()
        return seqs

    try:
        taken: list[int] = _admin(take, rc.live_addresses(), access=rc.access)
    except Exception:
        return None
    return taken


def delete_queue(rc: RingqCluster, queue: str) -> None:
    async def delete(connection: aio.Connection) -> None:
        await connection.delete_queue(queue)

    with contextlib.suppress(Exception):
        _admin(delete, rc.live_addresses(), retry_for=5.0, access=rc.access)


# --- the client processes' reports ------------------------------------------------------------------


@dataclass
class RingqProducerReport(ProducerReport):
    duplicate_outcomes: int = 0  # resends the queue already held (answered DUPLICATE: nothing added)
    duplicate_seqs: array[int] = field(default_factory=lambda: array("q"))  # with record_confirmed
    confirmed_ns: array[int] = field(default_factory=lambda: array("q"))  # with record_confirmed: when each came
    failovers: int = 0  # Connection.failed() calls: moves to the next node


@dataclass
class RingqConsumerReport(ConsumerReport):
    acks_refused: int = 0  # ack() returned False: the delivery's stream was gone (after a failover)
    ack_errors: int = 0  # consume streams the queue ended for an ack it refused (an unknown delivery tag)
    subscriptions: int = 0  # consumer tags seen: 1 + re-subscriptions
    failovers: int = 0


class _CountingConnection(aio.Connection):
    """An aio.Connection that counts its moves to the next node."""

    def __init__(self, addresses: Sequence[str], access: Access = PLAINTEXT) -> None:
        super().__init__(addresses, tls=access.tls, credentials=access.credentials)
        self.failovers = 0

    def failed(self) -> None:
        self.failovers += 1
        super().failed()


def _error_text(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details()}"


# --- producer (runs in its own process) ---------------------------------------------------------------


@dataclass
class ProducerConfig:
    addresses: list[str]  # tried in order; on a failure the next one
    queue: str
    warmup_s: float
    measure_s: float
    rate: float | None = None  # msgs/s; None: as fast as the confirms allow
    max_in_flight: int = MAX_IN_FLIGHT
    batch: int = PUBLISH_BATCH
    record_confirmed: bool = False
    confirm_grace_s: float = 3.0  # after the run, how long to wait for outstanding confirms
    give_up_s: float = 60.0  # failing to publish for longer than this ends the run
    access: Access = PLAINTEXT


class _Producer(AsyncWindowProducer):
    report: RingqProducerReport
    cfg: ProducerConfig

    def __init__(self, cfg: ProducerConfig, started: Any) -> None:
        super().__init__(cfg, started, RingqProducerReport())
        self.publisher_id = uuid.uuid4().hex
        self.call: Any = None
        self._target: tuple[Any, Any] = (None, None)  # the current Publish call and the queue's ref

    async def run(self) -> RingqProducerReport:
        wall0, cpu0 = time.monotonic(), _cpu_seconds()
        connection = _CountingConnection(self.cfg.addresses, self.cfg.access)
        finisher: asyncio.Future[None] | None = None
        lost_since: float | None = None
        try:
            while not self.done:
                if finisher is None:
                    finisher = self.start()
                worked = await self._session(connection)
                if self.done:
                    break
                if worked or lost_since is None:  # it had worked: a new outage starts now
                    lost_since = time.monotonic()
                if time.monotonic() - lost_since > self.cfg.give_up_s:
                    self.report.errors.append(f"gave up reconnecting after {self.cfg.give_up_s:.0f} s")
                    break
                if self.finishing:
                    break
                connection.failed()
                self.report.reconnects += 1
                await asyncio.sleep(0.05)
        finally:
            if finisher is not None:
                finisher.cancel()
            await connection.close()
        self.report.sequence_numbers = self.next_seq
        self.report.failovers = connection.failovers
        self.report.cpu_s = _cpu_seconds() - cpu0
        self.report.wall_s = time.monotonic() - wall0
        return self.report

    async def _session(self, connection: aio.Connection) -> bool:
        """One Publish stream: resend what is unconfirmed, then publish; True if any confirm came."""
        call = connection.stub().Publish()
        self.call = call
        resend = sorted(self.pending)
        writer = asyncio.ensure_future(self._write(call, connection.ref(self.cfg.queue), resend))
        worked = False
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:  # type: ignore[attr-defined]
                    if not self.done:
                        self.report.errors.append("connection lost: the publish stream ended")
                    break
                worked = True
                self._on_response(response)
        except grpc.aio.AioRpcError as error:
            if not self.done:
                kind = "connection lost" if error.code() in STREAM_RETRYABLE else "publish failed"
                self.report.errors.append(f"{kind}: {_error_text(error)}"[:200])
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # else the call was cancelled by _finished: the run is over
        finally:
            writer.cancel()
            call.cancel()
            with contextlib.suppress(BaseException):
                await writer
        return worked

    async def _write(self, call: Any, ref: queue_pb2.QueueRef, resend: list[int]) -> None:
        # A write fails once the stream is broken; the reader then reports the status.
        self._target = (call, ref)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            for start in range(0, len(resend), self.cfg.batch):
                seqs = [s for s in resend[start : start + self.cfg.batch] if s in self.pending]
                if seqs:
                    await self._send(seqs)
                    self.report.republished += len(seqs)
            await self.produce()

    async def _send(self, keys: list[int]) -> None:
        call, ref = self._target
        pending = self.pending
        request = queue_pb2.PublishRequest(queue=ref, publisher=self.publisher_id)
        add = request.messages.add  # built in place, as ringq.aio.Producer does
        for s in keys:
            add(body=make_body(*pending[s]), seq=s)
        self.report.published += len(keys)
        await call.write(request)

    def _on_response(self, response: queue_pb2.PublishResponse) -> None:
        now = time.monotonic_ns()
        report = self.report
        count = 0
        for seq, outcome in zip(response.seqs, response.outcomes, strict=True):
            entry = self.settle(seq)
            if entry is None:
                continue
            if outcome in _CONFIRMED:
                count += 1
                duplicate = outcome == queue_pb2.PUBLISH_OUTCOME_DUPLICATE
                report.duplicate_outcomes += duplicate
                if self.cfg.record_confirmed:
                    report.confirmed_seqs.append(entry[0])
                    report.confirmed_ns.append(now)
                    if duplicate:
                        report.duplicate_seqs.append(entry[0])
            else:
                report.nacked += 1
        self.counted(count, now)

    def _finished(self) -> None:
        if self.call is not None:
            self.call.cancel()


def _producer_main(cfg: ProducerConfig, started: Any, results: multiprocessing.Queue[Any]) -> None:
    put_report(
        results, "producer", lambda: asyncio.run(_Producer(cfg, started).run()), lambda e: RingqProducerReport(errors=e)
    )


# --- consumer (runs in its own process) ---------------------------------------------------------------


@dataclass
class ConsumerConfig:
    addresses: list[str]
    queue: str
    prefetch: int = PREFETCH
    acks: AckPolicy = EACH
    drain: bool = False  # after stop: keep consuming until idle_s without a delivery (at most drain_s)
    idle_s: float = 1.5
    drain_s: float = 30.0
    access: Access = PLAINTEXT


class _Consumer:
    def __init__(
        self, cfg: ConsumerConfig, ready: multiprocessing.synchronize.Event, stop: multiprocessing.synchronize.Event
    ) -> None:
        self.cfg = cfg
        self.ready = ready
        self.until = StopWhen(stop, cfg.drain, cfg.idle_s, cfg.drain_s)
        self.report = RingqConsumerReport()
        self.tags: set[str] = set()
        self.acks = AckTimer(cfg.acks, self._call_later, self._ack)
        self.last: aio.Delivery | None = None  # the latest delivery: what a batched ack settles up to

    async def run(self) -> RingqConsumerReport:
        wall0, cpu0 = time.monotonic(), _cpu_seconds()
        connection = _CountingConnection(self.cfg.addresses, self.cfg.access)
        consuming = asyncio.ensure_future(self._consume(connection))
        try:
            await self._await_subscribed(connection, consuming)
            self.ready.set()
            while not self.until.finished():
                await asyncio.sleep(0.05)
            ack = self.acks.batching.flush()
            if ack is not None:
                self._ack(ack)
        finally:
            consuming.cancel()
            with contextlib.suppress(BaseException):
                await consuming
            await connection.close()
        self.report.subscriptions = len(self.tags)
        self.report.reconnects = max(0, len(self.tags) - 1)
        self.report.failovers = connection.failovers
        self.report.cpu_s = _cpu_seconds() - cpu0
        self.report.wall_s = time.monotonic() - wall0
        return self.report

    async def _consume(self, connection: aio.Connection) -> None:
        while True:
            consumer = connection.consumer(self.cfg.queue, prefetch=self.cfg.prefetch)
            self.acks.reset()
            try:
                await consumer.run(self._on_delivery)
                self.report.errors.append("connection lost: the consume stream ended")
            except RingqError as error:  # not retryable, or out of retries: the consumer resumes itself
                if "delivery tag" in error.details:
                    self.report.ack_errors += 1  # the queue refused an ack and ended the stream
                self.report.errors.append(f"consume failed: {error.code.name}: {error.details}"[:200])
            finally:
                await consumer.close()
            await asyncio.sleep(0.05)

    async def _await_subscribed(self, connection: aio.Connection, consuming: asyncio.Future[None]) -> None:
        """The consumer is attached once the queue reports it (the Consume stream answers only with deliveries)."""
        deadline = time.monotonic() + ADMIN_TIMEOUT_S
        while (await connection.queue_status(self.cfg.queue)).consumers < 1:
            if consuming.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the consumer did not attach to {self.cfg.queue}: {self.report.errors[:3]}")
            await asyncio.sleep(0.02)

    def _on_delivery(self, delivery: aio.Delivery) -> None:
        self.report.record(delivery.body, time.monotonic_ns(), delivery.redelivered)
        if delivery.consumer_tag not in self.tags:
            self.tags.add(delivery.consumer_tag)
            self.acks.reset()  # a new subscription: what the last one had unacknowledged comes again
        self.last = delivery
        self.acks.delivered(delivery.delivery_tag)
        self.until.delivered()

    @staticmethod
    def _call_later(delay: float, callback: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_later(delay, callback)

    def _ack(self, ack: Ack) -> None:
        """On the consume stream, not awaited (it has no reply); False: the delivery's stream is gone."""
        delivery = self.last
        if delivery is None or delivery.delivery_tag != ack.tag:
            return
        self.report.acks_sent += 1
        if not delivery.ack(multiple=ack.multiple):
            self.report.acks_refused += 1


def _consumer_main(
    cfg: ConsumerConfig,
    ready: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[Any],
) -> None:
    put_report(
        results,
        "consumer",
        lambda: asyncio.run(_Consumer(cfg, ready, stop).run()),
        lambda e: RingqConsumerReport(errors=e),
    )


# --- orchestration (the parent process) ---------------------------------------------------------------


def _sync_note(problems: list[str]) -> str:
    if not problems:
        return ""
    restarts = sum("(cluster restarted)" in p for p in problems)
    again = f", the cluster restarted {restarts} times" if restarts else ""
    return f"queue declared {len(problems) + 1} times{again}: a mirror never synchronised ({problems[0]})"


def run_w1(rc: RingqCluster, durations: Durations, queue: str = "ha.w1") -> WorkloadResult:
    """One producer, confirms with up to 1000 in flight, nobody consuming: confirmed msgs/s."""
    queue, master, problems = prepare_queue(rc, queue)
    cfg = ProducerConfig(rc.addresses_from(master), queue, durations.warmup_s, durations.measure_s, access=rc.access)
    try:
        report, cores = run_producer(_producer_main, cfg, rc.cpu_seconds, durations)
    finally:
        delete_queue(rc, queue)
    return w1_result(report, durations, cores, [_sync_note(problems)], {"redeclared": len(problems)})


def _run_pair(
    rc: RingqCluster,
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
    master_before = queue_master(rc, queue)
    addresses = rc.addresses_from(master_before)
    spec = PairSpec(
        producer_main=_producer_main,
        producer_cfg=ProducerConfig(
            addresses, queue, warmup_s, measure_s, rate=rate, record_confirmed=record_confirmed, access=rc.access
        ),
        consumer_main=_consumer_main,
        consumer_cfg=ConsumerConfig(addresses, queue, acks=acks, drain=drain, drain_s=drain_s, access=rc.access),
        cpu_seconds=rc.cpu_seconds,
        warmup_s=warmup_s,
        measure_s=measure_s,
        drain_s=drain_s,
        subscribe_timeout_s=ADMIN_TIMEOUT_S + 10,
    )
    outcome = run_pair(spec, on_started)
    outcome.master_before = master_before
    if outcome.killed_at_ns is not None:
        with contextlib.suppress(Exception):
            outcome.master_after = queue_master(rc, queue)
    return outcome


def run_w2(
    rc: RingqCluster,
    durations: Durations,
    *,
    rate: float | None = None,
    queue: str = "ha.w2",
    acks: AckPolicy = EACH,
    name: str | None = None,
) -> WorkloadResult:
    """Producer and consumer at once (prefetch 1000, manual acks): delivered msgs/s and latency p50/p99."""
    queue, _, problems = prepare_queue(rc, queue)
    try:
        run = _run_pair(
            rc,
            queue,
            durations.warmup_s,
            durations.measure_s,
            rate=rate,
            drain=False,
            record_confirmed=False,
            acks=acks,
        )
    finally:
        delete_queue(rc, queue)
    return w2_result(
        run,
        durations,
        rate,
        extra_notes=[acks.describe(), _sync_note(problems)],
        extra_details={"acks": acks.describe(), "redeclared": len(problems)},
        name=name,
    )


def _count_outage_to_the_end(result: WorkloadResult, run: _RunOutcome) -> None:
    """`_w3_result` measures the gap up to the last delivery, so a queue that never serves again after the
    kill would show a short gap. If deliveries stopped before the producer's window ended, the outage
    lasted at least until then: count that."""
    received = run.consumer.received_ns
    if run.killed_at_ns is None or not received:
        return
    last = max(received)
    end = run.producer.window_end_ns
    if last >= end:
        return
    outage_s = (end - max(last, run.killed_at_ns - NS)) / NS
    if result.gap_s is None or outage_s > result.gap_s:
        result.gap_s = outage_s
        result.details["gap_counted_to_window_end"] = 1
        result.notes += (
            f"; no delivery after {(last - run.killed_at_ns) / NS:+.2f} s from the kill although the producer went on: "
            f"gap counted to the end of the producer's window ({outage_s:.2f} s, at least)"
        )


def run_w3(
    rc: RingqCluster, durations: Durations, *, rate: float = FIXED_RATE, queue: str = "ha.w3", acks: AckPolicy = EACH
) -> WorkloadResult:
    """W2 at a fixed rate, SIGKILL the master's node: seconds without service, messages lost, duplicates."""
    queue, master, problems = prepare_queue(rc, queue)

    def kill_master(started_s: float) -> _KillInfo:
        time.sleep(max(0.0, started_s + durations.w3_warmup_s - time.monotonic()))
        at = rc.kill_node(master)
        return _KillInfo(node=master, at_ns=int(at * NS))

    leftovers: list[int] | None = None
    try:
        run = _run_pair(
            rc,
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
        leftovers = take_leftovers(rc, queue)  # the consumer is gone: what it did not take is still queued
    finally:
        delete_queue(rc, queue)
    result = _w3_result(run, rate, durations)
    producer, consumer = run.producer, run.consumer
    _count_outage_to_the_end(result, run)
    missing = set(producer.confirmed_seqs) - set(consumer.seqs)
    still_queued = len(missing & set(leftovers)) if leftovers is not None else None
    assert isinstance(producer, RingqProducerReport) and isinstance(consumer, RingqConsumerReport)
    result.details.update(
        {
            "acks": acks.describe(),
            "duplicate_outcomes": producer.duplicate_outcomes,
            "producer_failovers": producer.failovers,
            "consumer_failovers": consumer.failovers,
            "acks_sent": consumer.acks_sent,
            "acks_refused": consumer.acks_refused,
            "ack_errors": consumer.ack_errors,
            "redeclared": len(problems),
            "left_in_queue": len(leftovers) if leftovers is not None else "?",
            "lost_still_queued": still_queued if still_queued is not None else "?",
        }
    )
    result.notes += (
        f", {acks.describe()}, resends answered DUPLICATE {producer.duplicate_outcomes}"
        f", acks refused after the failover {consumer.acks_refused}"
    )
    if still_queued:
        result.notes += (
            f"; of the {result.lost} lost by the method, {still_queued} were still in the queue after the run "
            f"(the consumer did not take them within the {durations.drain_s:g} s drain), so "
            f"{(result.lost or 0) - still_queued} are really gone"
        )
    if problems:
        result.notes += ", " + _sync_note(problems)
    return result


# --- everything, one run ----------------------------------------------------------------------------


@dataclass
class RingqReport:
    """The ringq side of `make bench`: what ran, on what, and its measurements."""

    version: str
    commit: str
    nodes: int
    setup: str
    results: list[WorkloadResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ringq_version() -> tuple[str, str]:
    """The installed package's version and the checkout's commit ("+changes" if the tree differs from it)."""
    try:
        version = metadata.version("ringq")
    except metadata.PackageNotFoundError:
        version = "unknown"
    commit = "unknown"
    root = Path(__file__).resolve().parents[1]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        commit = head + ("+changes" if dirty else "")
    return version, commit


def run_ringq(
    *,
    quick: bool = False,
    durations: Durations | None = None,
    only: Sequence[str] = RINGQ_WORKLOADS,
    rate: float = FIXED_RATE,
    progress: Callable[[str], None] | None = None,
    stop_requested: Callable[[], bool] = lambda: False,
) -> RingqReport:
    """Start a 3-node ringq cluster, run the chosen workloads (W3 last: it kills a node), stop the cluster.

    `stop_requested` is asked before each workload (KeyboardInterrupt if it says so): an interrupt that
    gRPC turned into a cancelled call somewhere below still ends the run."""
    check_workloads(only, RINGQ_WORKLOADS)
    durations = durations or (Durations.quick() if quick else Durations())
    say = progress or (lambda _message: None)
    version, commit = ringq_version()
    say(f"starting a {NODES}-node ringq cluster on 127.0.0.1")
    with RingqCluster(NODES, bind=True) as rc:
        say(f"ringq {version} ({commit}): {', '.join(rc.node_names)} and a coordinator in {rc.directory}")
        placement = ", ".join(f"{node} on CPU {cpu}" for node, cpu in rc.placement.items())
        steps = queue_steps(partial(run_w1, rc), partial(run_w2, rc), partial(run_w3, rc), durations, rate, "ha.")
        steps["w2rate_unbound"] = partial(
            run_w2,
            rc,
            durations,
            rate=rate,
            queue="ha.w2rate_unbound",
            acks=WORKLOAD_ACKS["w2rate"],
            name=workload_name("w2rate_unbound", rate),
        )
        results: list[WorkloadResult] = []
        for key in RINGQ_WORKLOADS:
            if key in only:
                if stop_requested():
                    raise KeyboardInterrupt
                if key in UNBOUND_WORKLOADS:
                    rc.unbind_nodes()
                say(f"running {key}")
                offsets = rc.log_offsets()
                try:
                    result = steps[key]()
                except Exception as error:
                    raise RuntimeError(f"ringq {key} failed: {error}\n{rc.log_tails()}") from error
                problems = rc.log_problems(offsets)
                result.details["node_log_problems"] = len(problems)
                if problems:
                    shown = "; ".join(problems[:3])
                    result.notes += f"; the nodes logged {len(problems)} warnings/errors, e.g. {shown}"
                results.append(result)
    setup = (
        f"{NODES} nodes and a coordinator on 127.0.0.1 (default settings, node flags {' '.join(NODE_ARGS)}; each "
        f"node bound to one CPU as docs/configuration.md recommends, round-robin: {placement}; unbound in "
        f"{workload_name('w2rate_unbound', rate)} and W3), "
        f"queues mirrored by policy `{POLICY_NAME}` (`{POLICY_PATTERN}`, {json.dumps(POLICY)}); Python ringq SDK "
        f"(ringq.aio, gRPC asyncio), producer and consumer in separate processes; {PAYLOAD_SIZE}-byte transient "
        f"bodies; confirms <= {MAX_IN_FLIGHT} in flight, <= {PUBLISH_BATCH} messages per Publish request; prefetch "
        f"{PREFETCH}; {BATCHED.describe()} (W2 ack each and W3: {EACH.describe()})"
    )
    return RingqReport(version=version, commit=commit, nodes=NODES, setup=setup, results=results)
