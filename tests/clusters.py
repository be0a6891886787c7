"""A live cluster for integration tests: real node processes on 127.0.0.1, policies set, every node
live before the test starts, everything stopped afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ringq
from services import cluster
from tests.test_integration_queue import NODE_ARGS

# Queues named ha.* mirrored on every node, synced automatically.
HA_ALL: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "ha": ("^ha\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
}


@contextmanager
def live_cluster(
    directory: Path, policies: Mapping[str, tuple[str, Mapping[str, Any]]] = HA_ALL, nodes: int = 3
) -> Iterator[cluster.ClusterInfo]:
    """`nodes` nodes and a coordinator in `directory`, with `policies` (name -> (pattern, definition))."""
    info = cluster.up(nodes, directory, node_args=NODE_ARGS)
    try:
        admin = ringq.Admin(info.coordinator.address)
        for name, (pattern, definition) in policies.items():
            admin.set_policy(name, pattern, definition)
        admin.close()
        time.sleep(2.0)  # every node's heartbeat has reached the coordinator: all are live
        yield info
    finally:
        cluster.down(directory)
