"""The gRPC health service (grpc.health.v1.Health) of nodes and coordinators, as real processes on 127.0.0.1.

A node answers NOT_SERVING on its plaintext --health-listen port from the start, while it waits for the
coordinator; SERVING once registered and joined; NOT_SERVING while drained (ringqctl drain_node) and
SERVING again after undrain_node; NOT_SERVING first when it gets SIGTERM. Its client port answers the same
without credentials. A coordinator is SERVING while it reaches its store and NOT_SERVING while ZooKeeper
is down. With TLS, the health service needs no credentials on a node's client port, and on the cluster
ports (a node's, a coordinator's) any certificate of the cluster CA will do, a member's or not, while every
other service there still refuses a non-member.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringq.internal.v1 import coordinator_pb2, coordinator_pb2_grpc
from ringq.v1 import queue_pb2, queue_pb2_grpc
from services import certs, cluster
from services.health_probe import main as probe_main
from tests.clusters import GUEST, NODE_ARGS
from tests.zookeeper import ZooKeeperServer, free_port, unavailable_reason

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
WITHIN_SECONDS = 20.0


def check(channel: grpc.Channel, service: str = "") -> str:
    """The status the health service on `channel` gives `service`."""
    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name


def plaintext_status(address: str, service: str = "") -> str:
    with grpc.insecure_channel(address) as channel:
        return check(channel, service)


def await_status(address: str, expected: str, seconds: float = WITHIN_SECONDS) -> None:
    """Return once the plaintext health service at `address` answers `expected` (a port not listening yet
    is asked again)."""
    deadline = time.monotonic() + seconds
    last = "no answer"
    while True:
        try:
            last = plaintext_status(address)
        except grpc.RpcError as error:
            last = f"{error.code().name}" if isinstance(error, grpc.Call) else repr(error)
        if last == expected:
            return
        assert time.monotonic() < deadline, f"{address} did not answer {expected} within {seconds:g} s (last: {last})"
        time.sleep(0.05)


@contextmanager
def running(command: Sequence[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`command` as a process logging to `log`, killed on the way out if still running."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def await_file(path: Path, process: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + WITHIN_SECONDS
    while not path.exists():
        assert process.poll() is None, f"the process exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{path} was not written within {WITHIN_SECONDS:g} s"
        time.sleep(0.05)
    return path.read_text()


def client_status(address: str, ca: bytes, service: str = "") -> str:
    """The status the health service on a node's client port at `address` gives `service`: over TLS trusting
    the CA `ca`, with no credentials."""
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
        return check(channel, service)


def ringqctl(node: str, tls_dir: Path, *args: str) -> None:
    """ringqctl `args` through `node`, as guest over TLS trusting the CA in `tls_dir`."""
    as_guest = [
        "--tls-ca",
        str(certs.ca_paths(tls_dir).certificate),
        "--user",
        GUEST.user,
        "--password",
        GUEST.password,
    ]
    command = [sys.executable, "-m", "ringq.ctl", "--node", node, *as_guest, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 0, done.stderr


class Watcher(threading.Thread):
    """Every status a health Watch stream at `address` sends, until the stream ends."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(address)
        self.statuses: list[str] = []
        self.first = threading.Event()
        self.ended: str = ""

    def run(self) -> None:
        stream = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=""))
        try:
            for response in stream:
                self.statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
                self.first.set()
        except grpc.RpcError as error:
            self.ended = error.code().name if isinstance(error, grpc.Call) else repr(error)
        finally:
            self.first.set()
            self.channel.close()


