"""Fault test: a network partition cuts a mirrored queue's master off from the rest of the cluster.

Five hosts, each a Linux network namespace on a private bridge (tests/netns.py): the coordinator,
broker nodes node1..node3 and a client host. A durable queue, mirrored on every node and synchronised,
has node1 as its master; three idempotent producers publish persistent messages to it: two on the
client host (one connected to node1 first, one to node2 first, so its messages are relayed to the
master) and one on node1's own host, beside the master. Then node1's host is cut off the bridge (every
frame to or from it silently dropped, as a firewall's DROP) for some seconds, and healed. One run,
shared by the tests below, which each judge one guarantee (ARCHITECTURE.md sections 5 and 9):

- the majority promotes a synchronised mirror within a few seconds of the cut;
- the cut-off master confirms nothing from the moment it is cut off: the producer beside it receives
  no confirm while the partition lasts (its reports cannot get round the ring, and its view cannot
  change without the coordinator);
- publishing goes on through the new master: the client host's producers fail over and resend what
  was unconfirmed; the queue answers DUPLICATE for those it already holds;
- after the heal there is one master: QueueStatus through every node names it, the old master's GM
  member is recorded dead, and messages published through node1 alone reach the new master;
- after the heal every producer gets an answer for every message;
- drained afterwards, every message a producer saw confirmed is delivered; a message comes more than
  once only with the redelivered flag; each publisher's messages come in order except redeliveries.
The measured promotion time, resume and convergence times and counts are printed (pytest -s).

The test process only builds the network and orchestrates: every client of the cluster runs inside a
namespace, as a driver (`python -m tests.test_partition COMMAND ...`, this module) that prints JSON or
writes it to files. The cluster runs with mutual TLS between its members and authenticated clients, as in
production (the drivers act as an administrator of its own: guest logs in from loopback only). Skipped
unless this machine lets root make network namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from ringq import aio
from ringq.errors import RingqError
from ringq.internal.v1 import coordinator_pb2, coordinator_pb2_grpc
from ringq.models import QueueStatus
from ringq.security import TLS, Credentials
from ringq.v1 import cluster_pb2
from services import certs
from tests import netns
from tests.clusters import member_in

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

QUEUE = "ha.partition"
HA_POLICY = {"ha-mode": "all", "ha-sync-mode": "automatic"}
COORDINATOR_HOST = "c"
CLIENT_HOST = "cl"
NODE_HOSTS = {"node1": "n1", "node2": "n2", "node3": "n3"}
OLD_MASTER = "node1"
COORDINATOR_PORT = 7000
NODE_PORT = 7100
NODE_TIMERS = ["--failure-timeout-ms", "1000", "--heartbeat-interval-ms", "100", "--grace-ms", "100"]
FAILURE_TIMEOUT = 1.0
# Producers: BURST messages every PACE seconds (at most 500/s each), at most WINDOW unconfirmed.
BURST, PACE, WINDOW, BATCH = 50, 0.1, 500, 50
BEFORE_CUT = 1000  # confirms the client host's producer has before the cut
PARTITION_SECONDS = 6.0  # how long the cut lasts at least
AFTER_PROMOTION = 500  # confirms through the new master before the heal
# A confirm the cut-off master had decided before the cut may reach the producer beside it a little
# later (same host, no network): confirms within this margin after the cut are not counted against it.
CUT_MARGIN = 0.5
PROMOTION_LIMIT = 10.0  # generous: a loaded 2-core machine
FLUSH_SECONDS = 20.0  # once stopped, how long a producer waits for the confirms still due
PROBES = 20  # messages published through node1 alone after the heal
PARTITION_LIMIT = 10.0  # the cut lasts at most this long, waiting for publishing through the new master
# The publishers: on the client host, one connected to node1 first (the master), one to node2 first (its
# messages forwarded to the master); one beside the master, on its host; and the probe after the heal.
DIRECT, FORWARDED, BESIDE, PROBE = "direct", "forwarded", "beside-master", "probe"
_REPO = Path(__file__).resolve().parents[1]
# The cluster runs with mutual TLS and authenticated clients. Its clients reach it from the bridge, not
# from loopback, where guest may not log in: the coordinator makes this administrator at its first start.
USER, PASSWORD = "partition", "partition-secret"
# Where the drivers find the cluster's CA (and make their member certificate, as tests/clusters.MEMBER).
TLS_DIR_ENV = "RINGQ_TEST_TLS_DIR"


def _kept(publisher: str) -> str:
    """A publisher id as the queue keeps it (and deliveries show it): scoped to USER, who publishes."""
    return f"{USER}\x1f{publisher}"


# ============================================================================ the drivers (in namespaces)


def _addresses(text: str) -> list[str]:
    return [a for a in text.split(",") if a]


def _write_json(path: Path, value: object) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value), encoding="utf-8")
    os.replace(tmp, path)


def _access() -> dict[str, Any]:
    """A driver's `tls` and `credentials` for the cluster's client ports: TLS trusting its CA, as USER."""
    ca = certs.ca_paths(Path(os.environ[TLS_DIR_ENV])).certificate
    return {"tls": TLS(ca=ca), "credentials": Credentials(USER, PASSWORD)}


def _coordinator_channel(coordinator: str) -> grpc.aio.Channel:
    """A channel to the coordinator's internal API as a cluster member (tests/clusters.MEMBER)."""
    return member_in(Path(os.environ[TLS_DIR_ENV])).to_coordinator(coordinator)


