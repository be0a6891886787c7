"""Fault tests in network namespaces: partitions must not cost a mirrored queue its replicas or its confirms.

Every host is a Linux network namespace on a private bridge (tests/netns.py); every client of the cluster
runs inside a namespace, as a driver process: this module's commands (`python -m
tests.test_partition_integrity COMMAND ...`) and those of tests/test_partition.py, which it reuses (the
producers, setup, drain and history check). Two scenarios, each one run shared by the tests that judge
it (ARCHITECTURE.md sections 3, 5 and 11):

- A cut between a mirror's host and the master's host only (each still reaches the third node, the
  coordinator and the clients): a silent drop both ways for some seconds while two producers publish,
  then healed. Afterwards the queue has all three replicas again, synchronised, by itself; no confirmed
  message is lost and each publisher's messages come in order (redeliveries aside).
- The coordinator beside one node (same host) and the three other nodes cut off from that host: the
  side that reaches the coordinator must not confirm alone. While the partition lasts no publish to the
  lone node is confirmed, and the queue's status says it is below its minimum of synchronised mirrors
  (policy key ha-min-synchronised, 1 by default for a mirrored queue; event kind
  "below_min_synchronised"). After the heal the cluster converges (one master, every mirror
  synchronised) and every confirmed message is delivered, in per-publisher order. Run with the queue's
  master on the lone node and on the other side.

A first test checks the per-pair cut itself. Skipped unless this machine lets root make network
namespaces. Every wait polls a state against a deadline. Cases 3b and 4 failed before ha-min-synchronised,
the queue's events, re-placement on record changes and neighbours watched from when they became neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ringq.v1 import admin_pb2_grpc, cluster_pb2
from tests import netns
from tests import test_partition as partition

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODULE = "tests.test_partition_integrity"
QUEUE = partition.QUEUE
CLIENT_HOST = "cl"
BEFORE_CUT = 300  # confirms each producer has before the cut
AFTER_STRIKE = 200  # confirms each producer gets after a replica is struck, before the heal
CUT_LIMIT_SECONDS = 15.0  # a cut lasts at most this long, whatever it waits for
CONVERGE_SECONDS = 20.0  # once the heal is over and the producers stopped (generous: a loaded 2-core machine)
DRAIN_SECONDS = 20.0  # at most, for the few thousand messages published
COORDINATOR_LIVENESS_SECONDS = 5.0  # the coordinator's default (services/coordinator/server.py)
POLL_SECONDS = 0.1


# ============================================================================ the drivers (in namespaces)


async def _liveness(coordinator: str) -> dict[str, bool]:
    async with partition._coordinator_channel(coordinator) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        response = await stub.ClusterStatus(cluster_pb2.ClusterStatusRequest(), timeout=2.0)
    return {node.node: node.alive for node in response.nodes}


async def _struck(coordinator: str, replicas: int, deadline: float) -> dict[str, Any]:
    """Wait until the queue record places fewer than `replicas` replicas (master and mirrors)."""
    stop = time.monotonic() + deadline
    while True:
        record = await partition._queue_record(coordinator)
        placed = [record.master, *record.mirrors]
        if len(placed) < replicas or time.monotonic() > stop:
            return {"struck": len(placed) < replicas, "placed": placed, "at": time.monotonic()}
        await asyncio.sleep(POLL_SECONDS)


async def _not_live(coordinator: str, nodes: list[str], deadline: float) -> dict[str, Any]:
    """Wait until the coordinator counts none of `nodes` live (their heartbeats stopped reaching it)."""
    stop = time.monotonic() + deadline
    while True:
        alive = await _liveness(coordinator)
        if not any(alive.get(node, False) for node in nodes) or time.monotonic() > stop:
            return {"not_live": not any(alive.get(node, False) for node in nodes), "alive": alive}
        await asyncio.sleep(POLL_SECONDS)


def _observation(answer: Any) -> dict[str, Any]:
    """What one QueueStatus answer says about replicas and confirms (None: no answer)."""
    if answer is None:
        return {"answered": False}
    return {
        "answered": True,
        "master": answer.master_node,
        "mirrors": sorted(answer.mirrors),
        "synchronised": sorted(answer.synchronised_mirrors),
        "status": answer.status,
        "events": sorted({event.kind for event in answer.events}),
    }


async def _watch_status(nodes: list[str], stop: Path, out: Path) -> None:
    """Ask QueueStatus through `nodes` (one call each, no failover) until `stop` exists; write every change
    of what they say, with when it was first seen."""
    seen: list[dict[str, Any]] = []
    while not stop.exists():
        answers = await asyncio.gather(*(partition._status(address) for address in nodes))
        observation = [_observation(answer) for answer in answers]
        if not seen or seen[-1]["through"] != observation:
            seen.append({"at": time.monotonic(), "through": observation})
            partition._write_json(out, seen)
        await asyncio.sleep(POLL_SECONDS)
    partition._write_json(out, seen)


async def _converged(nodes: list[str], replicas: int, deadline: float) -> dict[str, Any]:
    """Wait until QueueStatus through every node names one master and `replicas` - 1 mirrors, all of them
    synchronised; the last answers, and whether they converged."""
    stop = time.monotonic() + deadline
    while True:
        observed = [_observation(answer) for answer in await asyncio.gather(*(partition._status(a) for a in nodes))]
        first = observed[0]
        converged = (
            all(o == first for o in observed)
            and first["answered"]
            and len(first["mirrors"]) == replicas - 1
            and first["synchronised"] == first["mirrors"]
        )
        if converged or time.monotonic() > stop:
            return {"converged": converged, "at": time.monotonic(), "observed": observed}
        await asyncio.sleep(POLL_SECONDS)


def driver(argv: Sequence[str]) -> None:
    """This module's driver commands; any other command is tests/test_partition.py's."""
    commands = ("struck", "not-live", "watch-status", "converged")
    if not argv or argv[0] not in commands:
        partition.driver(argv)
        return
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("command", choices=commands)
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--nodes", type=partition._addresses, default=[])
    parser.add_argument("--node-ids", type=partition._addresses, default=[])
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--stop", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "watch-status":
        asyncio.run(_watch_status(args.nodes, args.stop, args.out))
        return
    if args.command == "struck":
        result = asyncio.run(_struck(args.coordinator, args.replicas, args.deadline))
    elif args.command == "not-live":
        result = asyncio.run(_not_live(args.coordinator, args.node_ids, args.deadline))
    else:
        result = asyncio.run(_converged(args.nodes, args.replicas, args.deadline))
    print(json.dumps(result))


# ============================================================================ the tests (root namespace)


def _network(names: Sequence[str]) -> netns.TestNetwork:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"partition tests need network namespaces: {reason}")
    return netns.TestNetwork(names)


def _connects(net: netns.TestNetwork, client: str, server: str) -> bool:
    """Whether a TCP connection from host `client` to a listener on host `server` opens within a second."""
    listener = net.popen(
        server,
        [sys.executable, "-c", "import signal, socket; s = socket.create_server(('', 9000)); print(1, flush=True); "
         "signal.pause()"],
        stdout=subprocess.PIPE, cwd=Path.cwd(), env={},
    )  # fmt: skip
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == b"1", "the listener did not start"
        dial = (
            "import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 9000), timeout=1.0)\n"
            "except OSError as error:\n    print(type(error).__name__)\nelse:\n    print('connected')"
        )
        done = net.run(client, [sys.executable, "-c", dial, net.hosts[server].ip], cwd=Path.cwd(), env={}, timeout=10)
        outcome = done.stdout.strip()
        assert outcome in ("connected", "TimeoutError"), f"not a silent drop: {outcome} {done.stderr}"
        return outcome == "connected"
    finally:
        net.kill(listener)


def test_a_cut_between_two_hosts_is_silent_and_spares_the_others() -> None:
    with _network(["a", "b", "c"]) as net:
        assert _connects(net, "a", "b")
        net.cut_between("a", "b")
        assert not _connects(net, "a", "b"), "a reached b across the cut"
        assert not _connects(net, "b", "a"), "b reached a across the cut"
        assert _connects(net, "a", "c") and _connects(net, "c", "b"), "the cut took more than the pair"
        net.heal_between("a", "b")
        assert _connects(net, "a", "b") and _connects(net, "b", "a"), "the heal did not restore the pair"


@dataclass
class _Run:
    """What one partition run saw; the tests judge it."""

    cut_at: float
    healed_at: float
    during: dict[str, Any]  # what the run waited for while the partition lasted
    converged: dict[str, Any]
    produced: dict[str, dict[str, Any]] = field(repr=False)  # publisher -> its outcomes
    drained: dict[str, Any] = field(repr=False)
    statuses: list[dict[str, Any]] = field(repr=False)  # QueueStatus changes seen by a watcher (none: no watcher)

    def confirms_between(self, publisher: str, start: float, end: float) -> list[float]:
        return sorted(t for _, t in partition._confirms(self.produced[publisher]).values() if start < t < end)

    def check_every_confirmed_message_delivered_in_order(self) -> None:
        assert "not_drained" not in self.drained, self.drained
        confirmed = {p: set(partition._confirms(result)) for p, result in self.produced.items()}
        history = partition._check_history(confirmed, self.drained["deliveries"])
        counts = {p: len(seqs) for p, seqs in confirmed.items()}
        print(f"confirmed {counts}; drained {history}")
        assert self.drained["depth_after"] == 0, f"{self.drained['depth_after']} messages left after the drain"


def _stop(producers: Sequence[partition._Producer]) -> dict[str, dict[str, Any]]:
    """Stop the producers (together: each waits a while for the confirms still due); their outcomes."""
    for producer in producers:
        producer.stop_file.touch()
    return {producer.publisher: producer.finish() for producer in producers}


def _converge_and_drain(
    cluster: partition._Cluster, replicas: int, produced: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Wait until the queue has `replicas` synchronised replicas (or the deadline passes); then drain it
    through every node, expecting every confirmed message (not if no node serves it)."""
    nodes = cluster.addresses(*cluster.nodes)
    converged = cluster.driver(
        CLIENT_HOST, "converged", "--nodes", nodes, "--replicas", str(replicas), "--deadline", str(CONVERGE_SECONDS),
        timeout=CONVERGE_SECONDS + 30,
    )  # fmt: skip
    if not any(seen["answered"] and seen["status"].startswith("running") for seen in converged["observed"]):
        return converged, {"not_drained": f"no node serves the queue: {converged['observed']}"}
    results = cluster.directory / "results"
    expect = results / "expect.json"
    partition._write_json(expect, [[p, seq] for p, result in produced.items() for seq in partition._confirms(result)])
    cluster.driver(
        CLIENT_HOST, "drain", "--nodes", nodes, "--expect", str(expect), "--deadline", str(DRAIN_SECONDS),
        "--out", str(results / "drain.json"), timeout=DRAIN_SECONDS + 30,
    )  # fmt: skip
    drained: dict[str, Any] = json.loads((results / "drain.json").read_text(encoding="utf-8"))
    return converged, drained


