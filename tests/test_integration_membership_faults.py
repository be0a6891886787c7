"""Fault tests with real processes: membership changes must leave a mirrored queue whole.

Each test starts a coordinator and three nodes on 127.0.0.1 (services/cluster.py), every queue named
ha.* mirrored on every node, and drives one fault with signals (SIGSTOP, SIGCONT, SIGKILL). Each one
is the acceptance test of a rule (ARCHITECTURE.md sections 3 and 11):

1. A publisher cut off mid-step leaves nothing behind. A consumer with prefetch 2 is attached; one
   mirror's node is paused (SIGSTOP, well inside a long failure timeout), so every step waits for the
   ring; a publisher sends batches and cancels its stream while their steps wait; the mirror resumes.
   Every message the queue accepted reaches the consumer, nothing stays pending acknowledgement, and
   the consumer's prefetch slots are free again (it receives later messages too).
2. A whole-cluster restart records no live member dead. A durable queue with confirmed persistent
   messages; every node SIGKILLed; the node of the last master started first and, once its replica has
   claimed the queue (it waits for the replicas the record lists as synchronised, to elect the one whose
   log knows most), the others. Twice. The master stays, the queue serves every message, and no member of a
   running process is ever recorded dead: neither in the group table (every version of it, from the
   coordinator's Watch) nor in a node's log (`recorded MEMBER dead (reason: ...)`, logger ringq.member).
3. A mirror struck from the record comes back by itself. One mirror's node is paused past the ring's
   failure timeout (well inside the coordinator's liveness timeout), so its member is recorded dead and
   the master strikes it from the queue record; then it resumes. With no policy change it is back among
   the mirrors, synchronised, within a deadline.

Every wait polls a state against a deadline; nothing sleeps a fixed time. Cases 1 and 3 failed before the
queue replica became a pure core driven by its shell and the coordinator re-placed queues on record changes.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from google.protobuf import text_format
from google.protobuf.message import Message

from ringq import aio
from ringq.errors import RingqError
from ringq.internal.v1 import coordinator_pb2, coordinator_pb2_grpc
from ringq.models import QueueRecord, QueueStatus
from ringq.v1 import queue_pb2
from services import cluster
from tests.clusters import NODE_ARGS, access, cluster_ports, connection, coordinator_channel, live_cluster, scoped

pytestmark = pytest.mark.integration

_Answer = TypeVar("_Answer")
POLL_SECONDS = 0.05
SCENARIO_LIMIT_SECONDS = 120.0
# How long a queue may take to settle after a fault is over (generous: a loaded 2-core machine).
SETTLE_SECONDS = 20.0
# The coordinator's default liveness timeout (services/coordinator/server.py): a paused node must be
# resumed well before it, or the coordinator would re-place the queue for its own reasons.
COORDINATOR_LIVENESS_SECONDS = 5.0
# Case 1: the ring's failure timeout is far longer than the pause, so nobody is recorded dead.
PATIENT_NODE_ARGS = ["--failure-timeout-ms", "10000", "--heartbeat-interval-ms", "100", "--grace-ms", "100"]
PREFETCH = 2
CUT_OFF_BATCHES = 5
CUT_OFF_BATCH_SIZE = 2
# Case 2.
RESTARTS = 2
MESSAGES_PER_ROUND = 300
RECORDED_DEAD = re.compile(r" ringq\.member INFO recorded (\S+) dead \(reason: ")


def _describe(answer: object) -> str:
    if isinstance(answer, Message):
        return f"{type(answer).__name__}({text_format.MessageToString(answer, as_one_line=True)})"
    return repr(answer)


async def _eventually(
    probe: Callable[[], Awaitable[_Answer]], done: Callable[[_Answer], bool], seconds: float, what: str
) -> _Answer:
    """Ask `probe` until `done` holds for its answer (an RPC error counts as not yet); AssertionError
    saying `what` was awaited, with the last answer, once `seconds` have passed."""
    deadline = time.monotonic() + seconds
    last = "no answer"
    while True:
        try:
            answer = await probe()
        except grpc.aio.AioRpcError as error:
            last = f"{error.code().name}: {error.details()}"
        except RingqError as error:
            last = str(error)
        else:
            if done(answer):
                return answer
            last = _describe(answer)
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not so within {seconds:g} s; last: {last}")
        await asyncio.sleep(POLL_SECONDS)


async def _queue_record(admin: aio.Admin, queue: str) -> QueueRecord:
    (record,) = [record for record in await admin.list_queues() if record.name == queue]
    return record


async def _read_group(info: cluster.ClusterInfo, group: str) -> coordinator_pb2.ReadGroupResponse:
    async with coordinator_channel(info) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        response: coordinator_pb2.ReadGroupResponse = await stub.ReadGroup(
            coordinator_pb2.ReadGroupRequest(group=group), timeout=5.0
        )
    return response


async def _declared_and_synchronised(connection: aio.Connection, queue: str, durable: bool) -> QueueStatus:
    """Declare `queue` through the connection's first node (its master) and wait until both mirrors are
    synchronised."""
    await connection.declare_queue(queue, durable=durable)
    return await _eventually(
        lambda: connection.queue_status(queue),
        lambda status: len(status.synchronised_mirrors) == 2,
        SETTLE_SECONDS,
        f"{queue} declared with both mirrors synchronised",
    )


def _run(
    directory: Path,
    node_args: list[str],
    scenario: Callable[[Path, cluster.ClusterInfo], Awaitable[None]],
    nodes: int = 3,
) -> None:
    with live_cluster(directory, nodes=nodes, node_args=node_args) as info:
        asyncio.run(asyncio.wait_for(scenario(directory, info), SCENARIO_LIMIT_SECONDS))


# ================================================================= 1. a publisher cut off mid-step


class _AckingConsumer:
    """A consumer that acknowledges each delivery as it comes and remembers what it received."""

    def __init__(self, connection: aio.Connection, queue: str, prefetch: int) -> None:
        self.consumer = connection.consumer(queue, prefetch=prefetch)
        self.received: list[tuple[str, int]] = []
        self._task = asyncio.ensure_future(self._consume())

    async def _consume(self) -> None:
        async for delivery in self.consumer:
            self.received.append((delivery.publisher, delivery.seq))
            delivery.ack()

    def seqs_of(self, publisher: str) -> list[int]:
        return [seq for who, seq in self.received if who == publisher]

    async def wait_for(self, publisher: str, seqs: Iterable[int], what: str) -> None:
        wanted = sorted(seqs)

        async def received() -> list[int]:
            return sorted(self.seqs_of(publisher))

        await _eventually(received, lambda got: got == wanted, SETTLE_SECONDS, what)

    async def close(self) -> None:
        await self.consumer.close()
        self._task.cancel()


async def _publisher_cut_off(directory: Path, info: cluster.ClusterInfo) -> None:
    on_master = connection(info, "node1")
    queue = "ha.cut-off"
    await _declared_and_synchronised(on_master, queue, durable=False)
    consumer = _AckingConsumer(on_master, queue, PREFETCH)
    before = on_master.producer(queue, publisher_id="before")
    assert await before.publish_many([b"before 1", b"before 2"]) == [aio.Outcome.CONFIRMED] * 2
    await consumer.wait_for(before.scoped_id, [1, 2], "the consumer received the messages published before the fault")
    await _eventually(lambda: on_master.queue_status(queue), lambda s: s.depth == 0, SETTLE_SECONDS, "acks applied")

    accepted = CUT_OFF_BATCHES * CUT_OFF_BATCH_SIZE
    cluster.kill(directory, "node3", signal.SIGSTOP)
    try:
        call = on_master.stub().Publish()
        for batch in range(CUT_OFF_BATCHES):
            first = batch * CUT_OFF_BATCH_SIZE + 1
            messages = [
                queue_pb2.OutgoingMessage(body=b"cut-off %d" % seq, seq=seq)
                for seq in range(first, first + CUT_OFF_BATCH_SIZE)
            ]
            await call.write(
                queue_pb2.PublishRequest(queue=on_master.ref(queue), publisher="cut-off", messages=messages)
            )
        # Every batch is decided (accepted, the first two handed to the consumer) and waits for node3.
        await _eventually(
            lambda: on_master.queue_status(queue),
            lambda s: s.depth == accepted and s.unacked == PREFETCH,
            SETTLE_SECONDS,
            f"the master decided the {accepted} messages while node3 is paused",
        )
        call.cancel()
        # The cancellation went out on the connection ahead of this call: the master has seen it.
        await on_master.queue_status(queue)
    finally:
        cluster.kill(directory, "node3", signal.SIGCONT)

    try:
        await consumer.wait_for(
            scoped(info, "cut-off"),
            range(1, accepted + 1),
            f"the consumer received all {accepted} messages the queue accepted",
        )
    except AssertionError as error:
        status = await on_master.queue_status(queue)
        raise AssertionError(f"{error}\nthe queue now: {_describe(status)}") from None
    await _eventually(
        lambda: on_master.queue_status(queue),
        lambda s: s.depth == 0 and s.unacked == 0,
        SETTLE_SECONDS,
        "every message acknowledged, none left pending acknowledgement",
    )
    after = on_master.producer(queue, publisher_id="after")
    assert await after.publish_many([b"after 1", b"after 2", b"after 3"]) == [aio.Outcome.CONFIRMED] * 3
    await consumer.wait_for(
        after.scoped_id, [1, 2, 3], "the consumer's prefetch slots are free: later messages reach it"
    )
    await consumer.close()
    await on_master.close()


def test_a_publisher_cut_off_mid_step_leaves_nothing_behind(tmp_path: Path) -> None:
    _run(tmp_path / "cluster", PATIENT_NODE_ARGS, _publisher_cut_off)


# ============================================================ 2. a whole-cluster restart


class _GroupHistory:
    """Every version of one GM group's table, as the coordinator's Watch streams them (from its first)."""

    def __init__(self, info: cluster.ClusterInfo, group: str) -> None:
        self.info = info
        self.group = group
        self.versions: list[coordinator_pb2.WatchResponse] = []
        self.missed = False  # the coordinator no longer had some changes: the history has a hole
        self._channel = coordinator_channel(info)
        self._task = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        async for event in stub.Watch(coordinator_pb2.WatchRequest(kinds=["group"], after_revision=1)):
            self.missed |= event.resync
            if event.key == self.group and not event.deleted:
                self.versions.append(event)

    async def caught_up(self) -> None:
        """Wait until the history holds the group's version as ReadGroup gives it now."""
        current = (await _read_group(self.info, self.group)).group.version

        async def newest() -> int:
            assert not self._task.done(), f"the group watch ended: {self._task}"
            return max((event.group.version for event in self.versions), default=0)

        await _eventually(newest, lambda version: version >= current, SETTLE_SECONDS, "the group watch caught up")

    def recorded_dead(self, except_members: set[str]) -> list[str]:
        """Each member outside `except_members` that some version of the table records dead."""
        dead = [
            f"{member.id} (on {member.node}, group version {event.group.version})"
            for event in self.versions
            for member in event.group.members
            if not member.alive and member.id not in except_members
        ]
        return list(dict.fromkeys(dead))

    async def close(self) -> None:
        self._task.cancel()
        await self._channel.close(None)