async def _status(address: str) -> QueueStatus | None:
    """QueueStatus through one node, without retries elsewhere; None if it does not answer in time."""
    connection = aio.Connection([address], retry_for=0.0, call_timeout=1.0, connect_timeout=1.0, **_access())
    try:
        return await connection.queue_status(QUEUE)
    except RingqError:
        return None
    finally:
        await connection.close()


async def _queue_record(coordinator: str) -> cluster_pb2.QueueRecord:
    async with _coordinator_channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        response = await stub.GetQueue(coordinator_pb2.GetQueueRequest(vhost="/", name=QUEUE), timeout=2.0)
    return response.queue


async def _members(coordinator: str, group: str) -> list[list[Any]]:
    """The queue's GM group table: [member id, node, alive] in ring order."""
    async with _coordinator_channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        response = await stub.ReadGroup(coordinator_pb2.ReadGroupRequest(group=group), timeout=2.0)
    return [[m.id, m.node, m.alive] for m in response.group.members]


async def _setup(coordinator: str, nodes: list[str]) -> dict[str, Any]:
    """Mirror ha.* on every node, wait until every node is live, declare the queue through the first node,
    wait until both mirrors are synchronised."""
    admin = aio.Admin(nodes, **_access())
    await admin.set_policy("ha", "^ha\\.", HA_POLICY)
    deadline = time.monotonic() + 30
    while sum(n.alive for n in (await admin.cluster_status()).nodes) < len(nodes):
        assert time.monotonic() < deadline, "not every node became live"
        await asyncio.sleep(0.1)
    await admin.close()
    async with aio.Connection(nodes[:1], **_access()) as connection:
        declared = await connection.declare_queue(QUEUE, durable=True)
        while len((status := await connection.queue_status(QUEUE)).synchronised_mirrors) < len(nodes) - 1:
            assert time.monotonic() < deadline, f"mirrors did not synchronise: {status}"
            await asyncio.sleep(0.1)
    record = await _queue_record(coordinator)
    return {
        "master": declared.master_node,
        "synchronised": list(status.synchronised_mirrors),
        "gm_group": record.gm_group,
        "members": await _members(coordinator, record.gm_group),
    }


class _Confirms:
    """What one producer was told, by seq: (outcome, when, by the shared monotonic clock)."""

    def __init__(self) -> None:
        self.outcomes: dict[int, tuple[str, float]] = {}
        self.failed: dict[int, str] = {}

    def watch(self, seq: int, future: asyncio.Future[aio.Outcome]) -> None:
        def done(settled: asyncio.Future[aio.Outcome]) -> None:
            if settled.cancelled():
                self.failed[seq] = "cancelled"
            elif settled.exception() is not None:
                self.failed[seq] = repr(settled.exception())
            else:
                self.outcomes[seq] = (settled.result().value, time.monotonic())

        future.add_done_callback(done)


