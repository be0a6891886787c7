"""Integration: names never become paths. Queues and vhosts named like paths ("..", "../../x", "a/b")
and names as long as the rule allows are ordinary durable queues on a live cluster: their messages are
kept, survive a restart of every node, and every file the nodes write stays inside their data
directories. A name that breaks the rule (ringq.names) gets INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from ringq import aio
from ringq.errors import InvalidArgument
from services import cluster
from tests.clusters import GUEST, access, live_cluster

pytestmark = pytest.mark.integration
PATH_LIKE = [
    ("/", ".."),
    ("/", "../../../escaped"),
    ("/", "a/b"),
    ("..", "q"),
    ("..", ".."),
    ("../..", ".."),
    ("/", "x" * 255),
    ("/", "é" * 127),  # 254 bytes: percent-quoted, longer than a file name may be
]
PER_QUEUE = 20


async def _publish_and_count(info: cluster.ClusterInfo) -> dict[tuple[str, str], int]:
    # Vhosts exist before they are used (RabbitMQ's rule, kept with authentication on): the path-like
    # ones are made, with every permission in them for guest.
    for vhost in sorted({vhost for vhost, _ in PATH_LIKE} - {"/"}):
        async with aio.Admin(info.node_addresses, vhost=vhost, **access(info)) as admin:
            await admin.add_vhost(vhost)
            await admin.set_permissions(GUEST.user, configure=".*", write=".*", read=".*")
    counts: dict[tuple[str, str], int] = {}
    for vhost, name in PATH_LIKE:
        async with aio.Connection(info.node_addresses, vhost=vhost, **access(info)) as connection:
            await connection.declare_queue(name, durable=True)
            bodies = [f"{vhost}|{name}|{i}".encode() for i in range(PER_QUEUE)]
            outcomes = await connection.producer(name).publish_many(bodies, persistent=True)
            assert outcomes == [aio.Outcome.CONFIRMED] * PER_QUEUE, (vhost, name)
            counts[(vhost, name)] = (await connection.queue_status(name)).depth
    return counts


def test_path_like_and_longest_names_are_ordinary_durable_queues(tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    with live_cluster(directory, {}) as info:
        counts = asyncio.run(_publish_and_count(info))
        assert counts == {key: PER_QUEUE for key in PATH_LIKE}
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster"], "nothing written beside the cluster"
        data = directory / "data"
        assert {p.name for p in data.iterdir()} <= {n.name for n in info.nodes}, "only nodes' data directories"
        for node in info.nodes:  # each node writes inside its own data directory only
            own = (data / node.name).resolve()
            assert all(path.resolve().is_relative_to(own) for path in own.rglob("*"))
        cluster.kill_together(directory, [node.name for node in info.nodes], signal.SIGKILL)
        restarted = [cluster.start_node(directory, node.name) for node in info.nodes]

        async def drained() -> None:
            for vhost, name in PATH_LIKE:
                async with aio.Connection([n.address for n in restarted], vhost=vhost, **access(info)) as connection:
                    # Served again first: what this test is about is names, not consuming during a
                    # recovery (a consumer relayed while its queue recovered once hung: see issue 10's note).
                    deadline = time.monotonic() + 60
                    while (status := await connection.queue_status(name)).depth != PER_QUEUE or not status.master_node:
                        assert time.monotonic() < deadline, f"{vhost} {name} not served again: {status}"
                        await asyncio.sleep(0.1)
                    bodies: list[bytes] = []
                    consumer = connection.consumer(name, prefetch=PER_QUEUE)
                    async for delivery in consumer:
                        bodies.append(delivery.body)
                        delivery.ack()
                        if len(bodies) == PER_QUEUE:
                            break
                    await consumer.close()
                    assert bodies == [f"{vhost}|{name}|{i}".encode() for i in range(PER_QUEUE)], (vhost, name)

        asyncio.run(asyncio.wait_for(drained(), 120))


@pytest.mark.parametrize(
    ("vhost", "name", "why"),
    [
        ("/", "bad\nname", "queue must not contain a control character"),
        ("/", "x" * 256, "queue must be at most 255 bytes of UTF-8, got 256"),
        ("v\x00", "q", "vhost must not contain a control character"),
        ("/", "\u202eevil", "queue must not contain a format character"),
    ],
)
def test_a_name_that_breaks_the_rule_is_refused_with_the_reason(
    tmp_path: Path, vhost: str, name: str, why: str
) -> None:
    with live_cluster(tmp_path / "cluster", {}, nodes=1) as info:

        async def scenario() -> None:
            async with aio.Connection([info.nodes[0].address], vhost=vhost, retry_for=1, **access(info)) as connection:
                calls = (
                    connection.declare_queue(name, durable=True),
                    connection.queue_status(name),
                    connection.producer(name).publish(b"refused"),
                )
                for call in calls:
                    with pytest.raises(InvalidArgument) as refused:
                        await call
                    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
                    assert why in refused.value.details

        asyncio.run(scenario())
