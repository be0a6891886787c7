"""`ringqctl`'s queue commands against a real 3-node cluster.

declare_queue, delete_queue, purge_queue, sync_queue, cancel_sync_queue and
list_consumers through a node's QueueService, list_queues with the depth,
unacked, consumers and status a node reports, `--node` / $RINGQ_NODE tried in
turn, and one-line errors (exit 1) and usage errors (exit 2).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ringq import ctl as ringqctl
from services import cluster
from tests.clusters import NODE_ARGS, await_every_node_live, connection, ctl_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def info(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    directory = tmp_path_factory.mktemp("ringqctl")
    try:
        started = cluster.up(3, directory, node_args=NODE_ARGS, tls=True)
        await_every_node_live(started)
        yield started
    finally:
        cluster.down(directory)


@pytest.fixture(scope="module")
def dead_address() -> Iterator[str]:
    """An address that refuses connections: a port bound (so no one else takes it) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def ctl(info: cluster.ClusterInfo, *args: str, node_env: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RINGQ_NODE", "RINGQ_COORDINATOR")} | ctl_env(info)
    if node_env is not None:
        env["RINGQ_NODE"] = node_env
    nodes = [] if node_env is not None else ["--node", ",".join(info.node_addresses)]
    command = [sys.executable, "-m", "ringq.ctl", *nodes, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, env=env)


def ok(info: cluster.ClusterInfo, *args: str, node_env: str | None = None) -> str:
    result = ctl(info, *args, node_env=node_env)
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


def as_json(info: cluster.ClusterInfo, *args: str, node_env: str | None = None) -> Any:
    return json.loads(ok(info, "--json", *args, node_env=node_env))


def failed(info: cluster.ClusterInfo, *args: str, code: str) -> str:
    """The one-line error of a command that must fail with gRPC status `code`."""
    result = ctl(info, *args)
    assert result.returncode == 1, (args, result.stdout, result.stderr)
    assert result.stderr.startswith(f"ringqctl: {code}: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def queue_entry(info: cluster.ClusterInfo, name: str, *args: str, node_env: str | None = None) -> dict[str, Any]:
    listed = as_json(info, *args, "list_queues", node_env=node_env)["queues"]
    (entry,) = [q for q in listed if q["name"] == name]
    assert isinstance(entry, dict)
    return entry


def table_row(table: str, name: str) -> list[str]:
    """The cells of the row for queue `name` (the second column) of a list_queues table."""
    (row,) = [line.split() for line in table.splitlines()[1:] if line.split()[1] == name]
    return row


def test_declare_list_consumers_purge_and_delete(info: cluster.ClusterInfo) -> None:
    declared = ok(info, "declare_queue", "plain", "--durable")
    assert "queue 'plain' declared in vhost '/'" in declared and "status" in declared
    again = as_json(info, "declare_queue", "plain", "--durable")  # the same properties: the queue as it is
    assert again["queue"] == {"vhost": "/", "queue": "plain"} and again["status"] == "running"
    assert again["master_node"] in {n.name for n in info.nodes}
    overflow = 'x-overflow="reject-publish"'
    as_json(info, "declare_queue", "-p", "/", "capped", "--argument", "x-max-length=10", "--argument", overflow)
    assert queue_entry(info, "capped")["arguments"] == {"x-max-length": "10", "x-overflow": '"reject-publish"'}

    async def publish_and_consume() -> None:
        client = connection(info)
        await client.producer("plain").publish_many([b"m1", b"m2", b"m3"])
        entry = await asyncio.to_thread(queue_entry, info, "plain")
        assert (entry["depth"], entry["unacked"], entry["consumers"], entry["status"]) == ("3", "0", 0, "running")
        assert entry["status_error"] is None and entry["master"] == again["master_node"]
        consumer = client.consumer("plain", prefetch=1)
        await anext(aiter(consumer))  # held, not acknowledged
        table = await asyncio.to_thread(ok, info, "list_queues")
        assert table.splitlines()[0].split() == [
            *["vhost", "name", "master", "mirrors", "synchronised", "policy"],
            *["depth", "unacked", "consumers", "status", "events"],
        ]
        assert table_row(table, "plain")[-5:] == ["3", "1", "1", "running", "-"]
        consumers = await asyncio.to_thread(as_json, info, "list_consumers")
        assert {"vhost": "/", "queue": "plain", "consumers": 1, "status_error": None} in consumers["queues"]
        assert {"vhost": "/", "queue": "capped", "consumers": 0, "status_error": None} in consumers["queues"]
        shown = await asyncio.to_thread(ok, info, "list_consumers", "-p", "/")
        assert shown.splitlines()[0].split() == ["vhost", "queue", "consumers"]
        assert ["/", "plain", "1"] in [line.split() for line in shown.splitlines()]
        refused = await asyncio.to_thread(
            failed, info, "delete_queue", "plain", "--if-unused", code="FAILED_PRECONDITION"
        )
        assert "consumers" in refused
        await consumer.close()  # cancels the consumer: the message it held goes back
        while (await client.queue_status("plain")).consumers:
            await asyncio.sleep(0.02)
        await client.close()

    asyncio.run(publish_and_consume())
    assert "not empty" in failed(info, "delete_queue", "plain", "--if-empty", code="FAILED_PRECONDITION")
    assert "3 message(s) removed" in ok(info, "purge_queue", "plain")
    assert as_json(info, "purge_queue", "plain") == {"messages_purged": "0"}
    assert "queue 'plain' deleted from vhost '/'; 0 message(s) deleted" in ok(
        info, "delete_queue", "plain", "--if-empty"
    )
    assert as_json(info, "delete_queue", "capped", "--if-unused") == {"messages_deleted": "0"}
    assert [q["name"] for q in as_json(info, "list_queues")["queues"]] == []


def test_manual_sync_and_cancel(info: cluster.ClusterInfo) -> None:
    async def publish() -> None:
        client = connection(info, "node1")
        await client.declare_queue("manual.q")
        await client.producer("manual.q").publish_many([b"a", b"b", b"c"])
        await client.close()

    asyncio.run(publish())
    ok(info, "set_policy", "manual", "^manual\\.", '{"ha-mode":"all","ha-sync-mode":"manual"}')
    deadline = time.monotonic() + 10
    while len((entry := queue_entry(info, "manual.q"))["mirrors"]) < 2:
        assert time.monotonic() < deadline, entry
        time.sleep(0.1)
    assert entry["synchronised_mirrors"] == [], "new mirrors of a queue holding messages wait for a manual sync"
    assert table_row(ok(info, "list_queues", "-p", "/"), "manual.q")[4] == "-"
    while True:  # until the mirrors have joined the queue's group, a sync has no one to send to
        synced = as_json(info, "sync_queue", "manual.q")
        assert synced["queue"]["queue"] == "manual.q" and synced["depth"] == "3"
        if len(queue_entry(info, "manual.q")["synchronised_mirrors"]) == 2:
            break
        assert time.monotonic() < deadline + 10, "the mirrors were not synchronised"
        time.sleep(0.3)
    assert "has no unsynchronised mirror: nothing to sync" in ok(info, "sync_queue", "manual.q")
    cancelled = ok(info, "cancel_sync_queue", "manual.q")
    assert "sync of queue 'manual.q' in vhost '/' cancelled" in cancelled and "depth" in cancelled
    assert as_json(info, "cancel_sync_queue", "manual.q")["syncing"] == []
    ok(info, "delete_queue", "manual.q")
    ok(info, "clear_policy", "manual")


def test_errors_and_nodes_tried_in_turn(info: cluster.ClusterInfo, dead_address: str) -> None:
    assert "'no-such-queue'" in failed(info, "purge_queue", "no-such-queue", code="NOT_FOUND")
    failed(info, "sync_queue", "-p", "/", "no-such-queue", code="NOT_FOUND")
    for bad in ("x-max-length", "x-max-length=ten", "=1"):
        result = ctl(info, "declare_queue", "x", "--argument", bad)
        assert result.returncode == 2 and result.stderr.startswith("ringqctl: error: argument --argument"), result
    result = ctl(info, "--node", "no-port", "list_queues")
    assert result.returncode == 2 and "--node" in result.stderr
    ok(info, "declare_queue", "strict", "--durable")
    assert "durable" in failed(info, "declare_queue", "strict", code="FAILED_PRECONDITION")
    assert "x" not in [q["name"] for q in as_json(info, "list_queues")["queues"]], "the refused declare left nothing"

    # a node that refuses connections is skipped, one that answers serves
    either = f"{dead_address},{info.nodes[1].address}"
    assert as_json(info, "--node", either, "declare_queue", "strict", "--durable")["queue"]["queue"] == "strict"
    assert queue_entry(info, "strict", node_env=either)["status"] == "running"
    # no node answers: one line saying so (ringqctl never asks the coordinator itself)
    failed(info, "--node", dead_address, "list_queues", code="UNAVAILABLE")
    result = ctl(info, "list_consumers", node_env=dead_address)
    assert result.returncode == 1 and result.stderr.startswith("ringqctl: UNAVAILABLE: "), result.stderr
    failed(info, "--node", dead_address, "delete_queue", "strict", code="UNAVAILABLE")
    ok(info, "delete_queue", "strict")


def test_global_options_come_before_or_after_the_command(info: cluster.ClusterInfo, dead_address: str) -> None:
    """`ringqctl list_queues --json` as `ringqctl --json list_queues` (it was refused); one given after the
    command wins over the same before it; a command's own option of that name keeps its meaning."""
    ok(info, "declare_queue", "after.flags")
    after = json.loads(ok(info, "list_queues", "--json"))
    assert "after.flags" in [q["name"] for q in after["queues"]]
    assert json.loads(ok(info, "declare_queue", "after.flags", "--json", "--timeout", "5"))["queue"]["queue"] == (
        "after.flags"
    )
    # --node after the command: the dead node given before it is not used
    command = [sys.executable, "-m", "ringq.ctl", "--node", dead_address, "cluster_status", "--json"]
    env = os.environ | ctl_env(info)
    done = subprocess.run(
        [*command, "--node", info.nodes[0].address], capture_output=True, text=True, timeout=30, env=env
    )
    assert done.returncode == 0 and len(json.loads(done.stdout)["nodes"]) == 3, done.stderr
    parsed = ringqctl.parser().parse_args(["--user", "admin", "--password", "x", "list_permissions", "--user", "bob"])
    assert (parsed.auth_user, parsed.user) == ("admin", "bob"), "list_permissions --user filters, as before"
    result = ctl(info, "list_queues", "--no-such-flag")
    assert result.returncode == 2 and "--no-such-flag" in result.stderr
    ok(info, "delete_queue", "after.flags")


def test_drain_and_undrain_a_node(info: cluster.ClusterInfo) -> None:
    assert "is draining" in ok(info, "drain_node", "node2")
    nodes = {n["node"]: n for n in as_json(info, "cluster_status")["nodes"]}
    assert nodes["node2"].get("draining") is True and not nodes["node1"].get("draining")
    assert "takes new replicas again" in ok(info, "undrain_node", "node2")
    nodes = {n["node"]: n for n in as_json(info, "cluster_status")["nodes"]}
    assert not nodes["node2"].get("draining")
    failed(info, "drain_node", "node9", code="NOT_FOUND")