async def _produce(nodes: list[str], publisher: str, progress: Path, stop: Path, out: Path) -> None:
    """Publish persistent messages at a steady pace until `stop` exists; then wait for the confirms
    still due (bounded), and write every outcome to `out`. `progress` is rewritten every 0.1 s."""
    connection = aio.Connection(nodes, retry_for=60.0, **_access())
    producer = connection.producer(QUEUE, publisher_id=publisher, window=WINDOW, batch=BATCH, persistent=True)
    confirms = _Confirms()

    def snapshot() -> dict[str, Any]:
        return {
            "sent": producer.next_seq - 1,
            "confirmed": len(confirms.outcomes),
            "last_confirm": max((t for _, t in confirms.outcomes.values()), default=0.0),
            "resends": producer.resends,
            "address": connection.address,
        }

    async def send() -> None:
        while True:
            for _ in range(BURST):
                future = await producer.send(f"{publisher}:{producer.next_seq}".encode())
                confirms.watch(producer.next_seq - 1, future)
            await asyncio.sleep(PACE)

    sender = asyncio.ensure_future(send())
    while not stop.exists():
        _write_json(progress, snapshot())
        await asyncio.sleep(0.1)
    sender.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sender
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(producer.flush(), FLUSH_SECONDS)
    sent = producer.next_seq - 1
    result = {
        **snapshot(),
        "outcomes": {str(seq): list(outcome) for seq, outcome in confirms.outcomes.items()},
        "failed": {str(seq): why for seq, why in confirms.failed.items()},
        "unconfirmed": [seq for seq in range(1, sent + 1) if seq not in confirms.outcomes],
    }
    _write_json(out, result)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(connection.close(), 5)


async def _one_master(nodes: list[str], not_master: str, deadline: float) -> dict[str, Any]:
    """Poll QueueStatus through every node in `nodes` until all answer and name one master other than
    `not_master`; return it and when it was first seen (monotonic)."""
    stop = time.monotonic() + deadline
    while True:
        answers = await asyncio.gather(*(_status(address) for address in nodes))
        seen = [None if a is None else {"master": a.master_node, "status": a.status} for a in answers]
        masters = {a.master_node if a is not None else None for a in answers}
        agreed = len(masters) == 1 and None not in masters and not_master not in masters
        if agreed or time.monotonic() > stop:
            return {"master": masters.pop() if agreed else None, "at": time.monotonic(), "statuses": seen}
        await asyncio.sleep(0.05)


async def _member_dead(coordinator: str, group: str, member: str, deadline: float) -> dict[str, Any]:
    """Wait until the group table records `member` dead (or has erased it); the table as last read."""
    stop = time.monotonic() + deadline
    while True:
        members = await _members(coordinator, group)
        if not any(m[0] == member and m[2] for m in members) or time.monotonic() > stop:
            return {"dead": not any(m[0] == member and m[2] for m in members), "members": members}
        await asyncio.sleep(0.1)


async def _probe(nodes: list[str], publisher: str) -> dict[str, Any]:
    """Publish PROBES messages through `nodes` (one node: no failover) and report their outcomes."""
    async with aio.Connection(nodes, retry_for=20.0, **_access()) as connection:
        producer = connection.producer(QUEUE, publisher_id=publisher, persistent=True)
        bodies = [f"{publisher}:{seq}".encode() for seq in range(1, PROBES + 1)]
        outcomes = await asyncio.wait_for(producer.publish_many(bodies), 30)
        status = await connection.queue_status(QUEUE)
    return {"outcomes": [o.value for o in outcomes], "master": status.master_node}


