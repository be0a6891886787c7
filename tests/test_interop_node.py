"""Interop: the Node.js client (clients/node) and Python against one live 3-node cluster.

A: Node publishes 500 messages with confirms; Python consumes them (raw stubs,
   one ack per delivery on its Consume stream, those of a response in one
   request): all 500 bodies, in publisher order, once each.
B: Python publishes 500 with confirms; Node consumes and acks every one on its
   Consume stream; the queue's depth is then 0, so the Node acks took effect.
C: a Node consumer acking an unknown delivery tag on its stream gets
   FAILED_PRECONDITION, through a node that forwards to the queue's master.

The cluster runs with TLS and authentication: both clients trust its CA and act as the
user interop (created through AdminService), so each client's TLS and credentials are tested too.
Queues are mirrored on every node (policy ^interop\\.). Skipped when `node` is
not on PATH; `npm ci` runs in clients/node once if its node_modules is missing.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from ringq import aio
from ringq.security import TLS, Credentials, authenticated
from ringq.v1 import queue_pb2, queue_pb2_grpc
from services import certs, cluster
from tests.clusters import NODE_ARGS

pytestmark = pytest.mark.integration

NODE_CLIENT = Path(__file__).resolve().parents[1] / "clients" / "node"
COUNT = 500
USER = Credentials("interop", "interop-secret")
USER_ARGS = (USER.user, USER.password)


@dataclass(frozen=True)
class Secure:
    """The cluster's client addresses and what a client needs to reach them: the CA and a user."""

    addresses: list[str]
    ca: Path

    def tls_args(self) -> list[str]:
        return ["--tls-ca", str(self.ca), "--user", USER.user, "--password", USER.password]

    def stub(self, channel: grpc.aio.Channel) -> Any:
        return authenticated(queue_pb2_grpc.QueueServiceStub(channel), USER)

    def channel(self, address: str) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(self.ca.read_bytes()))


# Test C: attach a consumer through the given node, ack a tag it never got, report how the stream ended.
ACK_UNKNOWN_TAG = """
const ringq = require('./ringq');
(async () => {
  const client = await ringq.connect(process.argv[1], {
    tls: { ca: process.argv[3] },
    credentials: { user: process.argv[4], password: process.argv[5] },
  });
  const consumer = client.consume(process.argv[2], { prefetch: 10 }, () => {});
  consumer.ack({ deliveryTag: '987654321' });
  try {
    await consumer.done;
    console.log(JSON.stringify({ code: 'OK' }));
  } catch (error) {
    console.log(JSON.stringify({ code: ringq.statusName(error.code), details: error.details }));
  } finally {
    client.close();
  }
})();
"""


@pytest.fixture(scope="session")
def node() -> str:
    """The `node` executable, with clients/node's dependencies installed."""
    executable = shutil.which("node")
    if executable is None:
        pytest.skip("Node.js is not installed (`node` is not on PATH): the Node client interop tests need it")
    if not (NODE_CLIENT / "node_modules").is_dir():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not on PATH: cannot install clients/node's dependencies (npm ci)")
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT, capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            pytest.fail(f"npm ci in {NODE_CLIENT} failed:\n{done.stdout}\n{done.stderr}", pytrace=False)
    return executable


