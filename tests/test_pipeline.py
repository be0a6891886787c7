"""Tests of the Spark lifecycle job (pipeline/), on recorded inputs under tests/data/pipeline/.

`lifecycle/`: client histories with exactly one lost message (p2/1), one duplicate (p2/2 delivered
twice, the repeat not flagged), one reordering (p1 delivered 1, 2, 4, 3, 5 to consumer-1: an order
violation on seq 3 only), flagged redeliveries that must not count (p1/6 and p2/3 to consumer-2;
p1/6 reaches consumer-2 after p1/7), an unconfirmed message (p2/4 nacked, p2/5 in flight) and a
fault at +5 s. `traced/`: two messages through three nodes with their span files, plus malformed
lines. README.md there lists every hand-checked number.

One SparkSession for the module; each input is run once (lifecycle through `run_lifecycle`, traced
through the CLI's `main`) and the tests read the results.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from pipeline import FailoverWindow, FaultBuckets, InputError, Summary, run_lifecycle, spark_session
from pipeline.__main__ import exit_status, main
from pipeline.guarantees import duplicates
from pipeline.inputs import discover_history, read_history
from pipeline.report import failover_zoom
from pipeline.tables import history_messages, messages_table

DATA = Path(__file__).parent / "data" / "pipeline"
ROOT = Path(__file__).parent.parent
T0 = 1763712000.0  # lifecycle/ times are T0 + offsets
B = 1763712100.0  # traced/ times are B + offsets


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = spark_session("local[2]")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def lifecycle(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Summary:
    return run_lifecycle([DATA / "lifecycle"], [], tmp_path_factory.mktemp("lifecycle"), spark=spark)


@dataclass(frozen=True)
class CliRun:
    code: int
    stdout: str
    out: Path
    summary: dict[str, Any]


@pytest.fixture(scope="module")
def traced(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """The traced input through `python -m pipeline`'s main (it finds the module's session active)."""
    out = tmp_path_factory.mktemp("traced")
    stdout = io.StringIO()
    argv = ["--history", str(DATA / "traced"), "--spans", str(DATA / "traced"), "--out", str(out)]
    with redirect_stdout(stdout):
        code = main([*argv, "--fail-on-violation"])
    return CliRun(code, stdout.getvalue(), out, json.loads((out / "summary.json").read_text()))


def rows(spark: SparkSession, path: str | Path) -> list[dict[str, Any]]:
    return [r.asDict(recursive=True) for r in spark.read.parquet(str(path)).collect()]


def by_key(table: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["publisher"], r["seq"]): r for r in table}


# ---- lifecycle/: the guarantees -------------------------------------------------------------------


def test_counts(lifecycle: Summary) -> None:
    s = lifecycle
    assert (s.messages, s.published, s.confirmed) == (13, 13, 11)
    assert (s.unconfirmed, s.nacked, s.rejected, s.in_flight) == (2, 1, 0, 1)
    assert (s.delivered, s.deliveries, s.redeliveries, s.acked) == (10, 13, 2, 10)
    assert (s.lost, s.duplicates, s.order_violations, s.violation_count) == (1, 1, 1, 3)
    assert (s.malformed_lines, s.history_files, s.history_events) == (0, 5, 50)
    assert (s.span_files, s.spans, s.traced) == (0, 0, 0)


def test_violations_are_exactly_the_planted_ones(spark: SparkSession, lifecycle: Summary) -> None:
    planted = {("lost", "p2", 1), ("duplicate", "p2", 2), ("order", "p1", 3)}
    assert {(v.kind, v.publisher, v.seq) for v in lifecycle.violations} == planted
    table = rows(spark, lifecycle.tables["violations"])
    assert {(r["kind"], r["publisher"], r["seq"]) for r in table} == planted
    order = next(r for r in table if r["kind"] == "order")
    assert order["client"] == "consumer-1"
    assert "got seq 3 after seq 4" in order["detail"]


def test_unconfirmed_and_flagged_redeliveries_do_not_count(spark: SparkSession, lifecycle: Summary) -> None:
    messages = by_key(rows(spark, lifecycle.tables["messages"]))
    assert messages[("p2", 4)]["outcome"] == "nacked"
    assert messages[("p2", 5)]["outcome"] == "in_flight"
    assert messages[("p2", 4)]["deliveries"] == messages[("p2", 5)]["deliveries"] == 0
    assert messages[("p2", 6)]["outcome"] == "duplicate"  # a positive confirm: counted as confirmed
    for key in [("p1", 6), ("p2", 3)]:  # redelivered, flagged: not duplicates, not order violations
        assert messages[key]["redeliveries"] == 1
        assert messages[key]["unflagged_repeats"] == 0
        assert messages[key]["consumers"] == ["consumer-1", "consumer-2"]
    flagged = {("p1", 6), ("p2", 3), ("p2", 4), ("p2", 5)}
    assert not flagged & {(v.publisher, v.seq) for v in lifecycle.violations}


def test_message_rows(spark: SparkSession, lifecycle: Summary) -> None:
    messages = by_key(rows(spark, lifecycle.tables["messages"]))
    assert len(messages) == 13
    dup = messages[("p2", 2)]
    assert (dup["deliveries"], dup["unflagged_repeats"], dup["acks"]) == (2, 1, 2)
    assert (dup["message_ids"], dup["distinct_message_ids"]) == ([202], 1)
    assert (dup["consumers"], dup["queue"], dup["producer"]) == (["consumer-1"], "orders", "producer-2")
    p13 = messages[("p1", 3)]
    assert p13["publish_ts"] == pytest.approx(T0 + 0.3)
    assert p13["confirm_ts"] == pytest.approx(T0 + 0.33)
    assert p13["first_deliver_ts"] == pytest.approx(T0 + 0.9)
    assert p13["first_ack_ts"] == pytest.approx(T0 + 0.904)
    assert (p13["outcome"], p13["traced"], p13["master_node"], p13["nodes"]) == ("confirmed", False, None, None)
    assert messages[("p2", 1)]["confirm_ts"] == pytest.approx(T0 + 2.015)
    assert messages[("p2", 1)]["deliveries"] == 0


def test_latency_by_stage_hand_checked(spark: SparkSession, lifecycle: Summary) -> None:
    # publish→confirm: 10 20 30 40 50 12 17 (p1) 15 25 35 500 (p2) ms; nearest rank p50 = 6th of 11 = 25
    confirm = lifecycle.stage("publish_to_confirm")
    assert confirm is not None
    assert (confirm.count, confirm.p50_ms, confirm.p99_ms, confirm.max_ms) == (11, 25.0, 500.0, 500.0)
    # publish→first delivery: 500 500 600 400 450 350 50 (p1) 200 300 1000 (p2) ms
    e2e = lifecycle.stage("publish_to_first_delivery")
    assert e2e is not None
    assert (e2e.count, e2e.p50_ms, e2e.p99_ms, e2e.max_ms) == (10, 400.0, 1000.0, 1000.0)
    # delivery→ack: 1..10 and 20 ms (p2/2's two deliveries are acked 8 and 9 ms after each)
    ack = lifecycle.stage("delivery_to_ack")
    assert ack is not None
    assert (ack.count, ack.p50_ms, ack.p99_ms, ack.max_ms) == (11, 6.0, 20.0, 20.0)
    assert [s.stage for s in lifecycle.stages] == ["publish_to_confirm", "publish_to_first_delivery", "delivery_to_ack"]
    stages = rows(spark, lifecycle.tables["stages"])
    per_message = {(r["publisher"], r["seq"], r["stage"]): r["latency_ms"] for r in stages if r["node"] is None}
    assert per_message[("p1", 3, "publish_to_confirm")] == 30.0
    assert per_message[("p1", 3, "publish_to_first_delivery")] == 600.0
    assert per_message[("p2", 6, "publish_to_first_delivery")] == 1000.0
    p22 = [r for r in stages if (r["publisher"], r["seq"], r["stage"]) == ("p2", 2, "delivery_to_ack")]
    assert sorted(r["latency_ms"] for r in p22) == [8.0, 9.0]


def test_failover_window_and_longest_gaps(lifecycle: Summary) -> None:
    [fault] = lifecycle.failover
    assert (fault.what, fault.node, fault.client) == ("SIGKILL", "node1", "demo")
    assert fault.fault_ts == pytest.approx(T0 + 5.0)
    assert fault.first_confirm_ts == pytest.approx(T0 + 6.5)  # the nack at +5.5 is no confirm
    assert fault.confirm_after_s == pytest.approx(1.5)
    assert fault.first_delivery_ts == pytest.approx(T0 + 7.0)
    assert fault.delivery_after_s == pytest.approx(2.0)
    confirms, deliveries = lifecycle.longest_confirm_gap, lifecycle.longest_delivery_gap
    assert confirms is not None
    assert deliveries is not None
    assert (confirms.start_ts, confirms.end_ts, confirms.seconds) == pytest.approx((T0 + 2.235, T0 + 6.5, 4.265))
    assert (deliveries.start_ts, deliveries.end_ts, deliveries.seconds) == pytest.approx((T0 + 2.9, T0 + 7.0, 4.1))
    [around] = lifecycle.failover_buckets  # 100 ms buckets from -2 s to +3 s, bucket 0 starting at the fault
    assert around.fault_ts == pytest.approx(T0 + 5.0)
    assert (around.bucket_ms, around.first_offset_ms) == (100, -2000)
    assert len(around.confirms) == 50
    assert {i: n for i, n in enumerate(around.publishes) if n} == {10: 1, 19: 1, 30: 1}  # +4.0, +4.9, +6.0
    assert {i: n for i, n in enumerate(around.confirms) if n} == {35: 1}  # +6.5 (the nack at +5.5 is not one)
    assert {i: n for i, n in enumerate(around.deliveries) if n} == {40: 1}  # +7.0
    assert around.empty_from_fault(around.confirms) == 15


def test_throughput_per_second(spark: SparkSession, lifecycle: Summary) -> None:
    table = sorted(rows(spark, lifecycle.tables["throughput"]), key=lambda r: r["second"])
    assert [r["second"] for r in table] == [int(T0) + i for i in range(8)]
    assert [r["publishes"] for r in table] == [6, 1, 3, 0, 2, 0, 1, 0]
    assert [r["confirms"] for r in table] == [6, 1, 3, 0, 0, 0, 1, 0]
    assert [r["deliveries"] for r in table] == [6, 2, 4, 0, 0, 0, 0, 1]
    assert [r["faults"] for r in table] == [0, 0, 0, 0, 0, 1, 0, 0]


def test_outputs_written(lifecycle: Summary) -> None:
    out = Path(lifecycle.out_dir)
    for name in ["report.md", "latency.png", "throughput.png", "summary.json"]:
        assert (out / name).stat().st_size > 0, name
    for chart in [lifecycle.latency_chart, lifecycle.throughput_chart]:
        assert Path(chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = Path(lifecycle.report).read_text()
    sections = [report.index(h) for h in ["## Summary", "## Latency by stage", "## Throughput", "## Violations"]]
    assert sections == sorted(sections)
    assert "| **lost** | **1** |" in report
    assert "| **order violations** | **1** |" in report
    assert "SIGKILL node1" in report
    assert "| p1 | 3 | consumer-1 |" in report
    saved = json.loads(Path(lifecycle.summary_json).read_text())
    assert saved == json.loads(json.dumps(lifecycle.to_dict()))
    assert (saved["lost"], saved["duplicates"], saved["order_violations"], saved["violation_count"]) == (1, 1, 1, 3)
    assert (saved["published"], saved["confirmed"], saved["delivered"], saved["redeliveries"]) == (13, 11, 10, 2)
    assert saved["failover"][0]["confirm_after_s"] == pytest.approx(1.5)


def test_fail_on_violation_exit_status(lifecycle: Summary) -> None:
    assert exit_status(lifecycle, fail_on_violation=True) == 1
    assert exit_status(lifecycle, fail_on_violation=False) == 0


def test_a_message_stored_under_two_ids_is_a_duplicate(spark: SparkSession, tmp_path: Path) -> None:
    def deliver(ts: float, client: str, seq: int, message_id: int, redelivered: bool) -> dict[str, Any]:
        return {"ts": ts, "event": "deliver", "client": client, "queue": "q", "publisher": "p5", "seq": seq,
                "message_id": message_id, "redelivered": redelivered}  # fmt: skip

    # p5/1: the redelivery is flagged, but under another message id: stored twice. p5/2: one delivery.
    lines = [deliver(T0, "c1", 1, 7, False), deliver(T0 + 1, "c2", 1, 8, True), deliver(T0 + 2, "c2", 2, 9, True)]
    path = tmp_path / "history-c.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    history = read_history(spark, [path])
    try:
        found = duplicates(messages_table(history_messages(history.rows), None)).collect()
    finally:
        history.release()
    assert [(r["publisher"], r["seq"]) for r in found] == [("p5", 1)]
    assert "message ids [7,8]" in found[0]["detail"]


# ---- traced/: spans, the CLI, malformed lines -----------------------------------------------------


def test_cli_run_is_clean(traced: CliRun) -> None:
    assert traced.code == 0  # --fail-on-violation, and nothing lost, duplicated or reordered
    assert "lost: 0  duplicates: 0  order violations: 0" in traced.stdout
    assert "enqueue → mirror apply" in traced.stdout
    assert f"report: {traced.out / 'report.md'}" in traced.stdout
    assert (traced.out / "latency.png").stat().st_size > 0
    assert (traced.summary["published"], traced.summary["delivered"], traced.summary["traced"]) == (2, 2, 2)


def test_span_lifecycle_per_message(spark: SparkSession, traced: CliRun) -> None:
    messages = by_key(rows(spark, traced.out / "messages"))
    first, second = messages[("p9", 1)], messages[("p9", 2)]
    # p9/1: published through node3 (forward), master node1, mirrors node2 and node3
    assert (first["master_node"], first["nodes"], first["ring_hops"]) == ("node1", ["node1", "node2", "node3"], 3)
    assert first["processes"] == ["consumer-a", "node1", "node2", "node3", "producer-a"]
    assert first["enqueue_ts"] == pytest.approx(B + 0.001)
    assert first["server_confirm_ts"] == pytest.approx(B + 0.006)
    assert first["mirror_apply"] == pytest.approx({"node2": B + 0.0025, "node3": B + 0.004})
    assert (first["queue"], first["message_ids"], first["traced"]) == ("orders", [1], True)
    # p9/2: published at its master node2, mirror node3; the same message id 1, in another queue and trace
    assert (second["master_node"], second["nodes"], second["ring_hops"]) == ("node2", ["node2", "node3"], 2)
    assert second["mirror_apply"] == pytest.approx({"node3": B + 0.014})
    assert (second["queue"], second["message_ids"]) == ("audit", [1])
    assert second["trace_ids"] == ["4bf92f3577b34da6a3ce929d0e0e4736"]


def test_span_stage_latencies(spark: SparkSession, traced: CliRun) -> None:
    stats = {s["stage"]: (s["count"], s["p50_ms"], s["p99_ms"], s["max_ms"]) for s in traced.summary["stages"]}
    assert stats["publish_to_enqueue"] == pytest.approx((2, 1.0, 2.0, 2.0))
    assert stats["enqueue_to_mirror_apply"] == pytest.approx((3, 2.0, 3.0, 3.0))  # 1.5, 3 (p9/1); 2 (p9/2)
    assert stats["enqueue_to_confirm"] == pytest.approx((2, 4.0, 5.0, 5.0))
    assert stats["ring_hop"] == pytest.approx((5, 1.5, 2.0, 2.0))  # 1, 1.5, 2 (p9/1); 1, 2 (p9/2)
    stages = rows(spark, traced.out / "stages")
    hops = {(r["seq"], r["node"]): r["latency_ms"] for r in stages if r["stage"] == "ring_hop"}
    assert hops == pytest.approx(
        {(1, "node2"): 1, (1, "node3"): 1.5, (1, "node1"): 2, (2, "node3"): 1, (2, "node2"): 2}
    )
    applies = {(r["seq"], r["node"]): r["latency_ms"] for r in stages if r["stage"] == "enqueue_to_mirror_apply"}
    assert applies == pytest.approx({(1, "node2"): 1.5, (1, "node3"): 3.0, (2, "node3"): 2.0})


def test_malformed_lines_are_skipped_and_counted(traced: CliRun) -> None:
    s = traced.summary
    assert (s["malformed_lines"], s["malformed_history_lines"], s["malformed_span_lines"]) == (3, 2, 1)
    assert {Path(f).name: n for f, n in s["malformed_files"].items()} == {
        "history-producer-a.jsonl": 1,  # "ts": "soon"
        "history-consumer-a.jsonl": 1,  # a truncated line
        "spans-node2.jsonl": 1,  # a truncated line (the blank line after it is not counted)
    }
    assert (s["history_events"], s["spans"]) == (8, 21)
    assert "malformed lines: 3" in traced.stdout
    assert "## Malformed lines" in (traced.out / "report.md").read_text()


def test_nothing_but_a_fault_and_bad_lines(spark: SparkSession, tmp_path: Path) -> None:
    fault = {"ts": T0, "event": "fault", "client": "demo", "what": "SIGKILL", "node": "node2"}
    (tmp_path / "history-demo.jsonl").write_text(json.dumps(fault) + "\n{oops\n")
    (tmp_path / "spans-node1.jsonl").write_text('nope\n{"name": "ringq.enqueue"}\n')  # no trace_id: unusable
    s = run_lifecycle([tmp_path], [tmp_path], tmp_path / "out", spark=spark)
    assert (s.messages, s.published, s.delivered, s.violation_count, s.stages) == (0, 0, 0, 0, ())
    assert (s.malformed_history_lines, s.malformed_span_lines, s.span_files, s.spans) == (1, 2, 1, 0)
    [window] = s.failover
    assert (window.node, window.confirm_after_s, window.delivery_after_s) == ("node2", None, None)
    assert s.longest_confirm_gap is None
    assert s.longest_delivery_gap is None
    for path in [s.report, s.latency_chart, s.throughput_chart, s.summary_json]:
        assert Path(path).stat().st_size > 0, path


def test_missing_input_dir_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "--history", str(missing), "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"pipeline: error: history input not found: {missing}"
    assert not (tmp_path / "out").exists()


def test_missing_span_dir_and_empty_history_dir_exit_2(tmp_path: Path) -> None:
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        assert main(["--history", str(DATA / "traced"), "--spans", str(tmp_path / "no-spans")]) == 2
        assert main(["--history", str(tmp_path)]) == 2
    assert stderr.getvalue().splitlines() == [
        f"pipeline: error: span input not found: {tmp_path / 'no-spans'}",
        f"pipeline: error: no history files (history-*.jsonl or *.jsonl) in {tmp_path}",
    ]


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit) as raised:
        main(["--history", str(DATA / "traced"), "--conf", "no-equals-sign"])
    assert raised.value.code == 2
    assert "expected KEY=VALUE" in stderr.getvalue()


def test_history_discovery(tmp_path: Path) -> None:
    (tmp_path / "spans-node1.jsonl").write_text("")
    (tmp_path / "run.jsonl").write_text("")
    assert discover_history([tmp_path]) == [tmp_path / "run.jsonl"]  # no history-*.jsonl: any *.jsonl but spans
    (tmp_path / "history-a.jsonl").write_text("")
    assert discover_history([tmp_path]) == [tmp_path / "history-a.jsonl"]
    assert discover_history([tmp_path / "run.jsonl"]) == [tmp_path / "run.jsonl"]
    with pytest.raises(InputError, match="no history input given"):
        discover_history([])


# ---- the failover at 100 ms resolution -------------------------------------------------------------


def hole_events(fault_ts: float) -> list[dict[str, Any]]:
    """A publish every 20 ms (at +1 ms), a confirm every 20 ms (at +0 ms) with none in the 400 ms from the
    fault, a delivery every 20 ms (at +5 ms) with none in the 450 ms from the fault: from 2.5 s before the
    fault to 3.5 s after it."""
    events: list[dict[str, Any]] = []
    for k in range(-125, 175):
        at = k * 0.02
        events.append({"ts": fault_ts + at + 0.001, "event": "publish", "client": "p", "publisher": "p", "seq": k})
        if not 0 <= k * 20 < 400:
            events.append({"ts": fault_ts + at, "event": "confirm", "client": "p", "publisher": "p", "seq": k})
        if not 0 <= k * 20 + 5 < 450:
            events.append({"ts": fault_ts + at + 0.005, "event": "deliver", "client": "c", "publisher": "p", "seq": k})
    return sorted(events, key=lambda e: e["ts"])


def test_a_400_ms_hole_shows_in_the_100_ms_buckets_and_on_the_chart(spark: SparkSession, tmp_path: Path) -> None:
    fault_ts = T0 + 10.05  # off the second and off the 100 ms grid: the buckets are aligned on the fault
    fault = {"ts": fault_ts, "event": "fault", "client": "demo", "what": "SIGKILL", "node": "node1"}
    lines = [json.dumps(e) for e in [*hole_events(fault_ts), fault]]
    (tmp_path / "history-all.jsonl").write_text("\n".join(lines) + "\n")
    s = run_lifecycle([tmp_path], [], tmp_path / "out", spark=spark)

    [window] = s.failover
    assert (window.confirm_after_s, window.delivery_after_s) == pytest.approx((0.4, 0.465))
    [b] = s.failover_buckets
    assert b.fault_ts == pytest.approx(fault_ts)
    assert (b.bucket_ms, b.first_offset_ms) == (100, -2000)
    assert b.offsets_ms() == list(range(-2000, 3000, 100))
    assert b.publishes == (5,) * 50
    assert b.confirms == (5,) * 20 + (0,) * 4 + (5,) * 26  # the hole: buckets 0, +100, +200, +300 ms
    assert b.deliveries == (5,) * 20 + (0,) * 4 + (2,) + (5,) * 25  # +465 and +485 in the +400 ms bucket
    assert b.acks == (0,) * 50
    table = rows(spark, s.tables["failover_buckets"])
    assert len(table) == 50
    assert {r["offset_ms"]: r["confirms"] for r in table if r["confirms"] == 0} == {0: 0, 100: 0, 200: 0, 300: 0}
    per_second = {r["second"]: r["confirms"] for r in rows(spark, s.tables["throughput"])}
    assert per_second[int(T0) + 10] == 30, "the 1 s bucket holding the fault is not empty: it hides the hole"

    zoom = failover_zoom(window, b)
    assert zoom.edges_ms == tuple(range(-2000, 3001, 100))
    assert zoom.confirms == b.confirms
    assert zoom.window_ms == pytest.approx((0.0, 400.0))  # shaded from the kill to the first confirm
    assert zoom.gap_ms == pytest.approx(400.0)
    assert zoom.delivery_ms == pytest.approx(465.0)
    assert zoom.empty_confirm_buckets == 4
    assert zoom.note.splitlines() == [
        "failover 400 ms",
        "SIGKILL node1 → first confirm",
        "4 empty 100 ms buckets of confirms",
    ]

    text = s.text()
    assert "failover in 100 ms buckets (SIGKILL node1; bucket start, ms from the fault):" in text
    assert "  confirms: none in the 4 buckets from the fault (+0 → +400 ms); the first 400 ms after it" in text
    assert "  deliveries: none in the 4 buckets from the fault (+0 → +400 ms); the first 465 ms after it" in text
    shown = text.splitlines()
    confirms = next(line for line in shown if line.strip().startswith("confirms"))
    assert confirms.split()[1:] == ["5", "5", "5", "0", "0", "0", "0", "5", "5", "5"]  # -300 .. +600 ms
    report = Path(s.report).read_text()
    assert "### Around SIGKILL node1 (100 ms buckets)" in report
    assert "- confirms: none in the 4 buckets from the fault (+0 → +400 ms); the first 400 ms after it." in report
    assert "| +200 | 5 | 0 | 0 | 0 |" in report
    chart = Path(s.throughput_chart).read_bytes()
    assert chart[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(chart[20:24], "big") == 900, "two panels: the run per second and the fault up close"
    saved = json.loads(Path(s.summary_json).read_text())
    assert saved["failover_buckets"][0]["confirms"] == list(b.confirms)


def test_failover_zoom_without_a_confirm_after_the_fault() -> None:
    window = FailoverWindow(
        fault_ts=T0,
        what=None,
        node="node2",
        client="demo",
        first_confirm_ts=None,
        confirm_after_s=None,
        first_delivery_ts=None,
        delivery_after_s=None,
    )
    buckets = FaultBuckets(T0, 100, -200, (1, 1, 0, 0, 0), (1, 1, 0, 0, 0), (1, 0, 0, 0, 0), (0,) * 5)
    zoom = failover_zoom(window, buckets)
    assert zoom.edges_ms == (-200, -100, 0, 100, 200, 300)
    assert (zoom.window_ms, zoom.gap_ms, zoom.delivery_ms) == ((0.0, 300.0), None, None)  # to the panel's end
    assert zoom.empty_confirm_buckets == 3
    assert zoom.note.splitlines() == ["no confirm after node2", "3 empty 100 ms buckets of confirms"]
    assert buckets.fault_bucket() == 2
    assert buckets.empty_from_fault(buckets.deliveries) == 3