async def _drain(nodes: list[str], expect: Path, deadline: float) -> dict[str, Any]:
    """Consume until every expected (publisher, seq) came (publishers as the producers named them) and nothing
    more comes for a second (or `deadline` seconds have passed); write every delivery, in order, as
    [publisher, seq, redelivered], the publisher as the queue keeps it (`_kept`)."""
    expected = {(_kept(p), s) for p, s in json.loads(expect.read_text(encoding="utf-8"))}
    deliveries: list[list[Any]] = []
    seen: set[tuple[str, int]] = set()
    async with aio.Connection(nodes, retry_for=30.0, **_access()) as connection:
        consumer = connection.consumer(QUEUE, prefetch=1000)
        iterator = aiter(consumer)
        last: aio.Delivery | None = None
        stop = time.monotonic() + deadline
        while time.monotonic() < stop:
            try:
                delivery = await asyncio.wait_for(anext(iterator), 1.0)
            except TimeoutError:
                if expected <= seen:
                    break
                continue
            deliveries.append([delivery.publisher, delivery.seq, delivery.redelivered])
            seen.add((delivery.publisher, delivery.seq))
            last = delivery
            if len(deliveries) % 200 == 0:
                delivery.ack(multiple=True)
        if last is not None:
            last.ack(multiple=True)
        await consumer.close()
        depth = (await connection.queue_status(QUEUE)).depth
    return {"deliveries": deliveries, "depth_after": depth}


