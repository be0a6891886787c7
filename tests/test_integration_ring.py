"""Integration: a GM ring of real node processes on loopback, through a kill and a join.

Two members (on node1 and node2) broadcast 100,000 messages between them with
confirms while node3, hosting a third member, is killed with SIGKILL, and a
fourth member joins on a node started half way. Checked: every survivor
delivers each publisher's messages consecutively, with exactly the body the
publisher was told had that sequence number (identical sequences, no holes,
no duplicates); the joiner delivers everything published after its join; the
survivors are told of the killed member's death.

`RINGQ_INTEGRATION_RUNS=10 pytest tests/test_integration_ring.py` repeats it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from ringq.errors import RingqError
from ringq.group import DeliveryCheck, GroupMembership
from services import cluster
from tests.clusters import access

pytestmark = pytest.mark.integration

NODE_ARGS = ["--failure-timeout-ms", "600", "--heartbeat-interval-ms", "100", "--grace-ms", "100"]
TOTAL_PER_PUBLISHER = 50_000
BATCH = 250
WINDOW = 4
RUNS = int(os.environ.get("RINGQ_INTEGRATION_RUNS", "1"))


class Publisher:
    """Broadcasts numbered bodies with confirms, `WINDOW` batches in flight."""

    def __init__(self, membership: GroupMembership) -> None:
        self.membership = membership
        self.started = 0  # bodies whose broadcast request has been sent
        self.confirmed = 0
        self.by_seq: dict[int, bytes] = {}

    async def run(self, total: int) -> None:
        window = asyncio.Semaphore(WINDOW)
        tasks = []
        for start in range(0, total, BATCH):
            await window.acquire()
            bodies = [f"{self.membership.member_id}/{start + k}".encode().ljust(256, b".") for k in range(BATCH)]
            self.started += len(bodies)
            task = asyncio.ensure_future(self._send(bodies))
            task.add_done_callback(lambda _: window.release())
            tasks.append(task)
        await asyncio.gather(*tasks)

    async def _send(self, bodies: list[bytes]) -> None:
        first, last = await self.membership.broadcast(bodies, confirmed=True)
        assert last - first + 1 == len(bodies)
        for offset, body in enumerate(bodies):
            self.by_seq[first + offset] = body
        self.confirmed += len(bodies)


async def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _scenario(directory: Path) -> dict[str, float]:
    info = cluster.up(3, directory, node_args=NODE_ARGS, tls=True)
    addresses = {node.name: node.address for node in info.nodes}
    a = await GroupMembership.join(addresses["node1"], "ring-it", **access(info))
    b = await GroupMembership.join(addresses["node2"], "ring-it", **access(info))
    c = await GroupMembership.join(addresses["node3"], "ring-it", **access(info))
    recorders = {m.member_id: DeliveryCheck(m.joined, keep_bodies=True) for m in (a, b, c)}
    readers = [asyncio.ensure_future(recorders[m.member_id].follow(m)) for m in (a, b, c)]
    publishers = [Publisher(a), Publisher(b)]
    started = time.monotonic()
    publishing = asyncio.ensure_future(asyncio.gather(*(p.run(TOTAL_PER_PUBLISHER) for p in publishers)))

    total = 2 * TOTAL_PER_PUBLISHER
    await _wait_for(lambda: sum(p.confirmed for p in publishers) >= total * 0.3, 60, "30% confirmed")
    cluster.kill(directory, "node3", signal.SIGKILL)
    killed_at = time.monotonic()
    await _wait_for(lambda: sum(p.confirmed for p in publishers) >= total * 0.5, 60, "50% confirmed")
    node4 = cluster.start_node(directory, "node4")
    d = await GroupMembership.join(node4.address, "ring-it", **access(info))
    started_before_join = {p.membership.member_id: p.started for p in publishers}
    recorders[d.member_id] = DeliveryCheck(d.joined, keep_bodies=True)
    readers.append(asyncio.ensure_future(recorders[d.member_id].follow(d)))

    await asyncio.wait_for(publishing, 120)
    elapsed = time.monotonic() - started
    survivors = [recorders[m.member_id] for m in (a, b, d)]

    def delivered_all(member: str) -> Callable[[], bool]:
        return lambda: all(r.last.get(member, 0) >= TOTAL_PER_PUBLISHER for r in survivors)

    for publisher in publishers:
        await _wait_for(delivered_all(publisher.membership.member_id), 30, "survivors to deliver")
    await _wait_for(lambda: all(c.member_id in r.deaths for r in survivors[:2]), 30, "the death to be reported")

    for recorder in recorders.values():
        assert not recorder.problems, recorder.problems[:5]
    for publisher in publishers:
        member = publisher.membership.member_id
        assert len(publisher.by_seq) == TOTAL_PER_PUBLISHER
        expected = [publisher.by_seq[seq] for seq in range(1, TOTAL_PER_PUBLISHER + 1)]
        for recorder in survivors:
            first = recorder.start_after.get(member, 0) + 1
            assert recorder.bodies.get(member, []) == expected[first - 1 :], f"{member} as delivered by a survivor"
        joiner = recorders[d.member_id]
        assert joiner.start_after.get(member, 0) <= started_before_join[member], "joiner missed messages after join"
    for membership in (a, b, d):
        await membership.close()
    for reader in readers:
        reader.cancel()
    return {"elapsed": elapsed, "killed_after": killed_at - started}


@pytest.mark.parametrize("run", range(RUNS))
def test_broadcast_through_a_kill_and_a_join(tmp_path: Path, run: int) -> None:
    directory = tmp_path / f"cluster{run}"
    try:
        figures = asyncio.run(asyncio.wait_for(_scenario(directory), 240))
        print(f"run {run}: 100,000 messages in {figures['elapsed']:.1f}s")
    finally:
        cluster.down(directory)


async def _paused_node_scenario(directory: Path) -> float:
    # A slow fallback: only the nodes' group watch can tell the paused member in time.
    info = cluster.up(3, directory, node_args=[*NODE_ARGS, "--membership-check-ms", "60000"], tls=True)
    addresses = {node.name: node.address for node in info.nodes}
    a = await GroupMembership.join(addresses["node1"], "paused", **access(info))
    b = await GroupMembership.join(addresses["node2"], "paused", **access(info))
    c = await GroupMembership.join(addresses["node3"], "paused", **access(info))
    checks = {m.member_id: DeliveryCheck(m.joined) for m in (a, b)}
    followers = [asyncio.ensure_future(checks[m.member_id].follow(m)) for m in (a, b)]
    c_ended: asyncio.Future[grpc.StatusCode] = asyncio.get_running_loop().create_future()

    async def follow_c() -> None:
        try:
            async for _ in c.events():
                pass
            c_ended.set_result(grpc.StatusCode.OK)
        except RingqError as error:
            c_ended.set_result(error.code)

    c_follower = asyncio.ensure_future(follow_c())
    for _ in range(10):
        await a.broadcast([b"before"] * 100, confirmed=True)
    node3 = info.process("node3")
    os.kill(node3.pid, signal.SIGSTOP)
    paused = time.monotonic()
    try:
        await asyncio.wait_for(a.broadcast([b"during"] * 100, confirmed=True), 10)
        stalled = time.monotonic() - paused
        await asyncio.sleep(1.0)
    finally:
        os.kill(node3.pid, signal.SIGCONT)
    resumed = time.monotonic()
    code = await asyncio.wait_for(c_ended, 15)
    told_after = time.monotonic() - resumed
    assert code == grpc.StatusCode.ABORTED, f"the paused member's stream ended with {code}"
    # The node's group watch delivers the view that records it dead as soon as
    # it runs again (the polling fallback is set to a minute here).
    assert told_after < 2.0, f"the paused member learnt of its death {told_after:.1f}s after SIGCONT"
    for _ in range(10):
        await b.broadcast([b"after"] * 100, confirmed=True)
    await _wait_for(lambda: all(c.member_id in check.deaths for check in checks.values()), 15, "the death")
    await _wait_for(lambda: all(check.delivered == 2100 for check in checks.values()), 15, "deliveries")
    for check in checks.values():
        assert not check.problems, check.problems[:3]
    for membership in (a, b):
        await membership.close()
    for task in (*followers, c_follower):
        task.cancel()
    return stalled


def test_a_node_paused_past_the_failure_timeout_is_recorded_dead_and_its_member_stops(tmp_path: Path) -> None:
    """SIGSTOP keeps the paused node's connections open: only heartbeats reveal it.
    Confirms stall for about the failure timeout plus the grace, then go on; on
    SIGCONT the paused member finds itself recorded dead and its stream is aborted."""
    directory = tmp_path / "cluster"
    try:
        stalled = asyncio.run(asyncio.wait_for(_paused_node_scenario(directory), 120))
        print(f"confirms stalled {stalled:.2f}s while node3 was paused")
        assert stalled < 3.0, f"failover took {stalled:.2f}s with a 0.6 s failure timeout"
    finally:
        cluster.down(directory)