@contextlib.contextmanager
def _cluster_in(names: Sequence[str], directory: Path, **layout: Any) -> Iterator[partition._Cluster]:
    """A network of hosts `names` and a cluster on it (`layout`: tests/test_partition.py's `_start` keywords);
    the nodes' log tails are printed if the run fails."""
    with _network(names) as net:
        try:
            yield partition._start(net, directory, driver_module=MODULE, **layout)
        except BaseException:
            print("\n\n".join(partition._log_tails(directory)))
            raise


# ------------------------------------------------------------------ 3b. a cut between master and mirror

PAIR_HOSTS = {"node1": "n1", "node2": "n2", "node3": "n3"}


def _cut_between_master_and_mirror(cluster: partition._Cluster) -> _Run:
    net = cluster.net
    setup = cluster.driver(
        CLIENT_HOST, "setup", "--coordinator", cluster.coordinator, "--nodes", cluster.addresses(*PAIR_HOSTS)
    )
    assert setup["master"] == "node1" and sorted(setup["synchronised"]) == ["node2", "node3"], setup
    producers = [
        partition._Producer(cluster, CLIENT_HOST, "through-node1", ["node1", "node2", "node3"]),
        partition._Producer(cluster, CLIENT_HOST, "through-node2", ["node2", "node3", "node1"]),
    ]
    for producer in producers:
        producer.wait_confirmed(BEFORE_CUT, 60, "before the cut")
    cut_at = time.monotonic()
    net.cut_between(PAIR_HOSTS["node1"], PAIR_HOSTS["node2"])
    struck = cluster.driver(
        CLIENT_HOST,
        "struck",
        "--coordinator",
        cluster.coordinator,
        "--replicas",
        "3",
        "--deadline",
        str(CUT_LIMIT_SECONDS),
    )
    partition._wait_publishing(producers, AFTER_STRIKE, cut_at + CUT_LIMIT_SECONDS)
    healed_at = time.monotonic()
    net.heal_between(PAIR_HOSTS["node1"], PAIR_HOSTS["node2"])
    produced = _stop(producers)
    converged, drained = _converge_and_drain(cluster, 3, produced)
    return _Run(cut_at, healed_at, struck, converged, produced, drained, [])


