"""A live cluster for integration tests: real node processes on 127.0.0.1, policies set, every node
live before the test starts, everything stopped afterwards; and how a test reaches it.

Test clusters run with mutual TLS between members and authenticated clients (`live_cluster`'s default,
and `tls=True` wherever a test calls `cluster.up`), as a production cluster does; a test acts as GUEST on
the nodes' client ports and as MEMBER, a node of the cluster CA that runs no node, where it needs the
internal API. The same helpers serve a plaintext cluster (plaintext channels, no credentials), kept for
the tests of the plaintext development mode itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

import ringq
from ringq import aio, security
from ringq.internal.v1 import coordinator_pb2, coordinator_pb2_grpc
from ringq.security import TLS, Credentials
from services import certs, cluster
from services.coordinator.client import CoordinatorClient
from services.tls import PLAINTEXT, Dialer

# Fast failure detection, so failovers in tests take a second rather than the default several.
NODE_ARGS = ["--failure-timeout-ms", "600", "--heartbeat-interval-ms", "100", "--grace-ms", "100"]

# Queues named ha.* mirrored on every node, synced automatically.
HA_ALL: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "ha": ("^ha\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
}
LIVE_WITHIN_SECONDS = 20.0
# The user a cluster starts with, accepted from loopback only (what tests on a TLS cluster act as).
GUEST = Credentials("guest", "guest")
# The cluster member a test acts as on the coordinator's and nodes' cluster ports: a node id no test
# cluster runs, whose certificate the cluster CA signs on demand.
MEMBER = "node9"


def client_tls(info: cluster.ClusterInfo) -> TLS:
    """What a client of a cluster started with `tls=True` trusts: the CA in its directory."""
    return TLS(ca=certs.ca_paths(info.tls_dir).certificate)


def access(info: cluster.ClusterInfo) -> dict[str, Any]:
    """The SDK's `tls` and `credentials` arguments for a client of `info` (none for a plaintext cluster)."""
    return {"tls": client_tls(info), "credentials": GUEST} if info.tls else {}


def credentials(info: cluster.ClusterInfo) -> Credentials | None:
    """Who a client of `info` acts as: GUEST on a TLS cluster, nobody on a plaintext one."""
    return GUEST if info.tls else None


def scoped(info: cluster.ClusterInfo, publisher_id: str) -> str:
    """A publisher id of GUEST's as `info`'s queues keep it (and deliveries show it): scoped to the user on
    a TLS cluster, the id itself on a plaintext one (services.access_guard.scoped_publisher)."""
    return f"{GUEST.user}\x1f{publisher_id}" if info.tls else publisher_id


def connection(info: cluster.ClusterInfo, *names: str, **options: Any) -> aio.Connection:
    """An asyncio connection to the nodes `names` of `info` in that order (every node if none), as GUEST
    over TLS on a TLS cluster; `options` go to aio.Connection."""
    by_name = {node.name: node.address for node in info.nodes}
    addresses = [by_name[name] for name in names] if names else info.node_addresses
    return aio.Connection(addresses, **access(info), **options)


