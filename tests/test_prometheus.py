"""`ringq node --prometheus HOST:PORT`: the node's metrics in the Prometheus text format, scraped over HTTP
from a real node process, with no OTLP endpoint set (--prometheus alone turns metrics on).

A queue gets 20 messages; 6 are taken with basic.get, 5 of them acknowledged; another queue has a
consumer. The scrape then shows, for the first queue, 20 published, 6 delivered, 5 acknowledged, 15
messages of which 14 ready and 1 unacknowledged; one consumer on the other; the ring round trip
histogram; the node's identity and health; the process collectors. Names as docs/observability.md
lists them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import ringq
from services import cluster
from tests.clusters import NODE_ARGS, access
from tests.zookeeper import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
WITHIN_SECONDS = 20.0
QUEUE = "metrics.orders"
IDLE = "metrics.idle"


def scrape(address: str) -> list[Sample]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The value of the one sample `name` whose labels include `labels`, or None."""
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, f"{len(found)} samples of {name} {labels}"
    return found[0] if found else None


def await_values(address: str, expected: dict[tuple[str, str], float]) -> list[Sample]:
    """Scrape until every (metric, queue) of `expected` has its value; the last scrape."""
    deadline = time.monotonic() + WITHIN_SECONDS
    while True:
        samples = scrape(address)
        seen = {key: value(samples, key[0], ringq_queue=key[1], ringq_vhost="/") for key in expected}
        if seen == expected:
            return samples
        assert time.monotonic() < deadline, f"not within {WITHIN_SECONDS:g} s: {seen} (expected {expected})"
        time.sleep(0.1)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[cluster.ClusterInfo, str]]:
    for variable in [v for v in os.environ if v.startswith("OTEL_")]:
        monkeypatch.delenv(variable)  # no OTLP: --prometheus alone turns metrics on
    address = f"127.0.0.1:{free_port()}"
    info = cluster.up(1, tmp_path / "cluster", node_args=[*NODE_ARGS, "--prometheus", address], tls=True)
    try:
        yield info, address
    finally:
        cluster.down(tmp_path / "cluster")


def test_a_scrape_shows_the_queues_the_node_masters(node: tuple[cluster.ClusterInfo, str]) -> None:
    info, address = node
    with ringq.Connection(info.node_addresses, **access(info)) as connection:
        connection.declare_queue(QUEUE)
        connection.declare_queue(IDLE)
        producer = connection.producer(QUEUE)
        producer.publish_many([f"m{k}".encode() for k in range(20)])
        producer.close()
        taken = [connection.get(QUEUE) for _ in range(6)]
        for delivery in taken[:5]:
            assert delivery is not None
            connection.settle(delivery)
        consumer = connection.consumer(IDLE)
        assert consumer.next(timeout=0.1) is None  # starts it
        try:
            samples = await_values(
                address,
                {
                    ("ringq_queue_messages_published_total", QUEUE): 20.0,
                    ("ringq_queue_messages_delivered_total", QUEUE): 6.0,
                    ("ringq_queue_messages_acked_total", QUEUE): 5.0,
                    ("ringq_queue_messages", QUEUE): 15.0,
                    ("ringq_queue_messages_ready", QUEUE): 14.0,
                    ("ringq_queue_messages_unacked", QUEUE): 1.0,
                    ("ringq_queue_consumers", QUEUE): 0.0,
                    ("ringq_queue_consumers", IDLE): 1.0,
                    ("ringq_queue_messages", IDLE): 0.0,
                },
            )
        finally:
            consumer.close()
    assert value(samples, "ringq_queue_messages", ringq_queue=QUEUE, ringq_node="node1") == 15.0
    group = {s.labels["ringq_group"] for s in samples if s.name == "ringq_ring_round_trip_duration_seconds_count"}
    assert group, "no ring round trip was recorded"
    count = sum(s.value for s in samples if s.name == "ringq_ring_round_trip_duration_seconds_count")
    assert count > 0
    buckets = [s for s in samples if s.name == "ringq_ring_round_trip_duration_seconds_bucket"]
    assert {"0.001", "+Inf"} <= {s.labels["le"] for s in buckets}, "seconds, with sub-millisecond buckets"
    assert value(samples, "ringq_identity_info", ringq_node="node1", ringq_version=ringq.__version__) == 1.0
    assert value(samples, "ringq_node_serving", ringq_node="node1") == 1.0
    assert value(samples, "target_info", service_name="ringq-node", ringq_process="node1") == 1.0
    assert (value(samples, "process_resident_memory_bytes") or 0) > 0
    assert not [s for s in samples if "otel_scope_name" in s.labels]


def test_a_prometheus_port_already_taken_is_one_line_and_exit_1(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run(
            [sys.executable, "-m", "services.node", "--id", "n1", "--coordinator", "127.0.0.1:1",
             "--data-dir", str(tmp_path / "n1"), "--prometheus", address],
            cwd=REPO, capture_output=True, text=True, timeout=30, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"ringq node: cannot listen on {address} (--prometheus): Address already in use", done.stderr
