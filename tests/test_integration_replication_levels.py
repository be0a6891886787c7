"""Replication levels (policy key `replication`, after Qpid's qpid.replicate): `all` mirrors messages;
`wiring` keeps the queue itself highly available (a mirror takes over, empty, when the master dies:
clients carry on, the old master's messages are lost, as the level says); `none` places no mirror (the
queue waits for its node)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from ringq import aio
from ringq.errors import RingqError
from services import cluster
from tests.clusters import access, live_cluster

pytestmark = pytest.mark.integration
LEVEL_POLICIES = {
    "wiring": ("^wiring\\.", {"ha-mode": "all", "replication": "wiring"}),
    "local": ("^local\\.", {"replication": "none"}),
}


@pytest.fixture
def levels_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    with live_cluster(tmp_path_factory.mktemp("levels"), LEVEL_POLICIES) as info:
        yield info


def test_wiring_keeps_the_queue_available_but_not_its_messages(levels_cluster: cluster.ClusterInfo) -> None:
    info = levels_cluster

    async def scenario() -> None:
        async with aio.Connection(info.node_addresses, retry_for=2, **access(info)) as connection:
            declared = await connection.declare_queue("wiring.q")
            assert len(declared.mirrors) == 2, "the queue itself is on every node"
            deadline = time.monotonic() + 15
            while len((await connection.queue_status("wiring.q")).synchronised_mirrors) < 2:
                assert time.monotonic() < deadline, "a wiring mirror is synchronised once it has joined"
                await asyncio.sleep(0.1)
            producer = connection.producer("wiring.q")
            assert await producer.publish_many([b"a", b"b", b"c"]) == [aio.Outcome.CONFIRMED] * 3
            assert (await connection.queue_status("wiring.q")).depth == 3
            master = declared.master_node
            cluster.kill(info.directory, master, signal.SIGKILL)
            deadline = time.monotonic() + 15
            while True:
                try:
                    status = await connection.queue_status("wiring.q")
                    if status.master_node != master and "running" in status.status:
                        break
                except RingqError as error:
                    assert error.code == grpc.StatusCode.UNAVAILABLE, error
                assert time.monotonic() < deadline, "no mirror took over"
                await asyncio.sleep(0.1)
            assert status.depth == 0 and "wiring" in status.status, status
            assert await connection.producer("wiring.q").publish_many([b"after"]) == [aio.Outcome.CONFIRMED]
            got = await connection.get("wiring.q", no_ack=True)
            assert got is not None and got.body == b"after"

    asyncio.run(scenario())


def test_none_places_no_mirror(levels_cluster: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with aio.Connection(levels_cluster.node_addresses, **access(levels_cluster)) as connection:
            declared = await connection.declare_queue("local.q")
            assert declared.master_node and not declared.mirrors
            await connection.producer("local.q").publish_many([b"x"])
            assert (await connection.queue_status("local.q")).depth == 1

    asyncio.run(scenario())
