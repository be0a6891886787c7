"""Users who authenticate with a client certificate (RabbitMQ's EXTERNAL mechanism) on a live TLS cluster.

Each node also serves clients on a certificate port (--certificate-listen), where a client must present
a certificate of the cluster CA; the certificate's common name is its user, who needs no password. The
tests: a passwordless user works there with its permissions, and nowhere with a password; a certificate
of an unknown user is UNAUTHENTICATED; a certificate of another CA does not get through the handshake;
a user certificate cannot reach the cluster port; permissions bind a certificate user as any other;
ringqctl and the Node.js client authenticate with a certificate too.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ringq import aio
from ringq.errors import RingqError
from ringq.security import TLS, Credentials
from services import certs, cluster
from tests.clusters import GUEST, NODE_ARGS, client_tls

pytestmark = pytest.mark.integration

WAIT = 15.0
NODE_CLIENT = Path(__file__).resolve().parents[1] / "clients" / "node"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[cluster.ClusterInfo, list[str]]]:
    """A TLS cluster whose nodes also serve a certificate port; carol has a certificate and no password."""
    directory = tmp_path_factory.mktemp("certificate-users")
    info = cluster.up(2, directory, tls=True, node_args=[*NODE_ARGS, "--certificate-listen", "127.0.0.1:0"])
    try:
        yield info, asyncio.run(_prepare(info))
    finally:
        cluster.down(directory)


async def _prepare(info: cluster.ClusterInfo) -> list[str]:
    """Users carol (no password; carol.* in /) and dave (never created); the nodes' certificate ports."""
    async with aio.Admin(info.node_addresses, tls=client_tls(info), credentials=GUEST, timeout=WAIT) as admin:
        deadline = time.monotonic() + WAIT
        while True:
            nodes = (await admin.cluster_status()).nodes
            if len(nodes) == 2 and all(node.alive and node.certificate_address for node in nodes):
                break
            assert time.monotonic() < deadline, f"nodes not live with certificate ports: {nodes}"
            await asyncio.sleep(0.05)
        await admin.add_user("carol", "")
        await admin.set_permissions("carol", configure="^carol\\.", write="^carol\\.", read="^carol\\.")
    return [node.certificate_address for node in nodes]


def _as_user(info: cluster.ClusterInfo, user: str, directory: Path | None = None) -> TLS:
    issued = certs.issue_user(directory or info.tls_dir, user)
    ca = certs.ca_paths(directory or info.tls_dir).certificate
    # A certificate made by another CA is offered to nodes that trust the cluster's CA only.
    return TLS(
        ca=certs.ca_paths(info.tls_dir).certificate if directory else ca, certificate=issued.certificate, key=issued.key
    )


def _connection(addresses: list[str], tls: TLS, credentials: Credentials | None = None) -> aio.Connection:
    return aio.Connection(
        addresses, tls=tls, credentials=credentials, retry_for=2.0, call_timeout=WAIT, connect_timeout=2.0
    )


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except RingqError as error:
        return error.code
    return grpc.StatusCode.OK


def test_a_passwordless_user_publishes_and_consumes_with_its_certificate(
    secure: tuple[cluster.ClusterInfo, list[str]],
) -> None:
    info, certificate_ports = secure

    async def scenario() -> None:
        async with _connection(certificate_ports, _as_user(info, "carol")) as carol:
            await carol.declare_queue("carol.orders", durable=True)
            producer = carol.producer("carol.orders", publisher_id="carol-1")
            for n in range(5):
                assert await producer.publish(f"m{n}".encode()) is aio.Outcome.CONFIRMED
            await producer.close()
            bodies = []
            for _ in range(5):
                delivery = await carol.get("carol.orders", no_ack=True)
                assert delivery is not None
                bodies.append(delivery.body)
            assert bodies == [f"m{n}".encode() for n in range(5)]
            # The certificate names carol: her permissions bind her as any user's bind them.
            assert await _code(carol.declare_queue("other.q")) == grpc.StatusCode.PERMISSION_DENIED

    asyncio.run(scenario())


def test_a_passwordless_user_cannot_log_in_with_a_password(secure: tuple[cluster.ClusterInfo, list[str]]) -> None:
    info, _ = secure

    async def scenario() -> None:
        for password in ("", "guess"):
            async with _connection(info.node_addresses, client_tls(info), Credentials("carol", password)) as carol:
                assert await _code(carol.queue_status("carol.orders")) == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(scenario())