def driver(argv: Sequence[str]) -> None:
    """The drivers' command line: run inside a namespace by the test."""
    parser = argparse.ArgumentParser(prog="python -m tests.test_partition")
    parser.add_argument("command", choices=["setup", "produce", "one-master", "member-dead", "probe", "drain"])
    parser.add_argument("--nodes", type=_addresses, default=[])
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--publisher", default="")
    parser.add_argument("--not-master", default="")
    parser.add_argument("--group", default="")
    parser.add_argument("--member", default="")
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--progress", type=Path)
    parser.add_argument("--stop", type=Path)
    parser.add_argument("--expect", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result: dict[str, Any] | None = None
    if args.command == "setup":
        result = asyncio.run(_setup(args.coordinator, args.nodes))
    elif args.command == "produce":
        asyncio.run(_produce(args.nodes, args.publisher, args.progress, args.stop, args.out))
    elif args.command == "one-master":
        result = asyncio.run(_one_master(args.nodes, args.not_master, args.deadline))
    elif args.command == "member-dead":
        result = asyncio.run(_member_dead(args.coordinator, args.group, args.member, args.deadline))
    elif args.command == "probe":
        result = asyncio.run(_probe(args.nodes, args.publisher))
    else:
        result = asyncio.run(_drain(args.nodes, args.expect, args.deadline))
    if result is not None:
        if args.out is not None:
            _write_json(args.out, result)
        else:
            print(json.dumps(result))


# ============================================================================ the test (root namespace)


@dataclass
class _Cluster:
    """The partitioned cluster's processes and where their files go."""

    net: netns.TestNetwork
    directory: Path
    coordinator: str
    nodes: dict[str, str]  # node id -> HOST:PORT
    driver_module: str = "tests.test_partition"  # the module whose `driver` runs the driver commands

    @property
    def logs(self) -> Path:
        return self.directory / "logs"

    @property
    def tls_dir(self) -> Path:
        return self.directory / "tls"

    def env(self) -> dict[str, str]:
        paths = [str(_REPO), str(_REPO / "clients" / "python"), os.environ.get("PYTHONPATH", "")]
        return dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in paths if p),
            RINGQ_DEFAULT_PASSWORD=PASSWORD,  # the coordinator's first start makes USER with it
            **{TLS_DIR_ENV: str(self.tls_dir)},
        )

    def tls_flags(self, issued: certs.Issued) -> list[str]:
        ca = certs.ca_paths(self.tls_dir).certificate
        return ["--tls-ca", str(ca), "--tls-cert", str(issued.certificate), "--tls-key", str(issued.key)]

    def spawn(self, host: str, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start `argv` on `host`, its output in logs/<name>.log."""
        with open(self.logs / f"{name}.log", "ab") as log:
            return self.net.popen(host, argv, stdout=log, cwd=_REPO, env=self.env())

    def driver(self, host: str, *args: str, timeout: float = 60.0) -> dict[str, Any]:
        """Run a driver command on `host` to its end; its JSON answer (empty if it wrote it to a file)."""
        done = self.net.run(
            host, [sys.executable, "-m", self.driver_module, *args], cwd=_REPO, env=self.env(), timeout=timeout
        )
        assert done.returncode == 0, f"driver {args[0]} on {host} failed:\n{done.stderr[-3000:]}"
        lines = done.stdout.strip().splitlines()
        answer: dict[str, Any] = json.loads(lines[-1]) if lines else {}
        return answer

    def spawn_driver(self, host: str, name: str, *args: str) -> subprocess.Popen[bytes]:
        return self.spawn(host, name, [sys.executable, "-m", self.driver_module, *args])

    def addresses(self, *nodes: str) -> str:
        return ",".join(self.nodes[n] for n in nodes)


def _wait_ready(processes: dict[str, tuple[subprocess.Popen[bytes], Path]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for name, (process, ready) in processes.items():
        while not ready.exists():
            assert process.poll() is None, f"{name} exited ({process.returncode}) before it was ready"
            assert time.monotonic() < deadline, f"{name} was not ready within {timeout:g} s"
            time.sleep(0.05)


def _start(
    net: netns.TestNetwork,
    directory: Path,
    *,
    coordinator_host: str = COORDINATOR_HOST,
    node_hosts: Mapping[str, str] = NODE_HOSTS,
    driver_module: str = "tests.test_partition",
) -> _Cluster:
    """The coordinator on `coordinator_host` and each node on its host (node id -> host), bound to (and
    advertising) its host's address, with mutual TLS (each node's certificate names its host's address, which
    clients dial) and USER as the administrator; the driver commands run `driver_module`."""
    hosts = net.hosts
    cluster = _Cluster(
        net=net,
        directory=directory,
        coordinator=f"{hosts[coordinator_host].ip}:{COORDINATOR_PORT}",
        nodes={node: f"{hosts[host].ip}:{NODE_PORT}" for node, host in node_hosts.items()},
        driver_module=driver_module,
    )
    for sub in ("logs", "run", "data", "results"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    for node, host in node_hosts.items():
        certs.issue_node(cluster.tls_dir, node, hosts=[hosts[host].ip])
    certs.issue_coordinator(cluster.tls_dir)
    python = sys.executable
    ready = directory / "run" / "coordinator.ready"
    coordinator = cluster.spawn(
        coordinator_host,
        "coordinator",
        [python, "-m", "services.coordinator", "--listen", cluster.coordinator, "--db", str(directory / "c.db"),
         "--ready-file", str(ready), "--default-user", USER,
         *cluster.tls_flags(certs.coordinator_paths(cluster.tls_dir))],
    )  # fmt: skip
    _wait_ready({"coordinator": (coordinator, ready)}, 30)
    started = {}
    for node, host in node_hosts.items():
        ready = directory / "run" / f"{node}.ready"
        argv = [python, "-m", "services.node", "--id", node, "--listen", cluster.nodes[node],
                "--advertise", cluster.nodes[node], "--coordinator", cluster.coordinator, "--ready-file", str(ready),
                "--data-dir", str(directory / "data" / node),
                *cluster.tls_flags(certs.node_paths(cluster.tls_dir, node)), *NODE_TIMERS]  # fmt: skip
        started[node] = (cluster.spawn(host, node, argv), ready)
    _wait_ready(started, 30)
    return cluster


class _Producer:
    """A producer driver running on a host until told to stop."""

    def __init__(self, cluster: _Cluster, host: str, publisher: str, nodes: Sequence[str]) -> None:
        results = cluster.directory / "results"
        self.cluster = cluster
        self.publisher = publisher
        self.progress_file = results / f"{publisher}.progress"
        self.stop_file = results / f"{publisher}.stop"
        self.out = results / f"{publisher}.json"
        self.process = cluster.spawn_driver(
            host, f"producer-{publisher}", "produce", "--nodes", cluster.addresses(*nodes), "--publisher", publisher,
            "--progress", str(self.progress_file), "--stop", str(self.stop_file), "--out", str(self.out),
        )  # fmt: skip

    def progress(self) -> dict[str, Any]:
        try:
            answer: dict[str, Any] = json.loads(self.progress_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {"sent": 0, "confirmed": 0, "last_confirm": 0.0, "resends": 0, "address": ""}
        return answer

    def wait_confirmed(self, count: int, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while self.progress()["confirmed"] < count:
            assert self.process.poll() is None, f"producer {self.publisher} exited ({self.process.returncode})"
            assert time.monotonic() < deadline, f"{what}: producer {self.publisher} is at {self.progress()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 60.0) -> dict[str, Any]:
        """Stop publishing; the outcome of every message once the ones due came (or the driver gave up)."""
        self.stop_file.touch()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"producer {self.publisher} did not finish: {self.progress()}") from None
        answer: dict[str, Any] = json.loads(self.out.read_text(encoding="utf-8"))
        return answer


def _confirms(result: dict[str, Any]) -> dict[int, tuple[str, float]]:
    """A producer's outcomes by seq: (outcome, when)."""
    return {int(seq): (outcome, t) for seq, (outcome, t) in result["outcomes"].items()}


