"""Users, vhosts and permissions on a live TLS cluster: every public call authenticated and authorised.

The attacks of the security issue that a client with the protos could make: any call without
credentials, with a wrong password, in another vhost, on queues its permissions do not cover, cluster
administration without the tags for it, and publishing under another user's publisher id. Each is
refused with UNAUTHENTICATED or PERMISSION_DENIED, and the queues' messages are intact.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest

from ringq import aio
from ringq.errors import PermissionDenied, RingqError
from ringq.security import Credentials
from ringq.v1 import admin_pb2_grpc, cluster_pb2
from services import certs, cluster
from tests.clusters import GUEST, NODE_ARGS, client_tls

pytestmark = pytest.mark.integration

WAIT = 15.0
ALICE = Credentials("alice", "alice-secret")
MALLORY = Credentials("mallory", "mallory-secret")
BOB = Credentials("bob", "bob-secret")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    directory = tmp_path_factory.mktemp("access")
    info = cluster.up(3, directory, tls=True, node_args=NODE_ARGS)
    try:
        asyncio.run(_users(info))
        yield info
    finally:
        cluster.down(directory)


def _admin(info: cluster.ClusterInfo, credentials: Credentials | None) -> aio.Admin:
    return aio.Admin(info.node_addresses, tls=client_tls(info), credentials=credentials, timeout=WAIT)


def _connection(info: cluster.ClusterInfo, credentials: Credentials | None, *, vhost: str = "/") -> aio.Connection:
    return aio.Connection(
        info.node_addresses,
        tls=client_tls(info),
        credentials=credentials,
        vhost=vhost,
        retry_for=3.0,
        call_timeout=WAIT,
    )


async def _users(info: cluster.ClusterInfo) -> None:
    """As guest (from loopback): vhost v1; alice may use alice.* in /, mallory may write alice.* too,
    bob only monitors; every node live."""
    async with _admin(info, GUEST) as admin:
        deadline = time.monotonic() + WAIT
        while sum(node.alive for node in (await admin.cluster_status()).nodes) < 3:
            assert time.monotonic() < deadline, "not every node was live"
            await asyncio.sleep(0.05)
        await admin.add_vhost("v1")
        await admin.add_user("alice", ALICE.password)
        await admin.add_user("mallory", MALLORY.password)
        await admin.add_user("bob", BOB.password, ["monitoring"])
        await admin.set_permissions("alice", configure="^alice\\.", write="^alice\\.", read="^alice\\.")
        await admin.set_permissions("mallory", write="^alice\\.")


async def _refused(call: Awaitable[Any], code: grpc.StatusCode) -> str:
    """The details of the refusal of `call` (an SDK call, or a raw stub's), which must have `code`."""
    try:
        await call
    except RingqError as error:
        assert error.code == code, (error.code, error.details)
        return error.details
    except grpc.aio.AioRpcError as error:
        assert error.code() == code, (error.code(), error.details())
        return error.details() or ""
    raise AssertionError(f"expected {code.name}, the call succeeded")


async def _eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------------------------ tests


def test_calls_without_valid_credentials_are_unauthenticated(secure: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        for credentials in (None, Credentials("alice", "wrong"), Credentials("nobody", "x")):
            async with _connection(secure, credentials) as connection:
                details = await _refused(connection.queue_status("alice.q"), grpc.StatusCode.UNAUTHENTICATED)
                assert "credentials" in details or "wrong password" in details, details
                await _refused(connection.declare_queue("alice.q"), grpc.StatusCode.UNAUTHENTICATED)
            async with _admin(secure, credentials) as admin:
                await _refused(admin.cluster_status(), grpc.StatusCode.UNAUTHENTICATED)

    asyncio.run(scenario())


def test_permissions_bound_each_user_to_its_names_and_vhosts(secure: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with _connection(secure, GUEST) as guest:
            await guest.declare_queue("shared", durable=True)
        async with _connection(secure, ALICE) as alice:
            await alice.declare_queue("alice.q", durable=True)
            producer = alice.producer("alice.q")
            assert await producer.publish(b"mine") is aio.Outcome.CONFIRMED
            await producer.close()
            delivery = await alice.get("alice.q", no_ack=True)
            assert delivery is not None and delivery.body == b"mine"
            # Outside alice.*: refused, whatever the operation; the queue of another is untouched.
            details = await _refused(alice.declare_queue("other.q"), grpc.StatusCode.PERMISSION_DENIED)
            assert "alice" in details and "configure" in details and "other.q" in details, details
            await _refused(alice.get("shared"), grpc.StatusCode.PERMISSION_DENIED)
            await _refused(alice.purge_queue("shared"), grpc.StatusCode.PERMISSION_DENIED)
            await _refused(alice.delete_queue("shared"), grpc.StatusCode.PERMISSION_DENIED)
            intruder = alice.producer("shared")
            with pytest.raises(PermissionDenied) as refused:
                await intruder.publish(b"not yours")
            assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
            await intruder.close()
        async with _connection(secure, ALICE, vhost="v1") as elsewhere:
            details = await _refused(elsewhere.declare_queue("alice.q"), grpc.StatusCode.PERMISSION_DENIED)
            assert "no permissions in vhost 'v1'" in details, details
        async with _connection(secure, GUEST) as guest:
            status = await guest.queue_status("shared")
            assert status.depth == 0, "a refused publish added a message"

    asyncio.run(scenario())


def test_administration_needs_tags(secure: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with _admin(secure, ALICE) as alice:
            details = await _refused(alice.cluster_status(), grpc.StatusCode.PERMISSION_DENIED)
            assert "tag" in details, details
            await _refused(alice.set_policy("all-ttl", ".*", {"message-ttl": 1}), grpc.StatusCode.PERMISSION_DENIED)
        async with _admin(secure, BOB) as bob:
            assert len((await bob.cluster_status()).nodes) == 3  # monitoring may look
            await _refused(bob.set_policy("all-ttl", ".*", {"message-ttl": 1}), grpc.StatusCode.PERMISSION_DENIED)
        async with _admin(secure, BOB) as bob:
            await _refused(bob.add_user("eve", "x", ["administrator"]), grpc.StatusCode.PERMISSION_DENIED)
            # No response of the public API carries a password hash.
            users = await bob.list_users()
            assert {u.name for u in users} >= {"guest", "alice", "bob"}
            assert "$argon2" not in str(users)

    asyncio.run(scenario())


def test_a_publisher_id_is_scoped_to_its_user(secure: cluster.ClusterInfo) -> None:
    """mallory may write to alice's queues but cannot make alice's messages duplicates by publishing
    first under alice's publisher id with higher sequence numbers."""

    async def scenario() -> None:
        async with _connection(secure, ALICE) as alice:
            await alice.declare_queue("alice.scoped", durable=True)
        async with _connection(secure, MALLORY) as mallory:
            forger = mallory.producer("alice.scoped", publisher_id="alice-publisher")
            outcomes = await forger.publish_many([f"forged-{k}".encode() for k in range(100)])
            assert set(outcomes) == {aio.Outcome.CONFIRMED}
            await forger.close()
        async with _connection(secure, ALICE) as alice:
            producer = alice.producer("alice.scoped", publisher_id="alice-publisher")
            outcomes = await producer.publish_many([f"real-{k}".encode() for k in range(10)])
            assert set(outcomes) == {aio.Outcome.CONFIRMED}, "alice's messages were taken for duplicates"
            await producer.close()
            assert (await alice.queue_status("alice.scoped")).depth == 110

    asyncio.run(scenario())


def test_permission_changes_reach_every_node(secure: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with _connection(secure, ALICE) as alice:
            await alice.declare_queue("alice.revoked")
        async with _admin(secure, GUEST) as admin:
            await admin.clear_permissions("alice")
        for node in secure.nodes:
            connection = aio.Connection(node.address, tls=client_tls(secure), credentials=ALICE, retry_for=0.5)

            async def refused(connection: aio.Connection = connection) -> bool:
                try:
                    await connection.queue_status("alice.revoked")
                except RingqError as error:
                    return isinstance(error, PermissionDenied)
                return False

            await _eventually(refused, f"{node.name} to refuse alice once her permissions were cleared")
            await connection.close()

    asyncio.run(scenario())


def test_ringqctl_manages_users_over_tls(secure: cluster.ClusterInfo) -> None:
    ca = str(certs.ca_paths(secure.tls_dir).certificate)

    def ctl(*args: str, user: str = "guest", password: str = "guest") -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ringq.ctl", "--node", ",".join(secure.node_addresses), "--tls-ca", ca]
        command += ["--user", user, "--password", password, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)

    added = ctl("add_user", "carol", "carol-pw", "--tags", "monitoring")
    assert added.returncode == 0, added.stderr
    assert "carol" in ctl("list_users").stdout
    shown = ctl("cluster_status", user="carol", password="carol-pw")
    assert shown.returncode == 0, shown.stderr
    refused = ctl("add_vhost", "x", user="carol", password="carol-pw")
    assert refused.returncode == 1 and refused.stderr.startswith("ringqctl: PERMISSION_DENIED: "), refused.stderr
    bad = ctl("list_users", user="carol", password="nope")
    assert bad.returncode == 1 and bad.stderr.startswith("ringqctl: UNAUTHENTICATED: "), bad.stderr
    assert ctl("set_permissions", "carol", "", "", "^c").returncode == 0
    listed = ctl("--json", "list_permissions", "--user", "carol")
    assert '"read": "^c"' in listed.stdout, listed.stdout
    unknown_tag = ctl("add_user", "dave", "pw", "--tags", "root")
    assert unknown_tag.returncode == 1 and "INVALID_ARGUMENT" in unknown_tag.stderr, unknown_tag.stderr
    assert ctl("delete_user", "carol").returncode == 0
    assert "carol" not in ctl("list_users").stdout
    assert ctl("list_permissions", "--user", "carol").stdout.strip().count("\n") == 0  # the header only
    # A queue of its own keeps "/" in use: the test used to rely on the queues of the tests before it, and
    # failed when run alone.
    held = ctl("declare_queue", "ctl.holds-the-vhost")
    assert held.returncode == 0, held.stderr
    in_use = ctl("delete_vhost", "/")
    assert in_use.returncode == 1 and "FAILED_PRECONDITION" in in_use.stderr, in_use.stderr


def test_the_coordinator_is_not_for_clients(secure: cluster.ClusterInfo) -> None:
    """Clients reach AdminService on nodes; the coordinator's port wants a member certificate."""

    async def scenario() -> None:
        ca = certs.ca_paths(secure.tls_dir).certificate.read_bytes()
        options = [("grpc.ssl_target_name_override", "coordinator.ringq")]
        async with grpc.aio.secure_channel(
            secure.coordinator.address, grpc.ssl_channel_credentials(ca), options=options
        ) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            await _refused(
                stub.ClusterStatus(cluster_pb2.ClusterStatusRequest(), metadata=GUEST.metadata(), timeout=5),
                grpc.StatusCode.UNAVAILABLE,
            )

    asyncio.run(scenario())
