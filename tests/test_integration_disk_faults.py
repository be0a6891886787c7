"""Integration: what real disks do to durable mirrored queues, with real node processes.

The contract these tests demand (ARCHITECTURE.md section 11, "Integrity"):
1. Damage and cut tails. Every log record is checksummed and every flush ends with a COMMIT record,
   so recovery tells damage (an invalid record that committed records follow) from a torn tail.
   After every node is killed and one replica's log is damaged and another's tail cut, in every
   combination of roles, the replica whose intact log knows most recovers each queue: no confirmed,
   unacknowledged message is lost, an acknowledged one that comes back is flagged redelivered, and
   the damage shows as a "log_damaged" event of the queue.
2. A mirror's disk fills: the mirror leaves the synchronised set once (one "disk_failed" event, no
   loop, the status string does not grow), publishers keep getting confirms, and once the disk is
   freed the mirror re-syncs by itself ("disk_recovered"), with no restart. Nothing confirmed is
   lost, nothing is handed to the application twice.
3. The master's disk fills: nothing is confirmed that is not on the master's disk; publishers are
   held or told why (RESOURCE_EXHAUSTED or UNAVAILABLE, the detail naming the disk and the reason);
   confirms resume once the disk is freed, with no restart; and after killing and restarting every
   node, every message ever confirmed is there.
4. The disk-free limit (`--disk-free-limit-mb`): a node below it refuses persistent publishes to the
   queues it masters with RESOURCE_EXHAUSTED naming the limit, accepts transient ones, and
   `ringqctl cluster_status` shows the alarm.

Small disks are tmpfs mounts over a node's data directory (DIR/data/NODE); the tests that need one
skip, saying why, where mounting is not allowed. Every wait polls a state with a deadline.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from ringq import aio
from ringq.errors import ResourceExhausted
from services import cluster
from tests.clusters import access, scoped
from tests.disks import (
    DISK_FREE_LIMIT_FLAG,
    Damage,
    Demands,
    SmallDisk,
    SteadyPublisher,
    connect,
    cut_tail,
    damage_middle_record,
    declare_on,
    disk_alarm_off,
    drain,
    events_of,
    logged_messages,
    newest_segment,
    node_accepts,
    queue_log_dir,
    small_disk,
    start_cluster,
    until,
    watch,
)
from tests.test_integration_durable import _on_a_cluster
from tests.test_ringqctl_queues import as_json, ok

pytestmark = pytest.mark.integration
NODES = ("node1", "node2", "node3")
SERVE_AGAIN_S = 40.0
DRAIN_S = 60.0


def _kill_every_node(directory: Path) -> None:
    cluster.kill_together(directory, NODES, signal.SIGKILL)


def _restart_every_node(directory: Path) -> cluster.ClusterInfo:
    for node in NODES:
        cluster.start_node(directory, node)
    return cluster.load(directory)


async def _serving(client: aio.Connection, queue: str) -> bool:
    status = await client.queue_status(queue)
    return status.status.startswith("running")


async def _gm_groups(info: cluster.ClusterInfo) -> dict[str, str]:
    admin = aio.Admin(info.node_addresses, **access(info))
    try:
        return {record.name: record.gm_group for record in await admin.list_queues()}
    finally:
        await admin.close()


# --------------------------------------------------------------------------- 1. damage and cut tails

ROLES = ("master", "mirror-a", "mirror-b")
PUBLISHED = 3_000
ACKED = 1_000  # the first ACKED of each queue, acknowledged before the kill
CUT_BYTES = 5


@dataclass
class _Combination:
    """One queue of the scenario: which replica's log is damaged, which one's tail is cut."""

    damaged: str  # a role
    cut: str  # another role
    queue: str
    nodes: dict[str, str]  # role -> node, once mirrored
    acked: set[int]
    damage: Damage | None = None


def _combinations() -> list[_Combination]:
    pairs = [(damaged, cut) for damaged in ROLES for cut in ROLES if damaged != cut]
    return [_Combination(d, c, f"ha.damaged-{d}.cut-{c}", {}, set()) for d, c in pairs]


async def _publish_and_acknowledge(client: aio.Connection, combination: _Combination) -> None:
    """PUBLISHED persistent messages confirmed, the first ACKED acknowledged (applied on the master),
    then a persistent marker confirmed: the master's log holds the acknowledgement before it."""
    queue = combination.queue
    producer = client.producer(queue, publisher_id="orders", persistent=True, window=1000, batch=100)
    outcomes = await producer.publish_many([b"%06d" % i for i in range(PUBLISHED)])
    assert outcomes == [aio.Outcome.CONFIRMED] * PUBLISHED, f"{queue}: not every message was confirmed"
    consumer = client.consumer(queue, prefetch=ACKED)
    async for delivery in consumer:
        combination.acked.add(delivery.seq)
        if len(combination.acked) == ACKED:
            assert delivery.ack(multiple=True)
            break

    async def acks_applied() -> bool:
        return (await client.queue_status(queue)).depth == PUBLISHED - ACKED

    await until(acks_applied, 10, f"{queue}: the master applied the acknowledgements")
    marker = client.producer(queue, publisher_id="marker", persistent=True)
    assert await marker.publish(b"marker") == aio.Outcome.CONFIRMED
    await consumer.close()