@dataclass
class _Observed:
    """What one partition run saw; the tests below judge it."""

    setup: dict[str, Any]
    cut_at: float
    promotion: dict[str, Any]
    healed_at: float
    at_heal: dict[str, dict[str, Any]]  # publisher -> its progress when the partition was healed
    after_heal: dict[str, Any]  # QueueStatus through every node once they agree (or gave up)
    old_member_dead: dict[str, Any]
    probe: dict[str, Any]
    produced: dict[str, dict[str, Any]]  # publisher -> its outcomes
    drained: dict[str, Any]

    def confirms_between(self, publisher: str, start: float, end: float) -> list[float]:
        return sorted(t for _, t in _confirms(self.produced[publisher]).values() if start < t < end)

    @property
    def promoted_in(self) -> float:
        return float(self.promotion["at"]) - self.cut_at


def _check_history(confirmed: dict[str, set[int]], deliveries: list[list[Any]]) -> dict[str, int]:
    """Every confirmed message delivered; repeats only redelivered; each publisher in order but for
    redeliveries. `confirmed`: seqs by publisher as the producers named them; `deliveries`: as `_drain`
    wrote them. Returns counts for the report."""
    confirmed = {_kept(publisher): seqs for publisher, seqs in confirmed.items()}
    counts: dict[tuple[str, int], int] = {}
    flagged: dict[tuple[str, int], int] = {}
    last_fresh: dict[str, int] = {}
    out_of_order: list[tuple[str, int, int]] = []
    for publisher, seq, redelivered in deliveries:
        key = (publisher, seq)
        counts[key] = counts.get(key, 0) + 1
        if redelivered:
            flagged[key] = flagged.get(key, 0) + 1
        elif seq <= last_fresh.get(publisher, 0):
            out_of_order.append((publisher, last_fresh[publisher], seq))
        else:
            last_fresh[publisher] = seq
    missing = sorted((p, s) for p, seqs in confirmed.items() for s in seqs if (p, s) not in counts)
    assert not missing, f"{len(missing)} confirmed messages never delivered, e.g. {missing[:5]}"
    unflagged = [key for key, n in counts.items() if n - 1 > flagged.get(key, 0)]
    assert not unflagged, f"messages delivered again without the redelivered flag, e.g. {unflagged[:5]}"
    assert not out_of_order, f"a publisher's messages out of order (publisher, after, came): {out_of_order[:5]}"
    return {
        "deliveries": len(deliveries),
        "repeats": sum(n - 1 for n in counts.values()),
        "redelivered": sum(flagged.values()),
    }


def _wait_publishing(producers: Sequence[_Producer], count: int, deadline: float) -> None:
    """Until each producer has `count` more confirms than it has now (or the deadline passes)."""
    base = {p.publisher: p.progress()["confirmed"] for p in producers}
    while time.monotonic() < deadline:
        if all(p.progress()["confirmed"] >= base[p.publisher] + count for p in producers):
            return
        time.sleep(0.05)


