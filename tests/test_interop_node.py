"""Interop: the Node.js client (clients/node) and Python against one live 3-node cluster.

A: Node publishes 500 messages with confirms; Python consumes them (raw stubs,
   one ack per delivery on its Consume stream, those of a response in one
   request): all 500 bodies, in publisher order, once each.
B: Python publishes 500 with confirms; Node consumes and acks every one on its
   Consume stream; the queue's depth is then 0, so the Node acks took effect.
C: a Node consumer acking an unknown delivery tag on its stream gets
   FAILED_PRECONDITION, through a node that forwards to the queue's master.

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
from pathlib import Path
from typing import Any

import grpc
import pytest

from ringq.v1 import coordinator_pb2, coordinator_pb2_grpc, queue_pb2, queue_pb2_grpc
from services import cluster
from tests.clusters import NODE_ARGS, every_node_live

pytestmark = pytest.mark.integration

NODE_CLIENT = Path(__file__).resolve().parents[1] / "clients" / "node"
COUNT = 500
# Test C: attach a consumer through the given node, ack a tag it never got, report how the stream ended.
ACK_UNKNOWN_TAG = """
const ringq = require('./ringq');
(async () => {
  const client = await ringq.connect(process.argv[1]);
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
def addresses(node: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A live 3-node cluster whose queues named interop.* are mirrored on every node: the nodes' addresses."""
    directory = tmp_path_factory.mktemp("interop-node")
    info = cluster.up(3, directory, node_args=NODE_ARGS)

    async def setup() -> None:
        definition = {"ha-mode": "all", "ha-sync-mode": "automatic"}
        policy = coordinator_pb2.Policy(
            vhost="/", name="interop", pattern="^interop\\.", definition_json=json.dumps(definition)
        )
        async with grpc.aio.insecure_channel(info.coordinator.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            await stub.SetPolicy(coordinator_pb2.SetPolicyRequest(policy=policy))
        await every_node_live(info)

    try:
        asyncio.run(setup())
        yield [n.address for n in info.nodes]
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
        info: queue_pb2.QueueInfo = await stub.QueueStatus(_ref(queue), timeout=5)
        if info.depth == 0 or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.05)


def test_node_publishes_python_consumes_in_order_exactly_once(node: str, addresses: list[str]) -> None:
    queue = "interop.a"
    published = _run_node(
        node, "cli.js", "publish", "--address", ",".join(addresses), "--queue", queue,
        "--count", str(COUNT), "--publisher", "node-pub", "--declare",
    )  # fmt: skip
    assert published["confirmed"] == COUNT and published["rejected"] == 0, published

    async def consume() -> tuple[list[queue_pb2.QueueDelivery], queue_pb2.QueueInfo]:
        async with grpc.aio.insecure_channel(addresses[2]) as channel:
            stub: Any = queue_pb2_grpc.QueueServiceStub(channel)
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
    assert [(d.publisher, d.seq) for d in deliveries] == [("node-pub", seq) for seq in range(1, COUNT + 1)]
    assert not any(d.redelivered for d in deliveries)
    assert info.depth == 0, f"the queue still holds messages after 500 acks: {info}"


def test_python_publishes_node_consumes_and_acks_on_its_stream(node: str, addresses: list[str]) -> None:
    queue = "interop.b"
    bodies = [f"py-pub:{seq}".encode() for seq in range(1, COUNT + 1)]

    async def publish() -> dict[int, int]:
        async with grpc.aio.insecure_channel(addresses[0]) as channel:
            stub: Any = queue_pb2_grpc.QueueServiceStub(channel)
            await stub.DeclareQueue(queue_pb2.QueueDeclareRequest(queue=_ref(queue)), timeout=10)
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
        "--queue", queue, "--count", str(COUNT), "--prefetch", "50", "--timeout-ms", "20000",
    )  # fmt: skip
    assert consumed["bodies"] == [b.decode() for b in bodies] and consumed["redelivered"] == 0

    async def status() -> queue_pb2.QueueInfo:
        async with grpc.aio.insecure_channel(addresses[1]) as channel:
            stub: Any = queue_pb2_grpc.QueueServiceStub(channel)
            deadline = time.monotonic() + 10
            while (info := await stub.QueueStatus(_ref(queue), timeout=5)).consumers and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the Node consumer's stream is gone: its cancel is on the way
            result: queue_pb2.QueueInfo = info
            return result

    # Had the acks not been applied, closing the stream would have requeued all 500.
    info = asyncio.run(status())
    assert (info.depth, info.unacked, info.consumers) == (0, 0, 0), info


def test_node_acking_an_unknown_delivery_tag_gets_failed_precondition(node: str, addresses: list[str]) -> None:
    queue = "interop.c"

    async def declare() -> None:
        async with grpc.aio.insecure_channel(addresses[0]) as channel:
            stub: Any = queue_pb2_grpc.QueueServiceStub(channel)
            info = await stub.DeclareQueue(queue_pb2.QueueDeclareRequest(queue=_ref(queue)), timeout=10)
            assert info.master_node == "node1"

    asyncio.run(declare())
    ended = _run_node(node, "-e", ACK_UNKNOWN_TAG, addresses[1], queue, timeout=30)  # node2 forwards to node1
    assert ended["code"] == "FAILED_PRECONDITION", ended
    assert "unknown delivery tag 987654321" in ended["details"], ended
