"""Interop: ordered streams through the Node.js client (clients/node) and the Python SDK, on one live TLS
cluster of 4 nodes (streams of 3 groups; clients act as guest from loopback, trusting the cluster CA).

A: Node declares a stream, reads its status, deletes it; the status of the deleted stream is NOT_FOUND.
B: Node publishes 500 messages with confirms (stream_seq = token * 2^32 + n); Node consumes them: all
   500, in stream order, once each, with the stream_seqs the producer was confirmed.
C: Node publishes 500; the Python SDK's stream consumer reads them: all 500, in order, once each.
D: the Python SDK's stream producer publishes 500; Node consumes them: all 500, in order, once each.
E: (a cluster of its own) SIGKILL of the master of the head send group while Node publishes: the Node
   producer's call breaks, it resends what was unconfirmed on a new call and goes on in the next group;
   every message is confirmed, and a Node consumer reads all of them in order, once each.

Skipped when `node` is not on PATH (the `node` fixture of test_interop_node).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services import certs, cluster
from tests import test_interop_node
from tests.clusters import GUEST, connection, live_cluster
from tests.test_interop_node import NODE_CLIENT, _run_node

pytestmark = pytest.mark.integration

# The fixture `node`: the `node` executable, with clients/node's dependencies installed (skips without it).
node = test_interop_node.node

NODES = 4
GROUPS = 3
COUNT = 500
TOKEN_SHIFT = 32

# Test A: declare, status, delete, status again (NOT_FOUND); one JSON line.
DECLARE_STATUS_DELETE = """
const ringq = require('./ringq');
(async () => {
  const client = await ringq.connect(process.argv[1].split(','), {
    tls: { ca: process.argv[2] },
    credentials: { user: process.argv[3], password: process.argv[4] },
  });
  try {
    const declared = await client.declareStream('interop.tmp', { groups: 2, durable: false });
    const again = await client.declareStream('interop.tmp', { groups: 2, durable: false });
    let conflict = 'OK';
    try {
      await client.declareStream('interop.tmp', { groups: 3, durable: false });
    } catch (error) {
      conflict = ringq.statusName(error.code);
    }
    const status = await client.streamStatus('interop.tmp');
    const listed = (await client.listStreams()).map((s) => s.stream.stream);
    await client.deleteStream('interop.tmp');
    let after = 'OK';
    try {
      await client.streamStatus('interop.tmp');
    } catch (error) {
      after = ringq.statusName(error.code);
    }
    console.log(JSON.stringify({
      declared: { groups: declared.groups.length, durable: declared.durable, sendList: declared.sendList },
      again: again.groups.map((g) => g.group),
      conflict,
      status: { groups: status.groups.map((g) => g.group), whole: status.groups.map((g) => g.whole) },
      listed,
      after,
    }));
  } finally {
    client.close();
  }
})().catch((error) => {
  console.error(error);
  process.exit(1);
});
"""

# Test E: publish HALF, say so, wait for "go" on stdin, publish the rest in small slow chunks (the broker
# loses the head send group's master meanwhile); one JSON line.
PUBLISH_THROUGH_A_FAILOVER = """
const ringq = require('./ringq');
const readline = require('node:readline');
(async () => {
  const [addresses, ca, user, password, stream, count] = process.argv.slice(1);
  const client = await ringq.connect(addresses.split(','), { tls: { ca }, credentials: { user, password } });
  await client.declareStream(stream, { groups: 3, durable: false });
  const producer = await client.streamProducer(stream, { persistent: false });
  const half = Number(count) / 2;
  const confirms = await Promise.all(Array.from({ length: half }, (_, i) => producer.publish(`f:${i + 1}`)));
  console.log(JSON.stringify({ half: confirms.length }));
  await new Promise((resolve) => readline.createInterface({ input: process.stdin }).once('line', resolve));
  const rest = [];
  for (let n = half + 1; n <= Number(count); n++) {
    rest.push(producer.publish(`f:${n}`));
    if (n % 20 === 0) await new Promise((resolve) => setTimeout(resolve, 10));
  }
  confirms.push(...(await Promise.all(rest)));
  await producer.close();
  console.log(JSON.stringify({
    confirmed: confirms.length, seqs: confirms.map((c) => c.streamSeq), resends: producer.resends,
    groups: producer.groupsUsed,
  }));
  client.close();
  process.stdin.destroy();
})().catch((error) => {
  console.error(error);
  process.exit(1);
});
"""


@pytest.fixture(scope="module")
def four(node: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    with live_cluster(tmp_path_factory.mktemp("interop-node-streams") / "c", nodes=NODES, tls=True) as info:
        yield info


def _tls_args(info: cluster.ClusterInfo) -> list[str]:
    ca = certs.ca_paths(info.tls_dir).certificate
    return ["--tls-ca", str(ca), "--user", GUEST.user, "--password", GUEST.password]


def _publish(node: str, info: cluster.ClusterInfo, stream: str, prefix: str) -> dict[str, Any]:
    """Node's stream producer publishes "<prefix>:1" .. "<prefix>:COUNT" to a stream it declares; checks the
    confirms and returns what it printed."""
    published = _run_node(
        node, "cli.js", "stream-publish", "--address", ",".join(info.node_addresses), "--stream", stream,
        "--count", str(COUNT), "--prefix", prefix, "--declare", "--groups", str(GROUPS), *_tls_args(info),
    )  # fmt: skip
    assert published["confirmed"] == COUNT, published
    token = int(published["token"])
    assert token > 0
    seqs = [int(s) for s in published["seqs"]]
    assert seqs == [(token << TOKEN_SHIFT) | n for n in range(1, COUNT + 1)], seqs[:5]
    return published


def _node_consume(
    node: str, info: cluster.ClusterInfo, stream: str, count: int = COUNT, addresses: list[str] | None = None
) -> dict[str, Any]:
    # From the last node first: every node forwards to the node serving the head group.
    through = ",".join(addresses or reversed(info.node_addresses))
    return _run_node(
        node, "cli.js", "stream-consume", "--address", through, "--stream", stream, "--count", str(count),
        "--prefetch", "100", "--timeout-ms", "20000", *_tls_args(info),
    )  # fmt: skip


def _assert_in_order_once(seqs: list[int], bodies: list[str], expected_seqs: list[int], prefix: str) -> None:
    count = len(expected_seqs)
    assert len(seqs) == count, f"{len(seqs)} delivered"
    assert len(set(seqs)) == count, "a stream_seq was delivered twice"
    assert all(a < b for a, b in itertools.pairwise(seqs)), "stream_seqs went back"
    assert seqs == expected_seqs
    assert bodies == [f"{prefix}:{n}" for n in range(1, count + 1)]


def test_node_declares_inspects_and_deletes_a_stream(node: str, four: cluster.ClusterInfo) -> None:
    ca = str(certs.ca_paths(four.tls_dir).certificate)
    addresses = ",".join(four.node_addresses)
    done = _run_node(node, "-e", DECLARE_STATUS_DELETE, addresses, ca, GUEST.user, GUEST.password, timeout=30)
    assert done["declared"]["groups"] == 2 and done["declared"]["durable"] is False, done
    assert done["again"] == done["status"]["groups"] and len(done["status"]["groups"]) == 2, done
    assert done["conflict"] == "FAILED_PRECONDITION", done
    assert "interop.tmp" in done["listed"], done
    assert done["after"] == "NOT_FOUND", done


def test_node_publishes_node_consumes_in_order_once(node: str, four: cluster.ClusterInfo) -> None:
    stream = "interop.node-node"
    published = _publish(node, four, stream, "nn")
    consumed = _node_consume(node, four, stream)
    seqs = [int(s) for s in consumed["seqs"]]
    _assert_in_order_once(seqs, consumed["bodies"], [int(s) for s in published["seqs"]], "nn")
    assert consumed["redelivered"] == 0 and consumed["duplicatesDropped"] == 0, {
        k: v for k, v in consumed.items() if k not in ("seqs", "bodies")
    }

    async def status() -> Any:
        async with connection(four) as conn:
            return await conn.stream_status(stream)

    info = asyncio.run(status())
    assert len(info.groups) == GROUPS and len({g.master_node for g in info.groups}) == GROUPS, info
    assert info.send_list and published["groups"] == [info.send_list[0]], (published["groups"], info)


def test_python_sdk_consumes_a_node_published_stream_in_order_once(node: str, four: cluster.ClusterInfo) -> None:
    stream = "interop.node-py"
    published = _publish(node, four, stream, "np")

    async def consume() -> tuple[list[int], list[str], int]:
        async with connection(four, "node3", "node2") as conn:
            consumer = await conn.stream_consumer(stream, prefetch=200)
            seqs: list[int] = []
            bodies: list[str] = []
            try:
                while len(seqs) < COUNT:
                    message = await consumer.next(20)
                    assert message is not None, f"only {len(seqs)} of {COUNT} delivered; {consumer.waiting}"
                    seqs.append(message.stream_seq)
                    bodies.append(message.body.decode())
                    message.ack()
            finally:
                await consumer.close()
            return seqs, bodies, consumer.duplicates_dropped

    seqs, bodies, dropped = asyncio.run(consume())
    _assert_in_order_once(seqs, bodies, [int(s) for s in published["seqs"]], "np")
    assert dropped == 0


def test_node_consumes_a_python_published_stream_in_order_once(node: str, four: cluster.ClusterInfo) -> None:
    stream = "interop.py-node"

    async def publish() -> list[int]:
        async with connection(four, "node2") as conn:
            await conn.declare_stream(stream, groups=GROUPS, durable=False)
            async with await conn.stream_producer(stream, persistent=False) as producer:
                return await producer.publish_many([f"pn:{n}".encode() for n in range(1, COUNT + 1)])

    published = asyncio.run(publish())
    consumed = _node_consume(node, four, stream)
    _assert_in_order_once([int(s) for s in consumed["seqs"]], consumed["bodies"], published, "pn")
    assert (consumed["duplicatesDropped"], consumed["redelivered"]) == (0, 0), json.dumps(consumed)[:300]


def test_node_producer_resends_through_a_send_group_failover(node: str, tmp_path: Path) -> None:
    stream, count = "interop.failover", 3000
    with live_cluster(tmp_path / "c", nodes=NODES, tls=True) as info:
        ca = str(certs.ca_paths(info.tls_dir).certificate)
        args = [",".join(info.node_addresses), ca, GUEST.user, GUEST.password, stream, str(count)]
        publisher = subprocess.Popen(
            [node, "-e", PUBLISH_THROUGH_A_FAILOVER, *args],
            cwd=NODE_CLIENT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert publisher.stdout is not None and publisher.stdin is not None
            assert json.loads(publisher.stdout.readline()) == {"half": count // 2}

            async def head_master() -> str:
                async with connection(info) as conn:
                    status = await conn.stream_status(stream)
                return next(g.master_node for g in status.groups if g.group == status.send_list[0])

            victim = asyncio.run(head_master())
            publisher.stdin.write("go\n")
            publisher.stdin.flush()
            time.sleep(0.3)  # the second half takes 1.5 s at least: the kill lands while it is sent
            cluster.kill(info.directory, victim, signal.SIGKILL)
            out, err = publisher.communicate(timeout=60)
        finally:
            if publisher.poll() is None:
                publisher.kill()
                publisher.wait()
        assert publisher.returncode == 0, f"node exited {publisher.returncode}:\n{out[-2000:]}\n{err[-3000:]}"
        published = json.loads(out.strip().splitlines()[-1])
        assert published["confirmed"] == count and published["resends"] >= 1, {
            k: v for k, v in published.items() if k != "seqs"
        }
        assert len(published["groups"]) >= 2, published["groups"]  # it went on in another group
        survivors = [n.address for n in info.nodes if n.name != victim]
        consumed = _node_consume(node, info, stream, count, survivors)
        seqs = [int(s) for s in consumed["seqs"]]
        _assert_in_order_once(seqs, consumed["bodies"], [int(s) for s in published["seqs"]], "f")