def _judge_recovery(
    info: cluster.ClusterInfo, demands: Demands, combination: _Combination, deliveries: list[aio.Delivery]
) -> tuple[int, int]:
    """Check one queue's drained deliveries; (lost, acknowledged ones that came back)."""
    queue = combination.queue
    orders = scoped(info, "orders")  # as deliveries show the publisher
    unacknowledged = {(orders, seq) for seq in range(1, PUBLISHED + 1) if seq not in combination.acked}
    expected = unacknowledged | {(scoped(info, "marker"), 1)}
    delivered = {(d.publisher, d.seq) for d in deliveries}
    lost = sorted(expected - delivered)
    demands.check(
        not lost,
        f"{queue}: {len(lost)} confirmed, unacknowledged messages lost (first {lost[:3]}; "
        f"damaged record carried {combination.damage.message if combination.damage else None})",
    )
    returned = [d for d in deliveries if d.publisher == orders and d.seq in combination.acked]
    unflagged = [d.seq for d in returned if not d.redelivered]
    demands.check(not unflagged, f"{queue}: acknowledged messages came back not flagged redelivered: {unflagged[:5]}")
    return len(lost), len(returned)


async def _mirrored_and_filled(info: cluster.ClusterInfo, combinations: list[_Combination]) -> None:
    """Each combination's queue declared through its own master (node1, node2, node3 in turn), both
    mirrors synchronised (which tells the roles' nodes), published to and partly acknowledged."""
    client = connect(info)
    for index, combination in enumerate(combinations):
        await declare_on(info, NODES[index % len(NODES)], combination.queue)
    for combination in combinations:

        async def mirrored(queue: str = combination.queue) -> bool:
            return len((await client.queue_status(queue)).synchronised_mirrors) == 2

        await until(mirrored, 20, f"{combination.queue}: both mirrors synchronised")
        status = await client.queue_status(combination.queue)
        combination.nodes = dict(zip(ROLES, (status.master_node, *status.mirrors), strict=True))
    await asyncio.gather(*(_publish_and_acknowledge(client, c) for c in combinations))
    await client.close()


def _damage_and_cut(directory: Path, combinations: list[_Combination], groups: dict[str, str]) -> None:
    """With every node down: one byte flipped in the damaged replica's log, the cut replica's tail cut."""
    for combination in combinations:
        group = groups[combination.queue]
        damaged_log = queue_log_dir(directory, combination.nodes[combination.damaged], combination.queue, group)
        combination.damage = damage_middle_record(newest_segment(damaged_log))
        cut_tail(
            newest_segment(queue_log_dir(directory, combination.nodes[combination.cut], combination.queue, group)),
            CUT_BYTES,
        )


async def _judge_damage_reports(demands: Demands, client: aio.Connection, combinations: list[_Combination]) -> None:
    """Each queue's events name its damaged replica's node in a "log_damaged" event."""

    async def reported(combination: _Combination) -> bool:
        status = await client.queue_status(combination.queue)
        return bool(events_of(status, "log_damaged", combination.nodes[combination.damaged]))

    async def every_one_reported() -> bool:
        return all(await asyncio.gather(*(reported(c) for c in combinations)))

    if await demands.eventually(until(every_one_reported, 10, "waited"), "a log_damaged event for every queue"):
        return
    for combination in combinations:
        demands.check(
            await reported(combination),
            f"{combination.queue}: a log_damaged event from {combination.nodes[combination.damaged]} "
            f"({combination.damaged}), whose log has a flipped byte: {combination.damage}",
        )