def _log_sizes(info: cluster.ClusterInfo) -> dict[Path, int]:
    return {node.log: node.log.stat().st_size for node in info.nodes}


def _logged_dead_since(sizes: dict[Path, int], except_members: set[str]) -> list[str]:
    """Death records logged since `sizes` (per node log) naming a member outside `except_members`."""
    found = []
    for log, size in sizes.items():
        with open(log, "rb") as lines:
            lines.seek(size)
            for line in lines.read().decode("utf-8", "replace").splitlines():
                match = RECORDED_DEAD.search(line)
                if match is not None and match.group(1) not in except_members:
                    found.append(f"{log.name}: {line.strip()}")
    return found


async def _restart_master_first(
    directory: Path, master: str, ports: dict[str, tuple[int, int]], queue: str, messages: int, what: str
) -> tuple[cluster.ClusterInfo, aio.Connection, QueueStatus]:
    """SIGKILL every node at once; start `master`'s node, wait until its replica has said in the record how far its
    log goes (it waits for the replicas the record lists as synchronised before one of them recovers the
    queue), start the others; each node on its ports of before (client, cluster). Returns once the queue
    serves every message with both mirrors synchronised: the cluster, a connection to every node, the queue's
    status then."""
    cluster.kill_together(directory, list(ports), signal.SIGKILL)
    cluster.start_node(directory, master, port=ports[master][0], cluster_port=ports[master][1])
    restarted = cluster.load(directory)
    admin = aio.Admin(restarted.node_addresses, **access(restarted))
    await _eventually(
        lambda: _queue_record(admin, queue),
        lambda record: master in record.recovery_positions,
        SETTLE_SECONDS,
        f"{what}: {master}, started alone, claims the queue",
    )
    await admin.close()
    for name, (port, peers_port) in ports.items():
        if name != master:
            cluster.start_node(directory, name, port=port, cluster_port=peers_port)
    info = cluster.load(directory)
    client = connection(info, *ports)
    status = await _eventually(
        lambda: client.queue_status(queue),
        lambda status: status.depth == messages and len(status.synchronised_mirrors) == 2,
        SETTLE_SECONDS,
        f"{what}: every message served, both mirrors synchronised again",
    )
    return info, client, status