def test_certificates_of_unknown_users_or_other_cas_are_refused(
    secure: tuple[cluster.ClusterInfo, list[str]], tmp_path: Path
) -> None:
    info, certificate_ports = secure

    async def scenario() -> None:
        async with _connection(certificate_ports, _as_user(info, "dave")) as dave:
            assert await _code(dave.queue_status("carol.orders")) == grpc.StatusCode.UNAUTHENTICATED
        # carol's name, signed by a CA the cluster does not trust: no handshake, so never served.
        async with _connection(certificate_ports, _as_user(info, "carol", tmp_path / "rogue")) as forged:
            assert await _code(forged.queue_status("carol.orders")) == grpc.StatusCode.UNAVAILABLE
        # Without a certificate, the certificate port does not even complete the handshake.
        async with _connection(certificate_ports, client_tls(info), GUEST) as anonymous:
            assert await _code(anonymous.queue_status("carol.orders")) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_a_user_certificate_cannot_reach_the_cluster_port(secure: tuple[cluster.ClusterInfo, list[str]]) -> None:
    info, _ = secure

    async def scenario() -> None:
        async with aio.Admin(info.node_addresses, tls=client_tls(info), credentials=GUEST, timeout=WAIT) as admin:
            node1 = next(node for node in (await admin.cluster_status()).nodes if node.node == "node1")
        carol = _as_user(info, "carol")
        # A cluster port's certificate names its node, not a host: check the name node1's carries.
        tls = TLS(ca=carol.ca, certificate=carol.certificate, key=carol.key, server_name="node1.node.ringq")
        async with _connection([node1.cluster_address], tls) as intruder:
            assert await _code(intruder.queue_status("carol.orders")) in (
                grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNAUTHENTICATED,
            )

    asyncio.run(scenario())


def test_ringqctl_adds_a_passwordless_user_who_then_administers_with_a_certificate(
    secure: tuple[cluster.ClusterInfo, list[str]],
) -> None:
    info, certificate_ports = secure
    ca = str(certs.ca_paths(info.tls_dir).certificate)

    def ringqctl(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ringq.ctl", "--tls-ca", ca, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    nodes = ",".join(info.node_addresses)
    as_guest = ["--node", nodes, "--user", "guest", "--password", "guest"]
    added = ringqctl(*as_guest, "add_user", "ops", "--tags", "monitoring")
    assert added.returncode == 0 and "client certificate" in added.stdout, added
    # The queue verbs send the credentials too (they failed with an AttributeError once a user was given).
    for verb in (["declare_queue", "ops.q"], ["list_queues"], ["delete_queue", "ops.q"]):
        done = ringqctl(*as_guest, *verb)
        assert done.returncode == 0, (verb, done)
    issued = certs.issue_user(info.tls_dir, "ops")
    as_ops = [
        "--node",
        ",".join(certificate_ports),
        "--tls-cert",
        str(issued.certificate),
        "--tls-key",
        str(issued.key),
    ]
    status = ringqctl(*as_ops, "--json", "cluster_status")
    assert status.returncode == 0, status
    assert sorted(node["node"] for node in json.loads(status.stdout)["nodes"]) == ["node1", "node2"]
    # Monitoring only: creating a user needs the administrator tag.
    refused = ringqctl(*as_ops, "add_user", "eve", "secret")
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr, refused


def test_the_node_client_publishes_and_consumes_with_a_user_certificate(
    secure: tuple[cluster.ClusterInfo, list[str]],
) -> None:
    node = shutil.which("node")
    if node is None or not (NODE_CLIENT / "node_modules").is_dir():
        pytest.skip("Node.js or clients/node's packages are missing (make setup-node)")
    info, certificate_ports = secure
    issued = certs.issue_user(info.tls_dir, "carol")
    ca = str(certs.ca_paths(info.tls_dir).certificate)
    as_carol = ["--tls-ca", ca, "--tls-cert", str(issued.certificate), "--tls-key", str(issued.key)]
    where = ["--address", ",".join(certificate_ports), "--queue", "carol.node", "--count", "20"]

    def cli(*args: str) -> dict[str, object]:
        done = subprocess.run([node, "cli.js", *args], cwd=NODE_CLIENT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done
        result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    cli("publish", *where, "--declare", *as_carol)
    consumed = cli("consume", *where, *as_carol)
    assert consumed["consumed"] == 20