def client_channel(
    info: cluster.ClusterInfo, address: str, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to the client port at `address` of a node of `info`: TLS trusting the cluster
    CA on a TLS cluster, plaintext on a plaintext one. Wrap its stubs in `as_guest`."""
    return security.aio_channel(address, client_tls(info) if info.tls else None, options)


def as_guest(info: cluster.ClusterInfo, stub: Any) -> Any:
    """`stub`, each of its calls authenticated as GUEST on a TLS cluster (unchanged on a plaintext one)."""
    return security.authenticated(stub, credentials(info))


def member(info: cluster.ClusterInfo, as_node: str = MEMBER) -> Dialer:
    """How a test reaches `info`'s coordinator and nodes' cluster ports as a cluster member: as node `as_node`
    (MEMBER unless told), with its certificate (made in the cluster's TLS directory if missing) on a TLS
    cluster; plaintext on a plaintext one."""
    return member_in(info.tls_dir, as_node) if info.tls else PLAINTEXT


def member_in(tls_dir: Path, as_node: str = MEMBER) -> Dialer:
    """A Dialer with the certificate of node `as_node` of the cluster CA in `tls_dir` (made if missing): for
    processes a test starts by hand, with no ClusterInfo."""
    certs.issue_node(tls_dir, as_node)
    return Dialer(certs.load_node(tls_dir, as_node))


def coordinator_channel(info: cluster.ClusterInfo) -> grpc.aio.Channel:
    """An asyncio channel to `info`'s coordinator (its internal API), as MEMBER on a TLS cluster."""
    return member(info).to_coordinator(info.coordinator.address)


def coordinator_client(info: cluster.ClusterInfo, **options: Any) -> CoordinatorClient:
    """A CoordinatorClient of `info`'s coordinator, as MEMBER on a TLS cluster; `options` go to it."""
    return CoordinatorClient(info.coordinator.address, dialer=member(info), **options)


async def cluster_ports(info: cluster.ClusterInfo) -> dict[str, int]:
    """Each registered node's cluster port, as `info`'s coordinator has it: where its peers reach it (on a
    plaintext cluster, its one port). For `cluster.start_node(..., cluster_port=)`."""
    async with coordinator_channel(info) as channel:
        listed = await coordinator_pb2_grpc.CoordinatorServiceStub(channel).ListNodes(
            coordinator_pb2.ListNodesRequest(), timeout=10
        )
    return {node.node: int((node.cluster_address or node.address).rsplit(":", 1)[1]) for node in listed.nodes}


async def peer_channel(
    info: cluster.ClusterInfo, node: str, options: Sequence[tuple[str, Any]] = (), *, as_node: str = MEMBER
) -> grpc.aio.Channel:
    """An asyncio channel to node `node`'s cluster port (PeerService, where its peers link to it), as cluster
    member `as_node` (MEMBER unless told) on a TLS cluster; to its one port on a plaintext cluster."""
    port = (await cluster_ports(info))[node]
    return member(info, as_node).to_node(node, f"{cluster.HOST}:{port}", options)


async def set_policy(info: cluster.ClusterInfo, name: str, pattern: str, definition: Mapping[str, Any]) -> None:
    """Set policy `name` (vhost /) through the nodes' AdminService of `info`, as GUEST on a TLS cluster."""
    async with aio.Admin(info.node_addresses, **access(info)) as admin:
        await admin.set_policy(name, pattern, definition)


def ctl_env(info: cluster.ClusterInfo) -> dict[str, str]:
    """The environment ringqctl needs to act on `info` as GUEST (TLS trusting its CA), none on plaintext."""
    if not info.tls:
        return {}
    ca = str(certs.ca_paths(info.tls_dir).certificate)
    return {"RINGQ_TLS_CA": ca, "RINGQ_USER": GUEST.user, "RINGQ_PASSWORD": GUEST.password}


def await_every_node_live(info: cluster.ClusterInfo) -> None:
    """Return once the coordinator counts every node of `info` live (so placement sees them all)."""
    with ringq.Admin(info.node_addresses, **access(info)) as admin:
        deadline = time.monotonic() + LIVE_WITHIN_SECONDS
        while sum(node.alive for node in admin.cluster_status().nodes) < len(info.nodes):
            assert time.monotonic() < deadline, f"not every node was live within {LIVE_WITHIN_SECONDS:g} s"
            time.sleep(0.05)


async def every_node_live(info: cluster.ClusterInfo) -> None:
    """Return once the coordinator counts every node of `info` live (so placement sees them all)."""
    async with aio.Admin(info.node_addresses, **access(info)) as admin:
        deadline = time.monotonic() + LIVE_WITHIN_SECONDS
        while sum(node.alive for node in (await admin.cluster_status()).nodes) < len(info.nodes):
            assert time.monotonic() < deadline, f"not every node was live within {LIVE_WITHIN_SECONDS:g} s"
            await asyncio.sleep(0.05)


@contextmanager
def live_cluster(
    directory: Path,
    policies: Mapping[str, tuple[str, Mapping[str, Any]]] = HA_ALL,
    nodes: int = 3,
    node_args: Sequence[str] = NODE_ARGS,
    tls: bool = True,
) -> Iterator[cluster.ClusterInfo]:
    """`nodes` nodes and a coordinator in `directory`, with mutual TLS and users (`tls` False: the plaintext
    development mode), with `policies` (name -> (pattern, definition)), each node started with `node_args`;
    yields once the coordinator counts every node live."""
    info = cluster.up(nodes, directory, node_args=node_args, tls=tls)
    try:
        with ringq.Admin(info.node_addresses, **access(info)) as admin:
            for name, (pattern, definition) in policies.items():
                admin.set_policy(name, pattern, definition)
        await_every_node_live(info)
        yield info
    finally:
        cluster.down(directory)