def _partition(cluster: _Cluster) -> _Observed:
    """The whole run: set up, publish, cut node1 off, wait, heal, settle, drain."""
    net, results = cluster.net, cluster.directory / "results"
    every_node = cluster.addresses("node1", "node2", "node3")
    setup = cluster.driver(CLIENT_HOST, "setup", "--coordinator", cluster.coordinator, "--nodes", every_node)
    assert setup["master"] == OLD_MASTER and sorted(setup["synchronised"]) == ["node2", "node3"], setup
    (old_member,) = [m for m, node, alive in setup["members"] if node == OLD_MASTER and alive]

    majority = [
        _Producer(cluster, CLIENT_HOST, DIRECT, ["node1", "node2", "node3"]),
        _Producer(cluster, CLIENT_HOST, FORWARDED, ["node2", "node3", "node1"]),
    ]
    beside = _Producer(cluster, NODE_HOSTS[OLD_MASTER], BESIDE, ["node1", "node2", "node3"])
    for producer in (*majority, beside):
        producer.wait_confirmed(BEFORE_CUT, 60, "before the cut")

    watcher = cluster.spawn_driver(
        CLIENT_HOST, "watch-promotion", "one-master", "--nodes", cluster.addresses("node2", "node3"),
        "--not-master", OLD_MASTER, "--deadline", "30", "--out", str(results / "promotion.json"),
    )  # fmt: skip
    time.sleep(1.5)  # the watcher is polling (interpreter start-up is not counted as promotion time)
    cut_at = time.monotonic()
    net.cut(NODE_HOSTS[OLD_MASTER])
    assert watcher.wait(40) == 0, "the promotion watcher failed"
    promotion = json.loads((results / "promotion.json").read_text(encoding="utf-8"))
    _wait_publishing(majority, AFTER_PROMOTION, cut_at + PARTITION_LIMIT)
    time.sleep(max(0.0, cut_at + PARTITION_SECONDS - time.monotonic()))
    at_heal = {p.publisher: p.progress() for p in (*majority, beside)}
    healed_at = time.monotonic()
    net.heal(NODE_HOSTS[OLD_MASTER])

    after_heal = cluster.driver(
        CLIENT_HOST, "one-master", "--nodes", every_node, "--not-master", OLD_MASTER, "--deadline", "40", timeout=90
    )
    old_member_dead = cluster.driver(
        CLIENT_HOST, "member-dead", "--coordinator", cluster.coordinator, "--group", setup["gm_group"],
        "--member", old_member, "--deadline", "20",
    )  # fmt: skip
    probe = cluster.driver(CLIENT_HOST, "probe", "--nodes", cluster.addresses(OLD_MASTER), "--publisher", PROBE)
    produced = {p.publisher: p.finish() for p in (*majority, beside)}

    expect = results / "expect.json"
    confirmed = [[p, seq] for p, result in produced.items() for seq in _confirms(result)]
    _write_json(expect, confirmed + [[PROBE, seq] for seq in range(1, PROBES + 1)])
    cluster.driver(
        CLIENT_HOST, "drain", "--nodes", cluster.addresses("node2", "node3", "node1"), "--expect", str(expect),
        "--deadline", "60", "--out", str(results / "drain.json"), timeout=120,
    )  # fmt: skip
    drained = json.loads((results / "drain.json").read_text(encoding="utf-8"))
    return _Observed(
        setup, cut_at, promotion, healed_at, at_heal, after_heal, old_member_dead, probe, produced, drained
    )


