"""How long one placement pass (metadata.apply_policies) takes over many queues.

A pass is what the coordinator runs when the live nodes or the queue records
change: it reads every queue record of the store, re-applies the policies and
writes the records whose placement changed. This times three passes over a
SQLite store on disk, for each queue count given: `steady` (every queue
already placed right: nothing is written), `node lost` (node3 stops being
live: every queue that had a replica there is rewritten, except those whose
master was on node3, which the queue's own replicas re-place) and `node back`
(node3 is live again: the mirrors come back).

Half of the queues are mirrored on every node (ha-mode all), half on two
(ha-mode exactly 2, the mirror on the node after the master's); masters go
round the three nodes.

    .venv/bin/python -m bench.bench_placement --queues 1000 5000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from services.coordinator import metadata
from services.coordinator.metadata import QUEUE, QueueRecord
from services.coordinator.policies import Policy
from services.coordinator.sqlite_store import SqliteStore

NODES = ("node1", "node2", "node3")
POLICIES = (
    Policy("/", "all", "^all\\.", {"ha-mode": "all"}),
    Policy("/", "two", "^two\\.", {"ha-mode": "exactly", "ha-params": 2}),
)


def populate(store: SqliteStore, queue_count: int) -> None:
    """`queue_count` queues, already placed as their policy wants, written straight to the store."""
    for policy in POLICIES:
        metadata.set_policy(store, policy, NODES)
    for index in range(queue_count):
        master = NODES[index % len(NODES)]
        following = NODES[(index + 1) % len(NODES)]
        if index % 2 == 0:
            others = tuple(node for node in NODES if node != master)
            name, policy, definition, mirrors = f"all.{index}", POLICIES[0], POLICIES[0].definition, others
        else:
            name, policy, definition, mirrors = f"two.{index}", POLICIES[1], POLICIES[1].definition, (following,)
        queue = QueueRecord(
            "/",
            name,
            durable=True,
            master=master,
            mirrors=mirrors,
            policy=policy.name,
            policy_definition=dict(definition),
            gm_group=f"queue.{index}",
        )
        store.put(QUEUE, queue.key, metadata.queue_value(queue), 0)


def timed_pass(store: SqliteStore, live_nodes: Sequence[str]) -> tuple[float, int]:
    started = time.perf_counter()
    changed = metadata.apply_policies(store, "", live_nodes)
    return time.perf_counter() - started, changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queues", type=int, nargs="+", default=[1000, 5000], help="queue counts to measure")
    args = parser.parse_args(argv)
    print(f"{'queues':>7}  {'pass':<10} {'seconds':>8}  {'changed':>7}")
    for queue_count in args.queues:
        with tempfile.TemporaryDirectory() as directory:
            store = SqliteStore(str(Path(directory) / "coordinator.db"))
            try:
                populate(store, queue_count)
                for label, live in (("steady", NODES), ("node lost", NODES[:2]), ("node back", NODES)):
                    seconds, changed = timed_pass(store, live)
                    print(f"{queue_count:>7}  {label:<10} {seconds:>8.3f}  {changed:>7}", flush=True)
            finally:
                store.close()


if __name__ == "__main__":
    main()