@pytest.fixture(scope="module")
def pair_cut(tmp_path_factory: pytest.TempPathFactory) -> _Run:
    directory = tmp_path_factory.mktemp("pair-cut")
    with _cluster_in(["c", *PAIR_HOSTS.values(), CLIENT_HOST], directory, node_hosts=PAIR_HOSTS) as cluster:
        run = _cut_between_master_and_mirror(cluster)
    print(f"\ncut at {run.cut_at:.1f}, healed {run.healed_at - run.cut_at:.1f}s later; files in {directory}")
    return run


def test_a_cut_between_master_and_mirror_strikes_a_replica(pair_cut: _Run) -> None:
    """The premise: the cut lasted long enough for the ring to record one side of it dead."""
    assert pair_cut.during["struck"], f"no replica was struck during the cut: {pair_cut.during}"


def test_after_a_cut_between_master_and_mirror_every_replica_is_back(pair_cut: _Run) -> None:
    converged = pair_cut.converged
    assert converged["converged"], (
        f"not three synchronised replicas within {CONVERGE_SECONDS:g} s of the heal: {converged['observed']}"
    )
    print(f"three synchronised replicas {converged['at'] - pair_cut.healed_at:.1f}s after the heal")


def test_after_a_cut_between_master_and_mirror_no_confirmed_message_is_lost(pair_cut: _Run) -> None:
    pair_cut.check_every_confirmed_message_delivered_in_order()