def test_a_node_serves_once_registered_and_not_while_drained_or_stopping(tmp_path: Path) -> None:
    """With TLS and authentication on, as a production cluster runs (the --health-listen ports are plaintext
    whatever the cluster's ports are: they are for probes that cannot do TLS)."""
    tls_dir = tmp_path / "tls"
    certs.cluster_material(tls_dir, ["node1"])
    ca = certs.ca_paths(tls_dir).certificate

    def tls_flags(issued: certs.Issued) -> list[str]:
        return ["--tls-ca", str(ca), "--tls-cert", str(issued.certificate), "--tls-key", str(issued.key)]

    coordinator = f"127.0.0.1:{free_port()}"
    coordinator_health = f"127.0.0.1:{free_port()}"
    node_health = f"127.0.0.1:{free_port()}"
    ready = tmp_path / "run" / "node1.ready"
    ready.parent.mkdir(parents=True)
    node_command = [
        sys.executable, "-m", "services.node", "--id", "node1", "--listen", "127.0.0.1:0",
        "--coordinator", coordinator, "--health-listen", node_health, "--ready-file", str(ready),
        "--data-dir", str(tmp_path / "data" / "node1"), *tls_flags(certs.node_paths(tls_dir, "node1")), *NODE_ARGS,
    ]  # fmt: skip
    coordinator_command = [
        sys.executable, "-m", "services.coordinator", "--listen", coordinator, "--db", str(tmp_path / "c.db"),
        "--health-listen", coordinator_health, "--ready-file", str(tmp_path / "run" / "coordinator.ready"),
        *tls_flags(certs.coordinator_paths(tls_dir)),
    ]  # fmt: skip
    with running(node_command, tmp_path / "logs" / "node1.log") as node:
        # No coordinator yet: the node cannot register, and says so on its health port.
        await_status(node_health, "NOT_SERVING")
        assert probe_main([node_health]) == 1
        assert not ready.exists()
        with running(coordinator_command, tmp_path / "logs" / "coordinator.log"):
            await_status(coordinator_health, "SERVING")
            await_status(node_health, "SERVING")
            assert probe_main([node_health]) == 0
            address = await_file(ready, node)
            # The client port serves the health service too, for every service name the node serves.
            authority = ca.read_bytes()
            assert client_status(address, authority) == "SERVING"
            assert client_status(address, authority, "ringq.v1.QueueService") == "SERVING"
            with pytest.raises(grpc.RpcError) as unknown:
                client_status(address, authority, "no.such.Service")
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

            ringqctl(address, tls_dir, "drain_node", "node1")
            await_status(node_health, "NOT_SERVING")
            assert client_status(address, authority) == "NOT_SERVING"
            ringqctl(address, tls_dir, "undrain_node", "node1")
            await_status(node_health, "SERVING")

            # SIGTERM: NOT_SERVING is the first thing the node says, before it stops serving.
            watcher = Watcher(node_health)
            watcher.start()
            assert watcher.first.wait(10) and watcher.statuses == ["SERVING"]
            node.send_signal(signal.SIGTERM)
            assert node.wait(30) == 0
            watcher.join(10)
            assert watcher.statuses == ["SERVING", "NOT_SERVING"], (watcher.statuses, watcher.ended)


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"no ZooKeeper here: {unavailable_reason()}")
def test_a_coordinator_is_not_serving_while_its_zookeeper_is_down(tmp_path: Path) -> None:
    health = f"127.0.0.1:{free_port()}"
    with ZooKeeperServer() as zookeeper:
        command = [
            sys.executable, "-m", "services.coordinator", "--listen", "127.0.0.1:0", "--store", "zookeeper",
            "--zookeeper", zookeeper.hosts, "--zookeeper-root", f"/health-{uuid.uuid4().hex}",
            "--health-listen", health,
        ]  # fmt: skip
        with running(command, tmp_path / "logs" / "coordinator.log"):
            await_status(health, "SERVING")
            zookeeper.stop()
            await_status(health, "NOT_SERVING")
            zookeeper.start()
            await_status(health, "SERVING", seconds=40)


def test_with_tls_the_health_service_needs_no_credentials(tmp_path: Path) -> None:
    info = cluster.up(1, tmp_path / "cluster", node_args=NODE_ARGS, tls=True)
    try:
        tls_dir = info.tls_dir
        ca = certs.ca_paths(tls_dir).certificate.read_bytes()
        node1 = certs.node_paths(tls_dir, "node1")
        member = grpc.ssl_channel_credentials(ca, node1.key.read_bytes(), node1.certificate.read_bytes())
        with grpc.secure_channel(info.coordinator.address, member) as channel:
            listed = coordinator_pb2_grpc.CoordinatorServiceStub(channel).ListNodes(coordinator_pb2.ListNodesRequest())
            (record,) = listed.nodes
        # The client port: TLS trusting the CA, and no user, no password.
        client_port = grpc.ssl_channel_credentials(ca)
        with grpc.secure_channel(info.nodes[0].address, client_port) as channel:
            deadline = time.monotonic() + WITHIN_SECONDS
            while check(channel) != "SERVING":
                assert time.monotonic() < deadline, "node1 was not SERVING on its client port"
                time.sleep(0.05)
            assert check(channel, "ringq.v1.QueueService") == "SERVING"
        # The cluster ports take certificates of the cluster CA only; a user's (not a member's) will do here.
        user = certs.issue_user(tls_dir, "alice")
        alice = grpc.ssl_channel_credentials(ca, user.key.read_bytes(), user.certificate.read_bytes())
        for credentials in (alice, member):
            for address in (record.cluster_address, info.coordinator.address):
                with grpc.secure_channel(address, credentials) as channel:
                    assert check(channel) == "SERVING", address
        # Everything else on those ports still wants a member.
        with grpc.secure_channel(record.cluster_address, alice) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                request = queue_pb2.QueueStatusRequest(queue=queue_pb2.QueueRef(vhost="/", queue="q"))
                queue_pb2_grpc.QueueServiceStub(channel).QueueStatus(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with grpc.secure_channel(info.coordinator.address, alice) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                coordinator_pb2_grpc.CoordinatorServiceStub(channel).ListNodes(
                    coordinator_pb2.ListNodesRequest(), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        cluster.down(tmp_path / "cluster")


def test_a_health_port_already_taken_is_one_line_and_exit_1(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        for command in (
            ["services.node", "--id", "n1", "--coordinator", "127.0.0.1:1", "--data-dir", str(tmp_path / "n1")],
            ["services.coordinator", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db")],
        ):
            done = subprocess.run(
                [sys.executable, "-m", *command, "--health-listen", address],
                cwd=REPO, capture_output=True, text=True, timeout=30, check=False, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            assert done.returncode == 1, done.stderr
            last = done.stderr.strip().splitlines()[-1]
            assert f"cannot listen on {address} (--health-listen)" in last, done.stderr