async def _damage_and_cut_every_combination(directory: Path) -> dict[str, float]:
    demands = Demands()
    info = await start_cluster(directory, ["--recovery-wait-ms", "2000"])
    combinations = _combinations()
    await _mirrored_and_filled(info, combinations)
    groups = await _gm_groups(info)
    _kill_every_node(directory)
    _damage_and_cut(directory, combinations, groups)
    restarted = time.monotonic()
    client = connect(_restart_every_node(directory))
    for combination in combinations:
        await demands.wait(
            until(functools.partial(_serving, client, combination.queue), SERVE_AGAIN_S, combination.queue),
            f"{combination.queue} serves again after the restart",
        )
    figures = {"back_after": time.monotonic() - restarted}
    drained = await asyncio.gather(*(drain(client, c.queue, DRAIN_S) for c in combinations))
    for combination, deliveries in zip(combinations, drained, strict=True):
        lost, returned = _judge_recovery(info, demands, combination, deliveries)
        figures[f"{combination.queue} lost"] = lost
        figures[f"{combination.queue} acknowledged and back"] = returned
    await _judge_damage_reports(demands, client, combinations)
    await client.close()
    print(figures)
    demands.settle()
    return figures


def test_damaged_and_cut_logs_in_every_combination_of_roles_lose_no_confirmed_message(tmp_path: Path) -> None:
    figures = _on_a_cluster(tmp_path, _damage_and_cut_every_combination)
    print(f"every queue served again {figures['back_after']:.1f}s after every node was restarted")


# --------------------------------------------------------------------------- 2. and 3. full disks

SMALL_DISK_MIB = 32
PER_SECOND = 500  # the steady publisher's pace, messages a second
FULL_FOR_S = 5.0  # how long a full disk is watched
LONGEST_WAIT_S = 5.0  # the longest a publisher may go without a confirm while a mirror's disk is full
ANSWERED_S = 30.0  # how long the messages of a stopped publisher may take to be confirmed or refused
DISK_QUEUE = "ha.disk"


async def _mirrored_queue(info: cluster.ClusterInfo, client: aio.Connection) -> None:
    """DISK_QUEUE, mastered on node1, with both mirrors synchronised."""
    await declare_on(info, "node1", DISK_QUEUE)

    async def mirrored() -> bool:
        return len((await client.queue_status(DISK_QUEUE)).synchronised_mirrors) == 2

    await until(mirrored, 20, f"{DISK_QUEUE}: both mirrors synchronised")


def _judge_drained(demands: Demands, publisher: SteadyPublisher, deliveries: list[aio.Delivery]) -> None:
    """Every confirmed message delivered (lost = 0); none handed to the application twice."""
    counts = Counter((d.publisher, d.seq) for d in deliveries)
    lost = sorted(seq for seq in publisher.ledger.confirmed if (publisher.producer.scoped_id, seq) not in counts)
    demands.check(not lost, f"{len(lost)} confirmed messages lost (first {lost[:5]})")
    twice = sorted(key for key, count in counts.items() if count > 1)
    demands.check(not twice, f"{len(twice)} messages handed to the application more than once (first {twice[:5]})")