def _log_tails(directory: Path, lines: int = 40) -> Iterator[str]:
    for log in sorted((directory / "logs").glob("*.log")):
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
        yield f"---- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Observed]:
    """One partition run for every test of this module (they judge different guarantees of it)."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the partition test needs network namespaces: {reason}")
    directory = tmp_path_factory.mktemp("partition")
    started = time.monotonic()
    with netns.TestNetwork([COORDINATOR_HOST, *NODE_HOSTS.values(), CLIENT_HOST]) as net:
        try:
            run = _partition(_start(net, directory))
        except BaseException:
            print("\n\n".join(_log_tails(directory)))
            raise
    print(f"\npartition run: {time.monotonic() - started:.1f}s in all; files in {directory}")
    yield run


def test_the_majority_promotes_a_synchronised_mirror(observed: _Observed) -> None:
    master = observed.promotion["master"]
    assert master in observed.setup["synchronised"], f"no new master through node2 and node3: {observed.promotion}"
    print(f"{master} promoted {observed.promoted_in:.2f}s after the cut (failure timeout {FAILURE_TIMEOUT:g}s)")
    assert observed.promoted_in < PROMOTION_LIMIT


def test_the_cut_off_master_confirms_nothing(observed: _Observed) -> None:
    start, end = observed.cut_at, observed.healed_at
    late = observed.confirms_between(BESIDE, start + CUT_MARGIN, end)
    early = observed.confirms_between(BESIDE, start, start + CUT_MARGIN)
    at_heal = observed.at_heal[BESIDE]
    waiting = at_heal["sent"] - at_heal["confirmed"]
    print(
        f"beside the cut-off master: {len(early)} confirms within {CUT_MARGIN}s of the cut, {len(late)} after; "
        f"{waiting} messages waiting for a confirm when the partition healed"
    )
    assert waiting > 0, f"the producer beside node1 published nothing during the cut: {at_heal}"
    assert not late, f"the cut-off master confirmed {len(late)} messages, {late[0] - start:.2f}s after the cut on"


@pytest.mark.parametrize(
    "publisher",
    [
        pytest.param(FORWARDED, id="through-node2"),  # node2 relays it until it is the master itself
        pytest.param(DIRECT, id="through-node1"),  # gRPC keepalive notices the silent node1 (ringq.keepalive)
    ],
)
def test_publishing_goes_on_through_the_new_master(observed: _Observed, publisher: str) -> None:
    promoted, healed = float(observed.promotion["at"]), observed.healed_at
    during = observed.confirms_between(publisher, promoted, healed)
    result = observed.produced[publisher]
    resumed = min(observed.confirms_between(publisher, promoted, float("inf")), default=float("inf"))
    duplicates = sum(o == aio.Outcome.DUPLICATE.value for o, _ in _confirms(result).values())
    print(
        f"{publisher}: {len(during)} confirms between the promotion and the heal, the first after the promotion "
        f"{resumed - observed.cut_at:.2f}s after the cut (healed after {healed - observed.cut_at:.2f}s); "
        f"{result['resends']} resends, {duplicates} DUPLICATE"
    )
    assert len(during) >= AFTER_PROMOTION, f"{publisher} got {len(during)} confirms while node1 was cut off"


def test_after_the_heal_there_is_one_master(observed: _Observed) -> None:
    new_master = observed.promotion["master"]
    after = observed.after_heal
    assert after["master"] == new_master, f"QueueStatus through node1, node2, node3: {after['statuses']}"
    # Through node1 too the answer is the new master's own (forwarded), not a replica left behind on node1.
    assert all(status == after["statuses"][1] for status in after["statuses"]), after["statuses"]
    print(f"every node names {new_master} {after['at'] - observed.healed_at:.2f}s after the heal")
    dead = observed.old_member_dead
    assert dead["dead"], f"the old master's GM member is still alive: {dead['members']}"
    probe = observed.probe
    assert probe["outcomes"] == [aio.Outcome.CONFIRMED.value] * PROBES, f"publishing through node1 alone: {probe}"
    assert probe["master"] == new_master, probe


def test_every_message_is_answered_after_the_heal(observed: _Observed) -> None:
    """Liveness: once healed, every producer gets an answer for every message (within FLUSH_SECONDS of being
    stopped): nothing is left waiting on the old master's replica when it steps aside."""
    for publisher, result in observed.produced.items():
        unanswered = result["unconfirmed"]
        if not unanswered:
            continue
        raise AssertionError(f"{publisher}: {len(unanswered)} messages never answered, e.g. {unanswered[:5]}: {result}")


def test_every_confirmed_message_is_delivered_in_order(observed: _Observed) -> None:
    confirmed = {p: set(_confirms(result)) for p, result in observed.produced.items()}
    confirmed[PROBE] = set(range(1, PROBES + 1))
    history = _check_history(confirmed, observed.drained["deliveries"])
    print(
        f"confirmed { ({p: len(s) for p, s in confirmed.items()}) }; drained {history['deliveries']} deliveries, "
        f"{history['repeats']} repeats, {history['redelivered']} redelivered"
    )
    assert observed.drained["depth_after"] == 0, f"{observed.drained['depth_after']} messages left after the drain"


if __name__ == "__main__":
    driver(sys.argv[1:])