async def _restart_every_node(directory: Path, info: cluster.ClusterInfo) -> None:
    queue = "ha.restarted"
    client = connection(info, "node1", "node2", "node3")
    master = (await _declared_and_synchronised(client, queue, durable=True)).master_node
    admin = aio.Admin(info.node_addresses, **access(info))
    group = (await _queue_record(admin, queue)).gm_group
    history = _GroupHistory(info, group)
    # Each node comes back on its addresses of before, as a restarted server does: peers' channels to it
    # (to its cluster port) remember the attempts that failed while it was down.
    peers_ports = await cluster_ports(info)
    ports = {node.name: (int(node.address.rsplit(":", 1)[1]), peers_ports[node.name]) for node in info.nodes}
    killed: set[str] = set()  # members of the processes SIGKILLed so far: they may well be recorded dead
    for restart in range(1, RESTARTS + 1):
        producer = client.producer(queue, publisher_id=f"before-restart-{restart}", persistent=True)
        bodies = [b"%d" % seq for seq in range(MESSAGES_PER_ROUND)]
        assert await producer.publish_many(bodies) == [aio.Outcome.CONFIRMED] * MESSAGES_PER_ROUND
        await client.close()
        killed |= {member.id for member in (await _read_group(info, group)).group.members}
        sizes = _log_sizes(info)
        what = f"restart {restart}"
        try:
            info, client, status = await _restart_master_first(
                directory, master, ports, queue, restart * MESSAGES_PER_ROUND, what
            )
        finally:  # what the nodes recorded explains a failure to come back: it is judged first
            await history.caught_up()
            assert not history.missed, "the group watch missed changes"
            recorded = history.recorded_dead(except_members=killed)
            assert not recorded, f"{what}: members of running processes recorded dead: {recorded}"
            logged = _logged_dead_since(sizes, except_members=killed)
            assert not logged, f"{what}: a node's log records a member of a running process dead: {logged}"
        assert status.master_node == master, f"{what}: the master moved to {status.master_node}"

    consumer = _AckingConsumer(client, queue, prefetch=100)
    for restart in range(1, RESTARTS + 1):
        publisher = scoped(info, f"before-restart-{restart}")
        await consumer.wait_for(publisher, range(1, MESSAGES_PER_ROUND + 1), f"every message of {publisher} delivered")
        seqs = consumer.seqs_of(publisher)
        assert seqs == sorted(seqs), f"the messages of {publisher} came out of order"
    await consumer.close()
    await client.close()
    await history.close()
    await admin.close()


