"""Integration: what a master's death does to a queue whose mirrors are not synchronised.

Messages published while the queue had no mirror; then a policy adds mirrors
with manual sync, so they join empty and stay unsynchronised. Kill the master:
- ha-promote-on-failure when-synced (the default): no mirror is promoted, the
  queue answers UNAVAILABLE, and when the master's node comes back its durable
  messages are all there: nothing lost.
- always: the eldest mirror is promoted, the queue serves again at once, and
  the loss is reported in the queue's status.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from ringq import aio
from ringq.errors import RingqError, Unavailable
from ringq.v1 import queue_pb2
from services import cluster
from tests.clusters import NODE_ARGS, connection, every_node_live, set_policy

pytestmark = pytest.mark.integration
MESSAGES = 500


async def _unsynchronised_mirrors(directory: Path, promote: str) -> tuple[cluster.ClusterInfo, aio.Connection]:
    info = cluster.up(3, directory, node_args=NODE_ARGS, tls=True)
    await set_policy(info, "ha", "^ha\\.", {"ha-mode": "exactly", "ha-params": 1})  # master only
    await every_node_live(info)
    client = connection(info, "node1", "node2", "node3")
    await client.declare_queue("ha.q", durable=True)
    await client.producer("ha.q", persistent=True).publish_many([b"%d" % i for i in range(MESSAGES)])
    await set_policy(
        info, "ha", "^ha\\.", {"ha-mode": "all", "ha-sync-mode": "manual", "ha-promote-on-failure": promote}
    )
    deadline = time.monotonic() + 20
    while len((status := await client.queue_status("ha.q")).mirrors) < 2:
        assert time.monotonic() < deadline, "mirrors were not added"
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.5)  # the mirrors joined; the master's depth reports show them behind
    status = await client.queue_status("ha.q")
    assert list(status.synchronised_mirrors) == [], "mirrors that joined empty must not count as synchronised"
    return info, client


async def _when_synced(directory: Path) -> None:
    info, client = await _unsynchronised_mirrors(directory, "when-synced")
    cluster.kill(directory, "node1", signal.SIGKILL)
    await asyncio.sleep(3.0)  # well past the failure timeout
    # retry_for 0: one attempt, no retries on the other survivor
    survivors = connection(info, "node2", "node3", retry_for=0)
    try:
        await survivors.queue_status("ha.q")
        raise AssertionError("the queue answered without a master")
    except Unavailable as error:
        assert error.code == grpc.StatusCode.UNAVAILABLE, error
    call = survivors.stub().Publish()  # a publish while the queue has no master: retry later, nothing taken
    await call.write(
        queue_pb2.PublishRequest(
            queue=survivors.ref("ha.q"), publisher="late", messages=[queue_pb2.OutgoingMessage(body=b"x", seq=1)]
        )
    )
    try:
        await call.read()
        raise AssertionError("a publish was answered without a master")
    except grpc.aio.AioRpcError as refused:
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "retry" in (refused.details() or ""), refused
    cluster.start_node(directory, "node1")
    restarted = connection(cluster.load(directory), retry_for=5)
    deadline = time.monotonic() + 30
    while True:
        try:
            status = await restarted.queue_status("ha.q")
            if status.master_node == "node1" and status.depth:
                break
        except RingqError:
            pass
        assert time.monotonic() < deadline, "the master did not come back"
        await asyncio.sleep(0.2)
    assert status.depth == MESSAGES, f"{MESSAGES - status.depth} messages lost"
    for c in (client, survivors, restarted):
        await c.close()


async def _always(directory: Path) -> None:
    info, client = await _unsynchronised_mirrors(directory, "always")
    cluster.kill(directory, "node1", signal.SIGKILL)
    survivors = connection(info, "node2", "node3", retry_for=5)
    deadline = time.monotonic() + 20
    while True:
        try:
            status = await survivors.queue_status("ha.q")
            if status.master_node != "node1":
                break
        except RingqError:
            pass
        assert time.monotonic() < deadline, "no mirror was promoted"
        await asyncio.sleep(0.1)
    assert status.master_node == "node2", "the eldest mirror is promoted"
    promoted = [e.detail for e in status.events if e.kind == "promoted"]
    assert status.depth < MESSAGES and promoted and "may be lost" in promoted[-1], (status.depth, status.events)
    for c in (client, survivors):
        await c.close()


def test_an_unsynchronised_mirror_is_not_promoted_under_when_synced(tmp_path: Path) -> None:
    try:
        asyncio.run(asyncio.wait_for(_when_synced(tmp_path / "cluster"), 120))
    finally:
        cluster.down(tmp_path / "cluster")


def test_an_unsynchronised_mirror_is_promoted_under_always_and_the_loss_is_reported(tmp_path: Path) -> None:
    try:
        asyncio.run(asyncio.wait_for(_always(tmp_path / "cluster"), 120))
    finally:
        cluster.down(tmp_path / "cluster")
