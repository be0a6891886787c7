"""A coordinator process that cannot be stalled by policy work: with 2,000 queues, six concurrent
set_policy calls all finish while every other call keeps answering within a second (they once held
every worker thread: each call timed out for minutes), and declaring queues keeps a steady rate (each
declare once listed every queue: 10,000 stalled at 4,622 after 330 s)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ringq.internal.v1 import coordinator_pb2, coordinator_pb2_grpc
from ringq.v1 import admin_pb2_grpc, cluster_pb2

pytestmark = pytest.mark.integration
QUEUES = 2000
NODES = ("node1", "node2", "node3")
POLICY_DEFINITIONS = [
    {"ha-mode": "all"},
    {"ha-mode": "exactly", "ha-params": 2},
    {"ha-mode": "exactly", "ha-params": 3},
    {"ha-mode": "nodes", "ha-params": ["node1", "node2"]},
    {"max-length": 1000},
    {"ha-mode": "all", "ha-sync-mode": "automatic"},
]


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[str]:
    ready, log = tmp_path / "ready", (tmp_path / "coordinator.log").open("wb")
    command = [sys.executable, "-m", "services.coordinator", "--listen", "127.0.0.1:0"]
    process = subprocess.Popen(
        [*command, "--db", str(tmp_path / "c.db"), "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.05)
        yield ready.read_text().strip()
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()


async def _register(stub: Any) -> None:
    for node in NODES:
        await stub.RegisterNode(coordinator_pb2.RegisterNodeRequest(node=node, address=f"127.0.0.1:1{node[-1]}"))
        await stub.NodeHeartbeat(coordinator_pb2.NodeHeartbeatRequest(node=node))


async def _heartbeats(stub: Any) -> None:
    while True:
        await asyncio.sleep(0.2)
        for node in NODES:
            await stub.NodeHeartbeat(coordinator_pb2.NodeHeartbeatRequest(node=node))


def test_six_concurrent_policy_changes_on_2000_queues_leave_every_other_call_answering(coordinator: str) -> None:
    async def scenario() -> dict[str, float]:
        async with grpc.aio.insecure_channel(coordinator) as channel:
            stub: Any = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            admin: Any = admin_pb2_grpc.AdminServiceStub(channel)
            await _register(stub)
            beating = asyncio.ensure_future(_heartbeats(stub))
            try:
                started = time.monotonic()
                for first in range(0, QUEUES, 50):
                    await asyncio.gather(
                        *(
                            stub.DeclareQueue(coordinator_pb2.DeclareQueueRequest(name=f"q{i}"))
                            for i in range(first, first + 50)
                        )
                    )
                declared_per_s = QUEUES / (time.monotonic() - started)

                slowest = 0.0
                finished = False

                async def probe() -> None:
                    nonlocal slowest
                    while not finished:
                        asked = time.monotonic()
                        await admin.ClusterStatus(cluster_pb2.ClusterStatusRequest(), timeout=10)
                        await stub.GetQueue(coordinator_pb2.GetQueueRequest(name="q7"), timeout=10)
                        slowest = max(slowest, time.monotonic() - asked)
                        await asyncio.sleep(0.05)

                probing = asyncio.ensure_future(probe())
                started = time.monotonic()
                policies = [
                    cluster_pb2.Policy(vhost="/", name=f"p{i}", pattern="^q", priority=i, definition_json=json.dumps(d))
                    for i, d in enumerate(POLICY_DEFINITIONS)
                ]
                answers = await asyncio.wait_for(
                    asyncio.gather(*(admin.SetPolicy(cluster_pb2.SetPolicyRequest(policy=p)) for p in policies)), 120
                )
                policies_s = time.monotonic() - started
                finished = True
                await probing
                assert [a.policy.name for a in answers] == [p.name for p in policies]
                placed = (await stub.GetQueue(coordinator_pb2.GetQueueRequest(name="q1999"))).queue
                assert placed.policy == "p5" and len(placed.mirrors) == 2, "the highest priority policy applies"
                return {"declared_per_s": declared_per_s, "policies_s": policies_s, "slowest_other_call_s": slowest}
            finally:
                beating.cancel()

    figures = asyncio.run(scenario())
    print(f"coordinator under policy load: {figures}")
    assert figures["slowest_other_call_s"] < 1.0, figures
