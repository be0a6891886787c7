"""Integration: a join through a member on a node that just came back records nobody dead.

The bug, found by hand after a whole-cluster restart: node2 had dialled node1 while node1 was
down, so its channel to node1 was deep in gRPC's reconnect backoff when node1 came back. node2
then joined a group through node1's (live, new) member; its AddOnRight failed fast with
UNAVAILABLE until the failure timeout ran out, and the live member was recorded dead.

Here node1 is killed; node2 dials it while it is down (its member of "before-restart" asks node1's
dead member to add it; that member is rightly recorded dead); node1's cluster port (where node2
reaches it, with mutual TLS) stays closed to node2 (a stand-in accepts each connection and drops it,
recording when node2 tried) until node2's attempts are seconds apart, then node1 restarts on the
same ports and node2 joins "after-restart"
through node1's new member. Checked: the join goes through node1's member, nobody in
"after-restart" is recorded dead, a confirmed broadcast goes round both, and node2's log gives the
one death it did record (the old member) with its reason.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from ringq.group import GroupMembership
from services import cluster
from tests.clusters import access, cluster_ports, coordinator_client

pytestmark = pytest.mark.integration

NODE_ARGS = ["--failure-timeout-ms", "600", "--heartbeat-interval-ms", "100", "--grace-ms", "100"]
# node1 stays down until node2's attempts to reach it are this far apart (its channel's backoff has
# grown past the failure timeout several times), or for DOWN_AT_MOST_SECONDS: channels with the
# ring links' reconnect options never back off that long.
LONG_GAP_SECONDS = 2.5
DOWN_AT_MOST_SECONDS = 9.0


class ClosedPort:
    """node1's port while node1 is down: every connection is dropped at once (a failed attempt to
    a gRPC channel, as a refused one is), and when each came is recorded."""

    def __init__(self) -> None:
        self.attempts: list[float] = []

    def on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.attempts.append(time.monotonic())
        writer.close()

    async def wait_for_backoff(self) -> None:
        """Return just after an attempt that came LONG_GAP_SECONDS after the one before (the next will
        come later still), or DOWN_AT_MOST_SECONDS after the first attempt."""
        seen = 0
        while not self.attempts or time.monotonic() - self.attempts[0] < DOWN_AT_MOST_SECONDS:
            if len(self.attempts) > seen:
                seen = len(self.attempts)
                if seen >= 2 and self.attempts[-1] - self.attempts[-2] >= LONG_GAP_SECONDS:
                    return
            await asyncio.sleep(0.01)


async def _listen_once_free(closed_port: ClosedPort, host: str, port: int) -> asyncio.Server:
    """The stand-in takes node1's port as soon as the killed process has let go of it (on a loaded machine
    that is not at once after SIGKILL)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return await asyncio.start_server(closed_port.on_connection, host, port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _scenario(directory: Path) -> None:
    info = cluster.up(2, directory, node_args=NODE_ARGS, tls=True)
    node1 = info.process("node1").address
    node2 = info.process("node2").address
    host, port = node1.rsplit(":", 1)
    peers_port = (await cluster_ports(info))["node1"]  # where node2 reaches node1: its cluster port
    old_member = await GroupMembership.join(node1, "before-restart", **access(info))
    cluster.kill(directory, "node1", signal.SIGKILL)
    await old_member.close()
    closed_port = ClosedPort()
    stand_in = await _listen_once_free(closed_port, host, peers_port)
    try:
        survivor = await GroupMembership.join(node2, "before-restart", **access(info))  # through the dead member
        await closed_port.wait_for_backoff()
    finally:
        stand_in.close()
        await stand_in.wait_closed()
    assert closed_port.attempts, "node2 never tried to reach node1 while it was down"
    cluster.start_node(directory, "node1", port=int(port), cluster_port=peers_port)
    assert (await cluster_ports(info))["node1"] == peers_port, "node1 is back where node2 reached it before"

    master = await GroupMembership.join(node1, "after-restart", **access(info))
    joiner = await GroupMembership.join(node2, "after-restart", **access(info))
    assert master.member_id in joiner.joined.members, f"node2's member joined without node1's: {joiner.joined}"
    await asyncio.wait_for(master.broadcast([b"round"], confirmed=True), 10)
    async with coordinator_client(info) as coordinator:
        group = await coordinator.read_group("after-restart")
    assert [(m.id, m.alive) for m in group.members] == [(master.member_id, True), (joiner.member_id, True)]

    log = (info.logs / "node2.log").read_text()
    assert f"recorded {master.member_id} dead" not in log
    old_death = f"recorded {old_member.member_id} dead (reason: join target {old_member.member_id} on node1 down"
    assert old_death in log, "node2 recorded the old member's death without its reason"
    for membership in (survivor, master, joiner):
        await membership.close()


def test_a_join_through_a_node_its_channel_was_backing_off_from_records_nobody_dead(tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    try:
        asyncio.run(asyncio.wait_for(_scenario(directory), 90))
    finally:
        cluster.down(directory)