# ------------------------------------------------------- 4. the side that reaches the coordinator

LONE_HOST = "a"  # the coordinator's host, and node1's
LONE_HOSTS = {"node1": LONE_HOST, "node2": "n2", "node3": "n3", "node4": "n4"}
CUT_OFF_NODES = ["node2", "node3", "node4"]
LONE, OTHER_SIDE = "beside-the-coordinator", "through-the-other-side"


def _lone_side(cluster: partition._Cluster, master: str) -> _Run:
    net, results = cluster.net, cluster.directory / "results"
    first = [master, *(node for node in LONE_HOSTS if node != master)]
    setup = cluster.driver(
        CLIENT_HOST, "setup", "--coordinator", cluster.coordinator, "--nodes", cluster.addresses(*first)
    )
    assert setup["master"] == master and len(setup["synchronised"]) == 3, setup
    producers = [
        partition._Producer(cluster, LONE_HOST, LONE, ["node1"]),
        partition._Producer(cluster, CLIENT_HOST, OTHER_SIDE, CUT_OFF_NODES),
    ]
    for producer in producers:
        producer.wait_confirmed(BEFORE_CUT, 60, "before the cut")
    stop = results / "watch-status.stop"
    watcher = cluster.spawn_driver(
        LONE_HOST, "watch-status", "watch-status", "--nodes", cluster.addresses("node1"), "--stop", str(stop),
        "--out", str(results / "statuses.json"),
    )  # fmt: skip
    cut_at = time.monotonic()
    for node in CUT_OFF_NODES:
        net.cut_between(LONE_HOST, LONE_HOSTS[node])
    # The partition lasts until the coordinator has counted the cut-off nodes gone (their heartbeats stopped):
    # by then the lone side has had every chance to record them dead and carry on alone.
    gone = cluster.driver(
        LONE_HOST, "not-live", "--coordinator", cluster.coordinator, "--node-ids", ",".join(CUT_OFF_NODES),
        "--deadline", str(CUT_LIMIT_SECONDS),
    )  # fmt: skip
    healed_at = time.monotonic()
    for node in CUT_OFF_NODES:
        net.heal_between(LONE_HOST, LONE_HOSTS[node])
    stop.touch()
    produced = _stop(producers)
    assert watcher.wait(30) == 0, "the status watcher failed"
    converged, drained = _converge_and_drain(cluster, len(LONE_HOSTS), produced)
    statuses = json.loads((results / "statuses.json").read_text(encoding="utf-8"))
    return _Run(cut_at, healed_at, gone, converged, produced, drained, statuses)


