"""Failure detection between nodes: a SIGKILLed node is known dead at once (its port refuses a new
link), without waiting out the failure timeout or the grace; a paused node (SIGSTOP) still gets the
timeout."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from ringq.group import GroupMembership
from services import cluster
from tests.clusters import access

pytestmark = pytest.mark.integration
FAILURE_TIMEOUT_S = 5.0
NODE_ARGS = ["--failure-timeout-ms", str(int(FAILURE_TIMEOUT_S * 1000)), "--heartbeat-interval-ms", "100"]


async def _time_to_death(directory: Path, how: signal.Signals, node_args: list[str] = NODE_ARGS) -> float:
    info = cluster.up(3, directory, node_args=node_args, tls=True)
    members = {n.name: await GroupMembership.join(n.address, "watched", **access(info)) for n in info.nodes}
    try:
        dead = members["node3"].member_id
        await asyncio.sleep(0.5)  # links up between every pair of neighbours
        killed = time.monotonic()
        cluster.kill(directory, "node3", how)
        async for event in members["node1"].events():
            if event.WhichOneof("kind") == "members_changed" and dead in event.members_changed.deaths:
                return time.monotonic() - killed
        raise AssertionError("node1's member never heard of the death")
    finally:
        if how == signal.SIGSTOP:
            cluster.kill(directory, "node3", signal.SIGCONT)
        for name in ("node1", "node2"):
            await members[name].close()
        cluster.down(directory)


def test_a_killed_node_is_dead_well_before_the_failure_timeout(tmp_path: Path) -> None:
    elapsed = asyncio.run(asyncio.wait_for(_time_to_death(tmp_path, signal.SIGKILL), 30))
    assert elapsed < 1.0, f"death known after {elapsed:.2f}s (failure timeout {FAILURE_TIMEOUT_S}s)"


def test_a_paused_node_still_gets_the_whole_failure_timeout(tmp_path: Path) -> None:
    elapsed = asyncio.run(asyncio.wait_for(_time_to_death(tmp_path, signal.SIGSTOP), 30))
    assert elapsed >= FAILURE_TIMEOUT_S, f"a paused node was declared dead after {elapsed:.2f}s"


def test_a_killed_node_is_dead_at_once_whatever_the_grace(tmp_path: Path) -> None:
    """A refused port is the evidence of a dead process: the grace (for a silence that may end) is not
    waited out. Before issue 13 the report waited for the detector's next pass and the grace."""
    node_args = [*NODE_ARGS, "--grace-ms", "3000"]
    elapsed = asyncio.run(asyncio.wait_for(_time_to_death(tmp_path, signal.SIGKILL, node_args), 30))
    assert elapsed < 1.0, f"death known after {elapsed:.2f}s (grace 3 s)"
