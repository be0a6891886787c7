"""Integration: the ring keeps serving while the coordinator is down; membership
changes wait for it (ARCHITECTURE.md section 5).

Kill the (SQLite) coordinator with SIGKILL under traffic: confirmed broadcasts
go on. Then kill a node: its death cannot be recorded, so confirms wait
rather than risk a wrong view. Restart the coordinator on the same file and
address: the death is recorded, traffic resumes, nothing is lost or duplicated.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from ringq.group import DeliveryCheck, GroupMembership
from services import cluster
from tests.clusters import access

pytestmark = pytest.mark.integration

NODE_ARGS = ["--failure-timeout-ms", "600", "--heartbeat-interval-ms", "100", "--grace-ms", "100"]


async def _scenario(directory: Path) -> dict[str, float]:
    info = cluster.up(3, directory, node_args=NODE_ARGS, tls=True)
    addresses = {node.name: node.address for node in info.nodes}
    members = {
        name: await GroupMembership.join(address, "outage", **access(info)) for name, address in addresses.items()
    }
    checks = {name: DeliveryCheck(m.joined) for name, m in members.items()}
    followers = [asyncio.ensure_future(checks[name].follow(m)) for name, m in members.items()]
    publisher = members["node1"]
    for _ in range(5):
        await publisher.broadcast([b"before"] * 100, confirmed=True)

    cluster.kill(directory, "coordinator", signal.SIGKILL)
    started = time.monotonic()
    for _ in range(20):
        await asyncio.wait_for(publisher.broadcast([b"no coordinator"] * 100, confirmed=True), 5)
    steady = time.monotonic() - started

    cluster.kill(directory, "node3", signal.SIGKILL)
    pending = asyncio.ensure_future(publisher.broadcast([b"after the death"] * 100, confirmed=True))
    await asyncio.sleep(3.0)
    assert not pending.done(), "a confirm went out although node3's death could not be recorded"
    restarted = time.monotonic()
    cluster.restart_coordinator(directory)
    await asyncio.wait_for(pending, 30)
    healed = time.monotonic() - restarted
    survivors = {name: checks[name] for name in ("node1", "node2")}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(
        c.delivered == 2600 and members["node3"].member_id in c.deaths for c in survivors.values()
    ):
        await asyncio.sleep(0.05)
    for name, check in survivors.items():
        assert not check.problems, (name, check.problems[:3])
        assert check.delivered == 2600, (name, check.delivered)
        assert members["node3"].member_id in check.deaths
    for name in ("node1", "node2"):
        await members[name].close()
    for follower in followers:
        follower.cancel()
    return {"steady": steady, "healed": healed}


def test_traffic_goes_on_without_the_coordinator_and_membership_waits_for_it(tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    try:
        figures = asyncio.run(asyncio.wait_for(_scenario(directory), 120))
        steady, healed = figures["steady"], figures["healed"]
        print(f"2,000 confirmed without a coordinator in {steady:.2f}s; healed {healed:.2f}s after the restart")
    finally:
        cluster.down(directory)
