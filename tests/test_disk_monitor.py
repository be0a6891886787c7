"""A node's disk-free alarm: the rule (services/disk_monitor.py), its shell, the node flag, and the
coordinator keeping what heartbeats report (records.node_heartbeat, ClusterStatus)."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import pytest

from ringq.internal.v1 import coordinator_pb2
from ringq.v1 import cluster_pb2
from services import node
from services.coordinator import records
from services.coordinator.records import DiskReport
from services.disk_monitor import MEBIBYTE, DiskMonitor, disk_alarm, free_bytes_at
from tests.memory_store import MemoryStore
from tests.test_coordinator_api import run


@pytest.mark.parametrize(
    ("free_bytes", "limit_bytes", "alarm"),
    [
        (0, 0, False),  # 0 disables the alarm, even on a full disk
        (10**12, 0, False),
        (49 * MEBIBYTE, 50 * MEBIBYTE, True),
        (50 * MEBIBYTE - 1, 50 * MEBIBYTE, True),
        (50 * MEBIBYTE, 50 * MEBIBYTE, False),  # exactly the limit is enough
        (0, 1, True),
        (10**12, 50 * MEBIBYTE, False),
    ],
)
def test_the_alarm_is_on_below_the_limit(free_bytes: int, limit_bytes: int, alarm: bool) -> None:
    assert disk_alarm(free_bytes, limit_bytes) is alarm


def _free_bytes(directory: Path) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def test_a_limit_above_the_free_space_raises_the_alarm(tmp_path: Path) -> None:
    limit_bytes = _free_bytes(tmp_path) + 1024 * MEBIBYTE
    monitor = DiskMonitor("node1", str(tmp_path), limit_bytes)
    assert not monitor.alarm and monitor.free_bytes is None and monitor.reason() == "", "unmeasured: no alarm"
    asyncio.run(monitor.measure())
    assert monitor.alarm and monitor.free_bytes is not None and monitor.limit_bytes == limit_bytes
    match = re.fullmatch(r"disk free (\d+) MiB is below the limit of (\d+) MiB on node1", monitor.reason())
    assert match is not None, monitor.reason()
    assert int(match[1]) == monitor.free_bytes // MEBIBYTE and int(match[2]) == limit_bytes // MEBIBYTE


@pytest.mark.parametrize("limit_bytes", [0, 1])
def test_no_alarm_without_a_limit_or_with_room(tmp_path: Path, limit_bytes: int) -> None:
    monitor = DiskMonitor("node1", str(tmp_path), limit_bytes)
    asyncio.run(monitor.measure())
    assert monitor.free_bytes is not None and not monitor.alarm and monitor.reason() == ""


def test_a_data_directory_not_created_yet_is_measured_on_its_parent(tmp_path: Path) -> None:
    assert abs(free_bytes_at(str(tmp_path / "data" / "node1")) - _free_bytes(tmp_path)) < 64 * MEBIBYTE


def test_a_failed_measurement_keeps_the_last_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monitor = DiskMonitor("node1", str(tmp_path), _free_bytes(tmp_path) + 1024 * MEBIBYTE)
    asyncio.run(monitor.measure())
    free_bytes = monitor.free_bytes

    def gone(path: Any) -> os.statvfs_result:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "statvfs", gone)
    asyncio.run(monitor.measure())
    assert monitor.alarm and monitor.free_bytes == free_bytes


def test_a_negative_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be >= 0 bytes"):
        DiskMonitor("node1", str(tmp_path), -1)


# ------------------------------------------------------------------------------------ the node's flag

NODE_ARGS = ["--id", "node1", "--coordinator", "127.0.0.1:7000"]


def test_the_flag_defaults_to_50_mib_and_0_disables() -> None:
    assert node.parser().parse_args(NODE_ARGS).disk_free_limit_mb == 50 * MEBIBYTE
    assert node.NodeSettings().disk_free_limit_bytes == 50 * MEBIBYTE
    assert node.parser().parse_args([*NODE_ARGS, "--disk-free-limit-mb", "0"]).disk_free_limit_mb == 0
    assert node.parser().parse_args([*NODE_ARGS, "--disk-free-limit-mb", "2048"]).disk_free_limit_mb == 2**31


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", f"expected 0 <= MiB <= {node.MAX_DISK_FREE_LIMIT_MB}, got -1"),
        ("1.5", "expected a whole number of MiB, got '1.5'"),
        ("50MB", "expected a whole number of MiB, got '50MB'"),
        (str(node.MAX_DISK_FREE_LIMIT_MB + 1), f"got {node.MAX_DISK_FREE_LIMIT_MB + 1}"),
    ],
)
def test_a_bad_flag_is_a_usage_error(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        node.parser().parse_args([*NODE_ARGS, "--disk-free-limit-mb", value])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--disk-free-limit-mb" in error and message in error, error


# ----------------------------------------------------------------------------- kept by the coordinator


def test_heartbeats_keep_the_disk_report_with_the_node() -> None:
    store = MemoryStore()
    records.register_node(store, "n1", "127.0.0.1:1")
    records.register_node(store, "n2", "127.0.0.1:2")
    records.node_heartbeat(store, "n1", 1000, DiskReport(12 * MEBIBYTE, 50 * MEBIBYTE, alarm=True))
    records.node_heartbeat(store, "n2", 1000)  # an older node: no report
    records.node_heartbeat(store, "n1", 900, DiskReport(10**12, 50 * MEBIBYTE, alarm=False))  # late: ignored
    n1, n2 = records.list_nodes(store)
    assert n1.disk == DiskReport(12 * MEBIBYTE, 50 * MEBIBYTE, alarm=True) and n1.last_heartbeat_unix_ms == 1000
    assert n2.disk == DiskReport(None, None, alarm=False)


def test_cluster_status_shows_each_nodes_disk(tmp_path: Path) -> None:
    async def scenario(stub: Any, admin: Any) -> None:
        for name in ("n1", "n2", "n3"):
            await stub.RegisterNode(coordinator_pb2.RegisterNodeRequest(node=name, address=f"127.0.0.1:1{name[-1]}"))
        full = coordinator_pb2.NodeHeartbeatRequest(
            node="n1", disk_free_bytes=12 * MEBIBYTE, disk_free_limit_bytes=50 * MEBIBYTE, disk_alarm=True
        )
        await stub.NodeHeartbeat(full)
        await stub.NodeHeartbeat(coordinator_pb2.NodeHeartbeatRequest(node="n2"))  # an older node
        status = await admin.ClusterStatus(cluster_pb2.ClusterStatusRequest())
        n1, n2, n3 = status.nodes
        assert (n1.disk_free_bytes, n1.disk_free_limit_bytes, n1.disk_alarm) == (12 * MEBIBYTE, 50 * MEBIBYTE, True)
        for silent in (n2, n3):
            assert not silent.HasField("disk_free_bytes") and not silent.HasField("disk_free_limit_bytes")
            assert not silent.disk_alarm

    run(tmp_path, scenario)
