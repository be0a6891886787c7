"""Integration: ringqctl's stream commands and the blocking stream producer and consumer, against a live TLS
cluster of four nodes (a stream of three groups).

declare_stream, stream_status (table and --json), list_streams and delete_stream as a user runs them
(`python -m ringq.ctl`, TLS and GUEST from the environment); 200 messages through ringq.Connection's
stream_producer and stream_consumer, in order, with the producer's lease shown by stream_status while it
holds it.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ringq
from services import cluster
from tests.clusters import access, ctl_env, live_cluster

pytestmark = pytest.mark.integration

NODES = 4
MESSAGES = 200


@pytest.fixture
def four(tmp_path: Path) -> Iterator[cluster.ClusterInfo]:
    with live_cluster(tmp_path / "c", nodes=NODES, tls=True) as info:
        yield info


def ctl(info: cluster.ClusterInfo, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RINGQ_NODE"} | ctl_env(info)
    command = [sys.executable, "-m", "ringq.ctl", "--node", ",".join(info.node_addresses), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, env=env)


def ok(info: cluster.ClusterInfo, *args: str) -> str:
    result = ctl(info, *args)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result.stdout


def as_json(info: cluster.ClusterInfo, *args: str) -> Any:
    return json.loads(ok(info, *args, "--json"))


def test_ringqctl_stream_verbs_and_a_blocking_round_trip(four: cluster.ClusterInfo) -> None:
    declared = ok(four, "declare_stream", "orders").splitlines()
    assert declared[:2] == ["stream 'orders' declared in vhost '/'", "stream 'orders' in vhost '/': durable, 3 groups"]

    status = as_json(four, "stream_status", "orders")
    assert status["stream"] == {"vhost": "/", "stream": "orders"} and status["durable"] is True
    groups = status["groups"]
    assert [g["group"] for g in groups] == [f"stream/orders/{n}" for n in (1, 2, 3)]
    masters = [g["master_node"] for g in groups]
    assert all(masters) and len(set(masters)) == 3, masters  # each group's master on a node of its own
    for g in groups:
        assert len(g["mirrors"]) == 1 and g["mirrors"][0] != g["master_node"], g
    assert status["send_list"] and set(status["send_list"]) <= {g["group"] for g in groups}
    assert status["consume_state"] == ""
    assert {lease["role"] for lease in status["leases"]} == {"STREAM_ROLE_PRODUCER", "STREAM_ROLE_CONSUMER"}

    text = ok(four, "stream_status", "orders").splitlines()
    assert text[:2] == ["stream 'orders' in vhost '/': durable, 3 groups", "consumption: not waiting"]
    assert text[2].split(None, 2) == ["send", "list", ", ".join(status["send_list"])]
    for g in groups:  # a row per group: group, master, mirrors, synchronised, depth...
        (row,) = [line.split() for line in text if line.startswith(g["group"] + " ")]
        assert row[:3] == [g["group"], g["master_node"], g["mirrors"][0]]

    listed = ok(four, "list_streams").splitlines()
    assert [line.split()[:4] for line in listed[1:]] == [["/", "orders", "yes", "3"]]
    assert [s["stream"]["stream"] for s in as_json(four, "list_streams")["streams"]] == ["orders"]

    with ringq.Connection(four.node_addresses, **access(four)) as connection:
        with connection.stream_producer("orders") as producer:
            futures = [producer.send(f"m{i}".encode()) for i in range(MESSAGES)]
            seqs = [future.result(30) for future in futures]
            assert all(seq >> 32 == producer.fencing_token for seq in seqs)
            assert all(b > a for a, b in itertools.pairwise(seqs))
            held = as_json(four, "stream_status", "orders")["leases"]
            (lease,) = [lease for lease in held if lease["role"] == "STREAM_ROLE_PRODUCER"]
            assert lease["holder"] and int(lease["fencing_token"]) == producer.fencing_token, lease
            assert f"#{producer.fencing_token}" in ok(four, "list_streams")

        got: list[tuple[int, bytes]] = []
        with connection.stream_consumer("orders") as consumer:
            while len(got) < MESSAGES:
                message = consumer.next(30)
                assert message is not None, f"{len(got)} of {MESSAGES}; the broker: {consumer.waiting}"
                got.append((message.stream_seq, message.body))
                message.ack()
            assert consumer.duplicates_dropped == 0
        assert got == [(seq, f"m{i}".encode()) for i, seq in enumerate(seqs)]

    assert "deleted" in ok(four, "delete_stream", "orders")
    gone = ctl(four, "stream_status", "orders")
    assert gone.returncode == 1 and gone.stderr.startswith("ringqctl: NOT_FOUND: "), gone.stderr
    assert gone.stderr.count("\n") == 1
    assert as_json(four, "list_streams")["streams"] == []