@pytest.fixture(scope="module")
def secure(node: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    """A live 3-node TLS cluster whose queues named interop.* are mirrored on every node, with the user
    interop (every permission on /), set up as guest from loopback."""
    directory = tmp_path_factory.mktemp("interop-node")
    info = cluster.up(3, directory, node_args=NODE_ARGS, tls=True)
    ca = certs.ca_paths(info.tls_dir).certificate

    async def setup() -> None:
        guest = Credentials("guest", "guest")
        async with aio.Admin(info.node_addresses, tls=TLS(ca=ca), credentials=guest, timeout=10) as admin:
            await admin.set_policy("interop", "^interop\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
            await admin.add_user(USER.user, USER.password)
            await admin.set_permissions(USER.user, configure=".*", write=".*", read=".*")
            deadline = time.monotonic() + 20
            while sum(n.alive for n in (await admin.cluster_status()).nodes) < 3:
                assert time.monotonic() < deadline, "not every node was live"
                await asyncio.sleep(0.05)

    try:
        asyncio.run(setup())
        yield Secure(info.node_addresses, ca)
    finally:
        cluster.down(directory)


def _run_node(node: str, *args: str, timeout: float = 60) -> dict[str, Any]:
    """Run `node <args>` in clients/node; its last stdout line, parsed as JSON."""
    done = subprocess.run([node, *args], cwd=NODE_CLIENT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"node {args[0]} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _ref(queue: str) -> queue_pb2.QueueRef:
    return queue_pb2.QueueRef(vhost="/", queue=queue)


async def _wait_for_depth_zero(stub: Any, queue: str, timeout: float = 10.0) -> queue_pb2.QueueInfo:
    deadline = time.monotonic() + timeout
    while True:
        response = await stub.QueueStatus(queue_pb2.QueueStatusRequest(queue=_ref(queue)), timeout=5)
        info: queue_pb2.QueueInfo = response.queue
        if info.depth == 0 or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.05)


def test_node_publishes_python_consumes_in_order_exactly_once(node: str, secure: Secure) -> None:
    queue = "interop.a"
    addresses = secure.addresses
    published = _run_node(
        node, "cli.js", "publish", "--address", ",".join(addresses), "--queue", queue,
        "--count", str(COUNT), "--publisher", "node-pub", "--declare", *secure.tls_args(),
    )  # fmt: skip
    assert published["confirmed"] == COUNT and published["rejected"] == 0, published

    async def consume() -> tuple[list[queue_pb2.QueueDelivery], queue_pb2.QueueInfo]:
        async with secure.channel(addresses[2]) as channel:
            stub: Any = secure.stub(channel)
            call = stub.Consume()
            await call.write(queue_pb2.ConsumeRequest(queue=_ref(queue), prefetch=100))
            deliveries: list[queue_pb2.QueueDelivery] = []
            try:
                while len(deliveries) < COUNT:
                    response = await asyncio.wait_for(call.read(), 10)
                    ended = response is grpc.aio.EOF  # type: ignore[attr-defined]
                    assert not ended, f"the stream ended after {len(deliveries)} deliveries"
                    deliveries.extend(response.deliveries)
                    acks = [
                        queue_pb2.Settlement(delivery_tag=d.delivery_tag, kind=queue_pb2.SETTLE_KIND_ACK)
                        for d in response.deliveries
                    ]
                    await call.write(queue_pb2.ConsumeRequest(settlements=acks))
                # Acks are applied as the master reads them; wait for that before the stream goes
                # (cancelling it requeues whatever is still unacknowledged).
                info = await _wait_for_depth_zero(stub, queue)
            finally:
                call.cancel()
            return deliveries, info

    deliveries, info = asyncio.run(consume())
    assert [d.body.decode() for d in deliveries] == [f"node-pub:{seq}" for seq in range(1, COUNT + 1)]
    # Publisher ids are scoped to the user who publishes (USER\x1fID): no other user can forge them.
    scoped = f"{USER.user}\x1fnode-pub"
    assert [(d.publisher, d.seq) for d in deliveries] == [(scoped, seq) for seq in range(1, COUNT + 1)]
    assert not any(d.redelivered for d in deliveries)
    assert info.depth == 0, f"the queue still holds messages after 500 acks: {info}"


def test_python_publishes_node_consumes_and_acks_on_its_stream(node: str, secure: Secure) -> None:
    queue = "interop.b"
    addresses = secure.addresses
    bodies = [f"py-pub:{seq}".encode() for seq in range(1, COUNT + 1)]

    async def publish() -> dict[int, int]:
        async with secure.channel(addresses[0]) as channel:
            stub: Any = secure.stub(channel)
            await stub.DeclareQueue(queue_pb2.DeclareQueueRequest(queue=_ref(queue)), timeout=10)
            call = stub.Publish()
            for start in range(0, COUNT, 100):
                messages = [
                    queue_pb2.OutgoingMessage(body=body, seq=start + i + 1)
                    for i, body in enumerate(bodies[start : start + 100])
                ]
                await call.write(queue_pb2.PublishRequest(queue=_ref(queue), publisher="py-pub", messages=messages))
            await call.done_writing()
            outcomes: dict[int, int] = {}
            async for response in call:
                outcomes.update(zip(response.seqs, response.outcomes, strict=True))
            return outcomes

    outcomes = asyncio.run(publish())
    assert outcomes == dict.fromkeys(range(1, COUNT + 1), queue_pb2.PUBLISH_OUTCOME_CONFIRMED)

    # Through the other nodes first: the consume stream, acks included, is forwarded to the master.
    consumed = _run_node(
        node, "cli.js", "consume", "--address", ",".join([addresses[2], addresses[1], addresses[0]]),
        "--queue", queue, "--count", str(COUNT), "--prefetch", "50", "--timeout-ms", "20000", *secure.tls_args(),
    )  # fmt: skip
    assert consumed["bodies"] == [b.decode() for b in bodies] and consumed["redelivered"] == 0

    async def status() -> queue_pb2.QueueInfo:
        async with secure.channel(addresses[1]) as channel:
            stub: Any = secure.stub(channel)
            deadline = time.monotonic() + 10
            request = queue_pb2.QueueStatusRequest(queue=_ref(queue))
            while (
                info := (await stub.QueueStatus(request, timeout=5)).queue
            ).consumers and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the Node consumer's stream is gone: its cancel is on the way
            result: queue_pb2.QueueInfo = info
            return result

    # Had the acks not been applied, closing the stream would have requeued all 500.
    info = asyncio.run(status())
    assert (info.depth, info.unacked, info.consumers) == (0, 0, 0), info


def test_node_acking_an_unknown_delivery_tag_gets_failed_precondition(node: str, secure: Secure) -> None:
    queue = "interop.c"
    addresses = secure.addresses

    async def declare() -> None:
        async with secure.channel(addresses[0]) as channel:
            stub: Any = secure.stub(channel)
            declared = await stub.DeclareQueue(queue_pb2.DeclareQueueRequest(queue=_ref(queue)), timeout=10)
            assert declared.queue.master_node == "node1"

    asyncio.run(declare())
    # node2 forwards to node1
    ended = _run_node(node, "-e", ACK_UNKNOWN_TAG, addresses[1], queue, str(secure.ca), *USER_ARGS, timeout=30)
    assert ended["code"] == "FAILED_PRECONDITION", ended
    assert "unknown delivery tag 987654321" in ended["details"], ended
