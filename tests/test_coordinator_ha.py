"""High availability of the coordinator on ZooKeeper (ARCHITECTURE.md section 5).

Three coordinator processes share one ZooKeeper; any of them serves any call.
Killing (SIGKILL) the one a client or a broker node is using must not stop
its metadata calls: the next one succeeds through another coordinator within
two seconds. Every process runs with mutual TLS, clients authenticated, as in
production.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ringq.group import GroupMembership
from ringq.security import TLS
from services import certs
from services.coordinator.client import CoordinatorClient
from services.coordinator.group_table import CreateGroup, GroupMember, Outcome
from tests.clusters import GUEST, member_in

pytestmark = pytest.mark.integration
FAILOVER_BOUND_SECONDS = 2.0


def _wait_ready(ready: Path, process: subprocess.Popen[bytes], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{ready.name}: the process did not become ready")
        time.sleep(0.05)
    return ready.read_text().strip()


class Processes:
    """Processes started by hand, with TLS: each takes a certificate of the cluster CA in DIR/tls."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[subprocess.Popen[bytes]] = []
        self.tls_dir = directory / "tls"
        certs.cluster_material(self.tls_dir, ["node1"])
        self.client_tls = TLS(ca=certs.ca_paths(self.tls_dir).certificate)

    def tls_flags(self, issued: certs.Issued) -> list[str]:
        ca = certs.ca_paths(self.tls_dir).certificate
        return ["--tls-ca", str(ca), "--tls-cert", str(issued.certificate), "--tls-key", str(issued.key)]

    def start(self, name: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
        ready = self.directory / f"{name}.ready"
        log = (self.directory / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [sys.executable, "-m", *args, "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT
        )
        self.started.append(process)
        return process, _wait_ready(ready, process)

    def stop(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.started:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    started = Processes(tmp_path)
    try:
        yield started
    finally:
        started.stop()


def _coordinators(processes: Processes, zookeeper: str) -> list[tuple[subprocess.Popen[bytes], str]]:
    root = f"/ringq-ha-{uuid.uuid4().hex[:8]}"
    store = ["--store", "zookeeper", "--zookeeper", zookeeper, "--zookeeper-root", root]
    tls = processes.tls_flags(certs.coordinator_paths(processes.tls_dir))
    return [
        processes.start(f"coordinator{i}", "services.coordinator", "--listen", "127.0.0.1:0", *store, *tls)
        for i in range(3)
    ]


def test_a_client_fails_over_to_another_coordinator_within_two_seconds(processes: Processes, zookeeper: str) -> None:
    coordinators = _coordinators(processes, zookeeper)
    addresses = [address for _, address in coordinators]

    async def scenario() -> float:
        client = CoordinatorClient(addresses, dialer=member_in(processes.tls_dir, "n1"))  # as node n1, m1's
        outcome, group = await client.change_group("ha", CreateGroup(0, GroupMember("m1", "n1")))
        assert outcome is Outcome.APPLIED
        in_use = client.current_address
        victim = next(process for process, address in coordinators if address == in_use)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        started = time.monotonic()
        read = await client.read_group("ha")
        elapsed = time.monotonic() - started
        assert read == group, "the other coordinators serve the same store"
        assert client.current_address != in_use
        await client.close()
        return elapsed

    elapsed = asyncio.run(scenario())
    print(f"metadata call through another coordinator {elapsed * 1000:.0f} ms after SIGKILL")
    assert elapsed < FAILOVER_BOUND_SECONDS


def test_a_node_keeps_working_when_its_coordinator_is_killed(processes: Processes, zookeeper: str) -> None:
    coordinators = _coordinators(processes, zookeeper)
    addresses = ",".join(address for _, address in coordinators)
    tls = processes.tls_flags(certs.node_paths(processes.tls_dir, "node1"))
    _, node = processes.start(
        "node1", "services.node", "--id", "node1", "--listen", "127.0.0.1:0", "--coordinator", addresses, *tls
    )

    async def scenario() -> float:
        first = await GroupMembership.join(node, "before", tls=processes.client_tls, credentials=GUEST)
        os.kill(coordinators[0][0].pid, signal.SIGKILL)  # the node's client uses the first address first
        coordinators[0][0].wait()
        started = time.monotonic()
        # The join reads and writes the group table.
        second = await GroupMembership.join(node, "after", tls=processes.client_tls, credentials=GUEST)
        elapsed = time.monotonic() - started
        await second.broadcast([b"x"], confirmed=True)
        for membership in (first, second):
            await membership.close()
        return elapsed

    elapsed = asyncio.run(scenario())
    print(f"a node's join through another coordinator took {elapsed * 1000:.0f} ms after SIGKILL")
    assert elapsed < FAILOVER_BOUND_SECONDS