@pytest.fixture(scope="module", params=["node1", "node2"], ids=["master-beside-the-coordinator", "master-cut-off"])
def lone_side(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> _Run:
    master: str = request.param
    directory = tmp_path_factory.mktemp(f"lone-side-{master}")
    hosts = [*sorted(set(LONE_HOSTS.values())), CLIENT_HOST]
    with _cluster_in(hosts, directory, coordinator_host=LONE_HOST, node_hosts=LONE_HOSTS) as cluster:
        run = _lone_side(cluster, master)
    print(f"\npartition of {run.healed_at - run.cut_at:.1f}s; files in {directory}")
    return run


def test_the_lone_side_confirms_nothing_during_the_partition(lone_side: _Run) -> None:
    assert lone_side.during["not_live"], f"the coordinator still counted cut-off nodes live: {lone_side.during}"
    late = lone_side.confirms_between(LONE, lone_side.cut_at + partition.CUT_MARGIN, lone_side.healed_at)
    print(f"{len(late)} confirms to the lone side during the partition")
    assert not late, (
        f"the lone node confirmed {len(late)} messages with no mirror reachable, the first "
        f"{late[0] - lone_side.cut_at:.2f}s after the cut"
    )


def test_the_lone_side_says_it_is_below_its_minimum_of_synchronised_mirrors(lone_side: _Run) -> None:
    """While it holds confirms, QueueStatus through the lone node says why; or it answers nothing (UNAVAILABLE)
    by the end of the partition."""
    before_heal = [seen for seen in lone_side.statuses if seen["at"] < lone_side.healed_at]
    during = [seen for seen in before_heal if seen["at"] > lone_side.cut_at]
    said = [seen for seen in during if "below_min_synchronised" in seen["through"][0].get("events", [])]
    unanswered_at_the_end = bool(before_heal) and not before_heal[-1]["through"][0]["answered"]
    assert said or unanswered_at_the_end, (
        "QueueStatus through node1 never said below_min_synchronised during the partition; what it said "
        f"(each change, the first before the cut): {before_heal[-len(during) - 1 :]}"
    )


def test_after_the_heal_the_cluster_converges(lone_side: _Run) -> None:
    converged = lone_side.converged
    assert converged["converged"], (
        f"not one master and three synchronised mirrors within {CONVERGE_SECONDS:g} s of the heal: "
        f"{converged['observed']}"
    )
    print(f"converged {converged['at'] - lone_side.healed_at:.1f}s after the heal")


def test_after_the_heal_every_confirmed_message_is_delivered_in_order(lone_side: _Run) -> None:
    lone_side.check_every_confirmed_message_delivered_in_order()


if __name__ == "__main__":
    driver(sys.argv[1:])
