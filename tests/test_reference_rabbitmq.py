"""The RabbitMQ reference of `make bench` works: a 3-node mirrored cluster starts, W1 measures a rate, all stops.

Opt-in (RINGQ_BENCH_REFERENCE=1): it needs Debian's rabbitmq-server and about
40 s, and `make test` must not need RabbitMQ.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from bench.reference.rabbitmq_cluster import SETUP_HINT, RabbitCluster, unavailable_reason
from bench.reference.rabbitmq_workloads import Durations, run_w1

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.environ.get("RINGQ_BENCH_REFERENCE") != "1",
        reason="the RabbitMQ reference benchmark runs only with RINGQ_BENCH_REFERENCE=1",
    ),
]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_w1_on_a_mirrored_three_node_cluster_then_everything_stops() -> None:
    problem = unavailable_reason()
    if problem is not None:
        pytest.fail(f"RINGQ_BENCH_REFERENCE=1 but RabbitMQ cannot run: {problem}; {SETUP_HINT}", pytrace=False)
    with RabbitCluster(3) as cluster:
        directory = cluster.directory
        assert directory is not None
        ports = [cluster.epmd_port, *cluster.amqp_ports]
        assert 5672 not in ports and 25672 not in ports and 4369 not in ports
        assert cluster.version.startswith("3.")
        assert len(cluster.node_names) == 3
        pids = cluster.pids()
        assert len(pids) >= 7  # epmd, and per node the rabbitmq-server script and its VM
        result = run_w1(cluster, Durations(warmup_s=0.5, measure_s=1.0))
        assert result.rate is not None and result.rate > 0, result
    assert cluster.pids() == []
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    for port in ports:
        assert not _listening(port), f"port {port} still accepts connections"
    assert not directory.exists()
