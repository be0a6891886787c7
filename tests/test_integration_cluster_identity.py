"""Cluster identity over mutual TLS, against a live cluster started with `tls=True`.

The attacks of the security issue that needed no credentials at all: a process dialling a node's
cluster port without a certificate, with a certificate of another CA, or with a real node's
certificate while claiming to be another node; ring frames in another node's members' names; group
changes and registrations for another node; an application joining a queue's group. Each is refused
with the status the docs name, and the queue's confirmed messages come out intact and in order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ringq import aio
from ringq.errors import PermissionDenied
from ringq.group import GroupMembership
from ringq.internal.v1 import coordinator_pb2, coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc
from ringq.v1 import queue_pb2, queue_pb2_grpc
from services import certs, cluster
from services.gm.links import PROTOCOL_MAJOR
from services.tls import ClusterTLS, Dialer
from tests.clusters import GUEST, NODE_ARGS, client_tls

pytestmark = pytest.mark.integration

QUEUE = "ha.identity"
MESSAGES = 200
WAIT = 15.0


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    directory = tmp_path_factory.mktemp("identity")
    info = cluster.up(3, directory, tls=True, node_args=NODE_ARGS)
    try:
        asyncio.run(_prepare(info))
        yield info
    finally:
        cluster.down(directory)


def _member(info: cluster.ClusterInfo, node: str) -> ClusterTLS:
    return certs.load_node(info.tls_dir, node)


def _coordinator(info: cluster.ClusterInfo, as_node: str = "node3") -> grpc.aio.Channel:
    return Dialer(_member(info, as_node)).to_coordinator(info.coordinator.address)


async def _prepare(info: cluster.ClusterInfo) -> None:
    """Mirror ha.* on every node (ringq's Admin, over TLS to a node) and wait until every node is live."""
    async with aio.Admin(info.node_addresses, tls=client_tls(info), credentials=GUEST, timeout=WAIT) as admin:
        await admin.set_policy("ha", "^ha\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
        deadline = time.monotonic() + WAIT
        while sum(node.alive for node in (await admin.cluster_status()).nodes) < 3:
            assert time.monotonic() < deadline, "not every node was live"
            await asyncio.sleep(0.05)
    addresses = [node.address for node in info.nodes]
    async with aio.Connection(addresses, tls=client_tls(info), credentials=GUEST, retry_for=WAIT) as connection:
        await connection.declare_queue(QUEUE, durable=True)
        deadline = time.monotonic() + WAIT
        while len((await connection.queue_status(QUEUE)).synchronised_mirrors) < 2:
            assert time.monotonic() < deadline, "the queue's mirrors did not synchronise"
            await asyncio.sleep(0.05)


async def _cluster_addresses(info: cluster.ClusterInfo) -> dict[str, str]:
    async with _coordinator(info) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        response = await stub.ListNodes(coordinator_pb2.ListNodesRequest(), timeout=WAIT)
    return {node.node: node.cluster_address for node in response.nodes}


async def _queue_members(info: cluster.ClusterInfo) -> tuple[str, dict[str, str]]:
    """The queue's GM group and its live members by node."""
    async with _coordinator(info) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        record = await stub.GetQueue(coordinator_pb2.GetQueueRequest(vhost="/", name=QUEUE), timeout=WAIT)
        group = record.queue.gm_group
        members = await stub.ReadGroup(coordinator_pb2.ReadGroupRequest(group=group), timeout=WAIT)
    return group, {m.node: m.id for m in members.group.members if m.alive}


def _hello(node: str) -> peer_pb2.PeerFrame:
    return peer_pb2.PeerFrame(protocol_major=PROTOCOL_MAJOR, hello=peer_pb2.Hello(node=node, incarnation="intruder"))


async def _open_link(channel: grpc.aio.Channel, node: str) -> Any:
    """A Link stream whose Hello names `node`; returns the call once the node answered with its Hello."""
    call: Any = peer_pb2_grpc.PeerServiceStub(channel).Link(None)
    await call.write(_hello(node))
    answer = await asyncio.wait_for(call.read(), WAIT)
    if answer is grpc.aio.EOF:  # type: ignore[attr-defined]
        await call.code()  # raises nothing: the status says why
    return call


async def _link_status(channel: grpc.aio.Channel, node: str) -> grpc.StatusCode:
    call: Any = peer_pb2_grpc.PeerServiceStub(channel).Link(None)
    try:
        await call.write(_hello(node))
        await asyncio.wait_for(call.read(), WAIT)
    except grpc.aio.AioRpcError as error:
        return error.code()
    code: grpc.StatusCode = await call.code()
    return code


def _log_size(process: cluster.ProcessInfo) -> int:
    return process.log.stat().st_size


def _log_since(process: cluster.ProcessInfo, offset: int) -> str:
    with open(process.log, "rb") as log:
        log.seek(offset)
        return log.read().decode("utf-8", "replace")


# ------------------------------------------------------------------------------------------------ tests


def test_confirmed_messages_flow_over_tls_and_plaintext_clients_are_refused(secure: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        addresses = [node.address for node in secure.nodes]
        async with aio.Connection(addresses, tls=client_tls(secure), credentials=GUEST, retry_for=WAIT) as connection:
            producer = connection.producer(QUEUE, persistent=True)
            outcomes = await producer.publish_many([f"m{k:03d}".encode() for k in range(MESSAGES)])
            assert all(outcome is aio.Outcome.CONFIRMED for outcome in outcomes), set(outcomes)
            await producer.close()
        # A plaintext client reaches nothing: the handshake fails.
        async with grpc.aio.insecure_channel(addresses[0]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await queue_pb2_grpc.QueueServiceStub(channel).QueueStatus(
                    queue_pb2.QueueStatusRequest(queue=queue_pb2.QueueRef(vhost="/", queue=QUEUE)), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_a_cluster_port_refuses_callers_without_a_certificate_of_the_cluster_ca(
    secure: cluster.ClusterInfo, tmp_path: Path
) -> None:
    async def scenario() -> None:
        target = (await _cluster_addresses(secure))["node2"]
        ca = certs.ca_paths(secure.tls_dir).certificate.read_bytes()
        # No client certificate: the TLS handshake fails.
        anonymous = grpc.ssl_channel_credentials(ca)
        options = [("grpc.ssl_target_name_override", "node2.node.ringq")]
        async with grpc.aio.secure_channel(target, anonymous, options=options) as channel:
            assert await _link_status(channel, "node1") == grpc.StatusCode.UNAVAILABLE
        # A certificate naming node1, but from another CA: refused alike.
        certs.issue_node(tmp_path / "other-ca", "node1")
        other = certs.load_node(tmp_path / "other-ca", "node1")
        forged = grpc.ssl_channel_credentials(ca, other.key, other.certificate)
        async with grpc.aio.secure_channel(target, forged, options=options) as channel:
            assert await _link_status(channel, "node1") == grpc.StatusCode.UNAVAILABLE
        # The coordinator alike.
        async with grpc.aio.secure_channel(
            secure.coordinator.address, anonymous, options=[("grpc.ssl_target_name_override", "coordinator.ringq")]
        ) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await coordinator_pb2_grpc.CoordinatorServiceStub(channel).ListNodes(
                    coordinator_pb2.ListNodesRequest(), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_a_node_cannot_speak_for_another_node(secure: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        target = (await _cluster_addresses(secure))["node2"]
        group, members = await _queue_members(secure)
        assert set(members) == {"node1", "node2", "node3"}, members
        node2 = secure.process("node2")
        offset = _log_size(node2)
        # node4: a member of the cluster CA that runs no node (so no real node4 competes for its link).
        certs.issue_node(secure.tls_dir, "node4")
        async with Dialer(_member(secure, "node4")).to_node("node2", target) as channel:
            # node4's certificate, a Hello naming node1: refused.
            assert await _link_status(channel, "node1") == grpc.StatusCode.PERMISSION_DENIED
            # node4's own link, carrying a publication forged in the name of node1's member: dropped.
            call = await _open_link(channel, "node4")
            forged = peer_pb2.PublisherActivity(publisher=members["node1"], first_seq=10**6, pubs=[b"forged"])
            message = peer_pb2.RingMessage(
                group=group,
                sender=members["node1"],
                receiver=members["node2"],
                view_version=1,
                activity=peer_pb2.Activity(publishers=[forged]),
            )
            await call.write(peer_pb2.PeerFrame(protocol_major=PROTOCOL_MAJOR, ring_message=message))
            deadline = time.monotonic() + WAIT
            wanted = f"dropped a ring message from node node4 in the name of '{members['node1']}'"
            while wanted not in _log_since(node2, offset):
                assert time.monotonic() < deadline, _log_since(node2, offset)[-2000:]
                await asyncio.sleep(0.05)
            call.cancel()
            # AddOnRight for a newcomer of node1, asked by node4: refused.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await peer_pb2_grpc.PeerServiceStub(channel).AddOnRight(
                    peer_pb2.AddOnRightRequest(
                        group=group, left=members["node2"], newcomer="node1.intruder01", newcomer_node="node1"
                    ),
                    timeout=WAIT,
                )
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # The coordinator: node4 may not record node1's member dead, nor anyone's without an actor,
        # nor register or heartbeat as node1.
        async with _coordinator(secure, "node4") as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            current = await stub.ReadGroup(coordinator_pb2.ReadGroupRequest(group=group), timeout=WAIT)
            version = current.group.version
            calls: list[tuple[Any, grpc.StatusCode]] = [
                (
                    stub.MarkMemberDead(
                        coordinator_pb2.MarkMemberDeadRequest(
                            group=group, expected_version=version, member=members["node2"], actor=members["node1"]
                        ),
                        timeout=WAIT,
                    ),
                    grpc.StatusCode.PERMISSION_DENIED,
                ),
                (
                    stub.MarkMemberDead(
                        coordinator_pb2.MarkMemberDeadRequest(
                            group=group, expected_version=version, member=members["node1"], actor=""
                        ),
                        timeout=WAIT,
                    ),
                    grpc.StatusCode.INVALID_ARGUMENT,
                ),
                (
                    stub.RegisterNode(
                        coordinator_pb2.RegisterNodeRequest(node="node1", address="127.0.0.1:1"), timeout=WAIT
                    ),
                    grpc.StatusCode.PERMISSION_DENIED,
                ),
                (
                    stub.NodeHeartbeat(coordinator_pb2.NodeHeartbeatRequest(node="node1"), timeout=WAIT),
                    grpc.StatusCode.PERMISSION_DENIED,
                ),
            ]
            for call_, expected in calls:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call_
                assert refused.value.code() == expected, refused.value.details()
            after = await stub.ReadGroup(coordinator_pb2.ReadGroupRequest(group=group), timeout=WAIT)
            assert all(member.alive for member in after.group.members), after.group

    asyncio.run(scenario())


def test_an_application_cannot_join_a_queues_group(secure: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        group, _ = await _queue_members(secure)
        with pytest.raises(PermissionDenied) as refused:
            await GroupMembership.join(
                secure.nodes[0].address, group, timeout=WAIT, tls=client_tls(secure), credentials=GUEST
            )
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        # Application groups work over TLS.
        member = await GroupMembership.join(
            secure.nodes[0].address, "app.identity", timeout=WAIT, tls=client_tls(secure), credentials=GUEST
        )
        assert await member.broadcast([b"hello"], confirmed=True) == (1, 1)
        await member.close()

    asyncio.run(scenario())


def test_the_queue_is_intact_after_the_attacks(secure: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        addresses = [node.address for node in secure.nodes]
        async with aio.Connection(addresses, tls=client_tls(secure), credentials=GUEST, retry_for=WAIT) as connection:
            bodies = []
            consumer = connection.consumer(QUEUE, prefetch=50)
            async for delivery in consumer:
                bodies.append(delivery.body)
                delivery.ack()
                if len(bodies) == MESSAGES:
                    break
            await consumer.close()
            assert bodies == [f"m{k:03d}".encode() for k in range(MESSAGES)]
            info = await connection.queue_status(QUEUE)
            assert sorted(info.synchronised_mirrors) == sorted({"node1", "node2", "node3"} - {info.master_node})

    asyncio.run(scenario())
