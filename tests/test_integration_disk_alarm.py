"""Integration: a node whose disk has less free space than its --disk-free-limit-mb raises its disk
alarm, and `ringqctl cluster_status` shows it (table and --json), from the node's own heartbeats."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from services import cluster
from services.disk_monitor import MEBIBYTE
from tests.clusters import NODE_ARGS
from tests.test_ringqctl_queues import as_json, ok

pytestmark = pytest.mark.integration


def test_a_node_below_its_disk_free_limit_shows_the_alarm(tmp_path: Path) -> None:
    stats = os.statvfs(tmp_path)
    limit_mb = stats.f_bavail * stats.f_frsize // MEBIBYTE + 1024  # a GiB more than the disk has free
    directory = tmp_path / "cluster"
    try:
        info = cluster.up(1, directory, node_args=[*NODE_ARGS, "--disk-free-limit-mb", str(limit_mb)], tls=True)
        deadline = time.monotonic() + 20
        while not (node := as_json(info, "cluster_status")["nodes"][0]).get("disk_alarm"):
            assert time.monotonic() < deadline, f"no disk alarm reported: {node}"
            time.sleep(0.1)
        assert node["node"] == "node1" and node["alive"]
        assert int(node["disk_free_limit_bytes"]) == limit_mb * MEBIBYTE  # 64-bit counts are JSON strings
        assert 0 < int(node["disk_free_bytes"]) < limit_mb * MEBIBYTE
        header, row = ok(info, "cluster_status").splitlines()[:2]
        assert "disk free  disk limit  disk alarm  memory used  memory watermark  memory alarm" in header, header
        cells = row.split()
        assert row.startswith("node1") and cells[-9:-5] == ["MiB", str(limit_mb), "MiB", "ALARM"], row
        assert cells[-1] == "no", "no memory alarm"
    finally:
        cluster.down(directory)