async def _mirror_disk_fills(directory: Path, disk: SmallDisk, mirror: str) -> dict[str, float]:
    demands = Demands()
    info = await start_cluster(directory, disk_alarm_off())
    client = connect(info)
    await _mirrored_queue(info, client)
    producer = client.producer(DISK_QUEUE, publisher_id="steady", persistent=True)
    async with SteadyPublisher(producer, PER_SECOND) as publisher:
        await publisher.confirmed_at_least(PER_SECOND, 10, "confirms flow before the disk fills")
        async with disk.kept_full():

            async def mirror_left() -> bool:
                return mirror not in (await client.queue_status(DISK_QUEUE)).synchronised_mirrors

            await demands.wait(until(mirror_left, 20, "mirror left"), f"{mirror}, its disk full, leaves the set")
            baseline = (await client.queue_status(DISK_QUEUE)).status
            watched_from = time.monotonic()
            statuses = await watch(client, DISK_QUEUE, FULL_FOR_S)
            longest = max((s.status for s in statuses), key=len, default=baseline)
            failures = max((len(events_of(s, "disk_failed", mirror)) for s in statuses), default=0)
            confirmed_while_full = publisher.ledger.confirmed_between(watched_from, time.monotonic())
            assert disk.full_since is not None
            longest_wait = publisher.ledger.longest_wait(disk.full_since, time.monotonic())
        demands.check(
            longest_wait <= LONGEST_WAIT_S,
            f"the master stops waiting for a full disk: publishers waited {longest_wait:.1f} s for a confirm",
        )
        demands.check(
            confirmed_while_full >= PER_SECOND * FULL_FOR_S / 4,
            f"publishers keep being confirmed while a mirror's disk is full: {confirmed_while_full} "
            f"confirmed in {FULL_FOR_S:g} s at {PER_SECOND}/s offered",
        )
        demands.check(failures == 1, f"one disk_failed event from {mirror} over {FULL_FOR_S:g} s full, not {failures}")
        demands.check(len(longest) <= len(baseline), f"the status string grew from {baseline!r} to {longest!r}")

        async def mirror_back() -> bool:
            return mirror in (await client.queue_status(DISK_QUEUE)).synchronised_mirrors

        freed = time.monotonic()
        await demands.eventually(until(mirror_back, 30, "back"), f"{mirror} re-syncs by itself once its disk is freed")
        back_after = time.monotonic() - freed
        status = await client.queue_status(DISK_QUEUE)
        demands.check(bool(events_of(status, "disk_recovered", mirror)), f"a disk_recovered event from {mirror}")
        await demands.wait(publisher.answered(ANSWERED_S), "every message published is answered")
    refused = publisher.ledger.refused
    demands.check(not refused, f"{len(refused)} publishes refused (first: {next(iter(refused.items()), None)})")
    _judge_drained(demands, publisher, await drain(client, DISK_QUEUE, DRAIN_S))
    await client.close()
    demands.settle()
    return {"synchronised_again_after": back_after, "longest_wait": longest_wait}


def test_a_mirror_whose_disk_fills_leaves_once_and_resyncs_by_itself_once_freed(tmp_path: Path) -> None:
    mirror = "node3"  # DISK_QUEUE is mastered on node1 and mirrored on node2 and node3
    with small_disk(tmp_path / "cluster" / "data" / mirror, SMALL_DISK_MIB) as disk:
        figures = _on_a_cluster(tmp_path, lambda directory: _mirror_disk_fills(directory, disk, mirror))
    print(
        f"publishers waited at most {figures['longest_wait']:.1f}s for a confirm while the mirror's disk was full; "
        f"synchronised again {figures['synchronised_again_after']:.1f}s after it was freed"
    )


def _clear_refusal(code: grpc.StatusCode, details: str) -> bool:
    """RESOURCE_EXHAUSTED or UNAVAILABLE, with a detail that names the disk and why it failed."""
    text = details.lower()
    reason = any(word in text for word in ("space", "full", "enospc", "read-only", "erofs"))
    return code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE) and "disk" in text and reason


