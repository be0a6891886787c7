"""The pure parts of `make bench-scale` (bench/bench_scale.py): how the spread producer shares its window and
sizes its requests, bytes per queued message and the share returned, the goals, the tables. No broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_scale
from bench.bench_scale import (
    BodyRow,
    NodeMemory,
    QueuesRow,
    ReplicasRow,
    ScaleRun,
    deal,
    idle_goal,
    memory_goal,
    window,
)
from bench.markdown import replace_marked
from bench.process_stats import MIB
from bench.reference.rabbitmq_workloads import Durations

KIB = 1024


def test_queues_are_dealt_round_robin_to_at_most_as_many_producers() -> None:
    assert deal(["a", "b", "c", "d", "e"], 2) == [["a", "c", "e"], ["b", "d"]]
    assert deal(["a"], 3) == [["a"]]  # one queue: one producer
    assert deal(["a", "b"], 0) == [["a", "b"]]
    hands = deal([str(i) for i in range(1000)], 3)
    assert [len(h) for h in hands] == [334, 333, 333]


def test_one_window_serves_every_queue_and_requests_stay_small_enough() -> None:
    assert window(1, 256) == bench_scale.Window(total=1000, batch=100)  # W1's shape
    assert window(334, 256) == bench_scale.Window(total=1000, batch=100)  # full requests, queue after queue
    assert window(1, 64 * KIB) == bench_scale.Window(total=1000, batch=64)  # 4 MiB a request
    assert window(1, MIB) == bench_scale.Window(total=64, batch=4)  # 64 MiB in flight
    assert window(1, 16 * MIB) == bench_scale.Window(total=4, batch=1)
    with pytest.raises(ValueError):
        window(0, 256)


def test_bytes_per_message_and_the_share_returned() -> None:
    node = NodeMemory("node2", "mirror", before=100 * MIB, full=500 * MIB, after=140 * MIB)
    assert node.per_message(1_000_000) == 400 * MIB / 1_000_000  # about 419 bytes
    assert node.returned == pytest.approx(0.9)
    assert NodeMemory("n", "mirror", 100, 100, 90).returned is None  # it did not grow
    assert NodeMemory("n", "mirror", 100, 200, 250).returned == pytest.approx(-0.5)  # grew further


def test_the_memory_goal_needs_every_node_small_and_returned() -> None:
    messages = 1_000_000
    good = [
        NodeMemory("node1", "master", 60 * MIB, 400 * MIB, 70 * MIB),
        NodeMemory("node2", "mirror", 60 * MIB, 480 * MIB, 90 * MIB),
    ]
    met, text = memory_goal(good, messages)
    assert met, text
    assert "at most 440 bytes a message (node2)" in text
    big = [*good, NodeMemory("node3", "mirror", 60 * MIB, 600 * MIB, 65 * MIB)]  # 566 bytes a message
    met, text = memory_goal(big, messages)
    assert not met and "(node3)" in text
    kept = [*good, NodeMemory("node3", "mirror", 60 * MIB, 400 * MIB, 300 * MIB)]  # gave back 29 %
    met, text = memory_goal(kept, messages)
    assert not met and "node3 29 % returned" in text
    assert memory_goal([], messages) == (False, "not measured")


def test_the_idle_goal_looks_at_the_largest_count_of_a_thousand_or_more() -> None:
    assert idle_goal({}) == (None, "not measured with 1,000 queues")
    assert idle_goal({0: {"node1": 0.1}, 100: {"node1": 0.5}})[0] is None
    met, text = idle_goal({0: {"node1": 0.1}, 1000: {"node1": 1.2, "node2": 1.9, "node3": 0.4}})
    assert met and "1.9 % of a core at the most (node2, 1,000 queues)" in text
    met, _ = idle_goal({1000: {"node1": 2.0}})
    assert not met  # under 2 %, not at it


def _run() -> ScaleRun:
    run = ScaleRun("make bench-scale", "2026-01-01 00:00 UTC", "0.2.0", "abc", Durations(2.0, 10.0), 20.0, 130.0, 3)
    run.replicas = [ReplicasRow(1, 3, 40_000, 0.9, "notes one"), ReplicasRow(5, 5, 12_345.6, 1.8, "notes five")]
    run.idle = {0: {"node1": 0.3, "node2": 0.2, "node3": 0.2}, 1000: {"node1": 1.5, "node2": 1.0, "node3": 1.1}}
    run.queues = [QueuesRow(1000, 3, 2, 2, 9_000, 1.7, 0.3, [])]
    run.bodies = [BodyRow(MIB, 200, 1.5, 64, 4, ["x: UNAVAILABLE"])]
    run.memory = bench_scale.MemoryPart(
        1_000_000, 1_000_000, 1_000_000, 1_000_000, [NodeMemory("node1", "master", 60 * MIB, 400 * MIB, 70 * MIB)]
    )
    return run


def test_the_report_and_section_hold_every_part(tmp_path: Path) -> None:
    run = _run()
    text = bench_scale.report_text(run)
    assert "12,346" in text and "1 MiB" in text and "209.7" in text  # 200 msgs/s of 1 MiB: 209.7 MB/s
    assert "node1 (master)" in text and "| 357 |" not in text and "  357  " in text  # 340 MiB / 1e6: 356.5
    assert "x: UNAVAILABLE" in text
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    replace_marked(doc, bench_scale.MARK_BEGIN, bench_scale.MARK_END, bench_scale.section(run))
    replace_marked(doc, bench_scale.MARK_BEGIN, bench_scale.MARK_END, bench_scale.section(run))
    written = doc.read_text()
    assert written.count(bench_scale.SECTION_TITLE) == 1 and "kept" in written
    assert "Command: `make bench-scale`" in written
    assert "| 1,000 | 1.5 | 1.0 | 1.1 |" in written
    assert "| met |" in written  # both goals met by these figures


def test_a_run_of_one_part_shows_only_its_table_and_the_goals_not_measured() -> None:
    run = ScaleRun("c", "d", "v", "c", Durations(1.0, 3.0), 5.0, 130.0, 3)
    run.bodies = [BodyRow(256, 30_000, 1.2, 1000, 100)]
    titles = [t[0] for t in bench_scale.tables(run)]
    assert titles == ["W1 by body size"]
    assert [row[-1] for row in bench_scale.goal_rows(run)] == ["n/a", "n/a"]