def test_a_whole_cluster_restart_records_no_live_member_dead(tmp_path: Path) -> None:
    _run(tmp_path / "cluster", NODE_ARGS, _restart_every_node)


# ============================================================ 3a. a mirror struck from the record


async def _struck_mirror_returns(directory: Path, info: cluster.ClusterInfo) -> None:
    queue = "ha.struck"
    admin = aio.Admin(info.node_addresses, **access(info))
    first = connection(info, "node1")
    await first.declare_queue(queue)  # on node1 and node2, the nodes live now
    await first.close()
    # node3 joins the cluster: the coordinator's pass over the live nodes places a mirror on it. That pass
    # runs when the set of live nodes changes, and only then: it does not run again during the fault below.
    cluster.start_node(directory, "node3")
    info = cluster.load(directory)
    await _eventually(
        lambda: _queue_record(admin, queue),
        lambda record: list(record.mirrors) == ["node2", "node3"],
        SETTLE_SECONDS,
        "the coordinator placed a mirror on node3 once it joined",
    )
    client = connection(info, "node1", "node2", "node3")
    await _eventually(
        lambda: client.queue_status(queue),
        lambda status: len(status.synchronised_mirrors) == 2,
        SETTLE_SECONDS,
        "both mirrors synchronised",
    )
    published = 200
    producer = client.producer(queue, publisher_id="before")
    assert await producer.publish_many([b"%d" % seq for seq in range(published)]) == [aio.Outcome.CONFIRMED] * published
    policies = await admin.list_policies()

    paused_at = time.monotonic()
    cluster.kill(directory, "node3", signal.SIGSTOP)
    try:
        await _eventually(
            lambda: _queue_record(admin, queue),
            lambda record: "node3" not in record.mirrors,
            COORDINATOR_LIVENESS_SECONDS / 2,
            "the master struck the paused node3 from the queue record",
        )
    finally:
        cluster.kill(directory, "node3", signal.SIGCONT)
    paused_for = time.monotonic() - paused_at
    assert paused_for < COORDINATOR_LIVENESS_SECONDS / 2, f"node3 was paused {paused_for:.1f} s"

    status = await _eventually(
        lambda: client.queue_status(queue),
        lambda s: "node3" in s.mirrors and "node3" in s.synchronised_mirrors and s.depth == published,
        SETTLE_SECONDS,
        f"node3 (paused {paused_for:.1f} s) back among the mirrors, synchronised, by itself",
    )
    assert sorted(status.synchronised_mirrors) == ["node2", "node3"], _describe(status)
    assert await admin.list_policies() == policies, "the policies changed"
    await admin.close()
    await client.close()


def test_a_mirror_struck_from_the_record_comes_back_by_itself(tmp_path: Path) -> None:
    _run(tmp_path / "cluster", NODE_ARGS, _struck_mirror_returns, nodes=2)