async def _master_disk_fills(directory: Path, disk: SmallDisk) -> dict[str, float]:
    demands = Demands()
    info = await start_cluster(directory, disk_alarm_off())
    client = connect(info, retry_for=5.0)  # a refusal the producer retries surfaces after 5 s
    await _mirrored_queue(info, client)
    group = (await _gm_groups(info))[DISK_QUEUE]
    producer = client.producer(DISK_QUEUE, publisher_id="steady", persistent=True)
    async with SteadyPublisher(producer, PER_SECOND) as publisher:
        ledger = publisher.ledger
        await publisher.confirmed_at_least(PER_SECOND, 10, "confirms flow before the disk fills")
        async with disk.kept_full():
            # Records that still fit in the pages the log's file already has may land: confirms stop soon after.
            async def stalled() -> bool:
                return time.monotonic() - ledger.last_confirm() >= 1.0

            await demands.wait(until(stalled, 15, "stalled"), "confirms stop once the master's disk is full")
            held = len(ledger.confirmed)
            statuses = await watch(client, DISK_QUEUE, FULL_FOR_S)
            demands.check(
                len(ledger.confirmed) == held,
                f"{len(ledger.confirmed) - held} persistent publishes confirmed while the master's disk was full "
                f"(the queue said {statuses[-1].status if statuses else None!r})",
            )
            on_disk = logged_messages(queue_log_dir(directory, "node1", DISK_QUEUE, group))
            not_on_disk = {(producer.scoped_id, seq) for seq in ledger.confirmed} - on_disk
            demands.check(not not_on_disk, f"{len(not_on_disk)} confirmed messages are not on the master's disk")
            unclear = sorted({(code.name, details) for code, details in ledger.refused.values()})
            unclear = [
                (code, details) for code, details in unclear if not _clear_refusal(grpc.StatusCode[code], details)
            ]
            demands.check(not unclear, f"publishers refused without a clear status: {unclear[:3]}")
        freed = time.monotonic()
        resumed = await demands.eventually(
            publisher.confirmed_at_least(held + PER_SECOND, 30, "resumed"),
            "confirms resume once the master's disk is freed, with no restart",
        )
        resumed_after = time.monotonic() - freed
        if resumed:
            await demands.eventually(publisher.answered(ANSWERED_S), "every message held while full is answered")
    _kill_every_node(directory)
    await client.close()  # after the kill: a producer still holding messages gives up on them within retry_for
    client = connect(_restart_every_node(directory))
    await demands.wait(
        until(functools.partial(_serving, client, DISK_QUEUE), SERVE_AGAIN_S, "serving"), "serves after restart"
    )
    _judge_drained(demands, publisher, await drain(client, DISK_QUEUE, DRAIN_S))
    await client.close()
    demands.settle()
    return {"resumed_after": resumed_after, "refused": len(ledger.refused)}


def test_the_master_confirms_nothing_while_its_disk_is_full_and_resumes_once_freed(tmp_path: Path) -> None:
    with small_disk(tmp_path / "cluster" / "data" / "node1", SMALL_DISK_MIB) as disk:
        figures = _on_a_cluster(tmp_path, lambda directory: _master_disk_fills(directory, disk))
    print(f"confirms resumed {figures['resumed_after']:.1f}s after the disk was freed; {figures['refused']} refused")


# --------------------------------------------------------------------------- 4. the disk-free limit

LIMIT_MIB = 64  # above what node1's small disk ever has free
LIMITED_DISK_MIB = 16


def _alarm(node: dict[str, object]) -> bool:
    """Whether a node's entry of ClusterStatus (as JSON) says its disk alarm is on."""
    return any(value for key, value in node.items() if "alarm" in key.lower())


async def _below_the_disk_free_limit(directory: Path) -> dict[str, float]:
    info = await start_cluster(directory, [DISK_FREE_LIMIT_FLAG, str(LIMIT_MIB)])
    admin = aio.Admin(info.node_addresses, **access(info))

    async def alarm_on_node1() -> bool:
        return (await admin.cluster_status()).node("node1").disk_alarm

    try:
        await until(alarm_on_node1, 15, "node1's disk alarm in ClusterStatus")
    finally:
        await admin.close()
    await declare_on(info, "node1", "limit.on-node1")
    await declare_on(info, "node2", "limit.on-node2")
    client = connect(info)
    with pytest.raises(ResourceExhausted) as refused:
        await client.producer("limit.on-node1", persistent=True).publish(b"persistent")
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "limit" in refused.value.details and str(LIMIT_MIB) in refused.value.details
    assert await client.producer("limit.on-node1").publish(b"transient") == aio.Outcome.CONFIRMED
    assert await client.producer("limit.on-node2", persistent=True).publish(b"elsewhere") == aio.Outcome.CONFIRMED
    await client.close()
    shown = {n["node"]: n for n in as_json(info, "cluster_status")["nodes"]}
    assert _alarm(shown["node1"]) and not _alarm(shown["node2"]), shown
    assert "alarm" in ok(info, "cluster_status").lower()
    return {}


@pytest.mark.xfail(
    not node_accepts(DISK_FREE_LIMIT_FLAG),
    reason=f"nodes do not take {DISK_FREE_LIMIT_FLAG} on this branch (branch coordinator-integrity adds it): "
    "the test runs and must fail to start its cluster; it is enabled by itself once the flag is merged",
    raises=cluster.ClusterError,
    strict=True,
)
def test_a_node_below_its_disk_free_limit_refuses_persistent_publishes_only(tmp_path: Path) -> None:
    with small_disk(tmp_path / "cluster" / "data" / "node1", LIMITED_DISK_MIB):
        _on_a_cluster(tmp_path, _below_the_disk_free_limit)
