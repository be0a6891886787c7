"""A live cluster for integration tests: real node processes on 127.0.0.1, policies set, every node
live before the test starts, everything stopped afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ringq
from ringq import aio
from ringq.security import TLS, Credentials
from services import certs, cluster

# Fast failure detection, so failovers in tests take a second rather than the default several.
NODE_ARGS = ["--failure-timeout-ms", "600", "--heartbeat-interval-ms", "100", "--grace-ms", "100"]

# Queues named ha.* mirrored on every node, synced automatically.
HA_ALL: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "ha": ("^ha\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
}
LIVE_WITHIN_SECONDS = 20.0
# The user a cluster starts with, accepted from loopback only (what tests on a TLS cluster act as).
GUEST = Credentials("guest", "guest")


def client_tls(info: cluster.ClusterInfo) -> TLS:
    """What a client of a cluster started with `tls=True` trusts: the CA in its directory."""
    return TLS(ca=certs.ca_paths(info.tls_dir).certificate)


def access(info: cluster.ClusterInfo) -> dict[str, Any]:
    """The SDK's `tls` and `credentials` arguments for a client of `info` (none for a plaintext cluster)."""
    return {"tls": client_tls(info), "credentials": GUEST} if info.tls else {}


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
    tls: bool = False,
) -> Iterator[cluster.ClusterInfo]:
    """`nodes` nodes and a coordinator in `directory` (with mutual TLS and users if `tls`), with `policies`
    (name -> (pattern, definition)), each node started with `node_args`; yields once the coordinator counts
    every node live."""
    info = cluster.up(nodes, directory, node_args=node_args, tls=tls)
    try:
        with ringq.Admin(info.node_addresses, **access(info)) as admin:
            for name, (pattern, definition) in policies.items():
                admin.set_policy(name, pattern, definition)
        await_every_node_live(info)
        yield info
    finally:
        cluster.down(directory)
