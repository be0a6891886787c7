"""The lifecycle job's order check on ordered streams (pipeline.guarantees.stream_order_violations): the
`stream_deliver` history events (stream, stream_seq, redelivered, client, in delivery order) of every
client of a stream, and a run of the whole job over such a history."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from pipeline import run_lifecycle, spark_session
from pipeline.guarantees import stream_order_violations
from pipeline.inputs import read_history

T0 = 1763712000.0


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = spark_session("local[2]")
    yield session
    session.stop()


def deliver(ts: float, seq: int, *, stream: str = "s", client: str = "c1", redelivered: bool = False) -> dict[str, Any]:
    return {"ts": T0 + ts, "event": "stream_deliver", "client": client, "stream": stream, "stream_seq": seq,
            "group": f"stream/{stream}/1", "redelivered": redelivered}  # fmt: skip


def found(spark: SparkSession, tmp_path: Path, files: dict[str, list[dict[str, Any]]]) -> list[tuple[str, int, str]]:
    paths = []
    for name, lines in files.items():
        path = tmp_path / f"history-{name}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths.append(path)
    history = read_history(spark, paths)
    try:
        rows = stream_order_violations(history.rows).collect()
    finally:
        history.release()
    return sorted((r["publisher"], r["seq"], r["detail"]) for r in rows)


def test_in_order_and_flagged_repeats_are_clean(spark: SparkSession, tmp_path: Path) -> None:
    # c1 reads 1..3 and dies with 3 unacknowledged; c2 gets 3 again flagged, then reads on. Stream t: its own
    # sequence, interleaved in time with s's. A queue delivery is no stream delivery.
    c1 = [deliver(1, 1), deliver(2, 2), deliver(3, 3), deliver(3.5, 1, stream="t")]
    c2 = [deliver(4, 3, client="c2", redelivered=True), deliver(5, 4, client="c2"), deliver(6, 2, stream="t")]
    queue = [{"ts": T0 + 7, "event": "deliver", "client": "c3", "queue": "q", "publisher": "p", "seq": 1}]
    assert found(spark, tmp_path, {"c1": c1, "c2": c2, "c3": queue}) == []


def test_every_delivery_not_above_the_stream_high_mark_is_one(spark: SparkSession, tmp_path: Path) -> None:
    lines = [
        deliver(1, 1),
        deliver(2, 3),
        deliver(3, 2),  # back below the high mark, never delivered before: a violation even if flagged
        deliver(4, 3),  # a repeat not flagged redelivered: a copy the consumer should have dropped
        deliver(5, 3, redelivered=True),  # a flagged repeat: not one
        deliver(6, 4),
        deliver(7, 5, stream="t"),
        deliver(8, 4, stream="t", redelivered=True),  # flagged, but never delivered before: one
    ]
    rows = found(spark, tmp_path, {"c1": lines})
    assert [(publisher, seq) for publisher, seq, _ in rows] == [("stream:s", 2), ("stream:s", 3), ("stream:t", 4)]
    details = {(publisher, seq): detail for publisher, seq, detail in rows}
    assert details[("stream:s", 2)].startswith("c1 got stream_seq 2 after stream_seq 3 (stream s, never delivered")
    assert "a repeat not flagged redelivered" in details[("stream:s", 3)]


def test_equal_times_fall_back_to_file_line_order(spark: SparkSession, tmp_path: Path) -> None:
    lines = [deliver(1, 1), deliver(1, 2), deliver(1, 3)]
    assert found(spark, tmp_path, {"c1": lines}) == []
    assert [seq for _, seq, _ in found(spark, tmp_path, {"c1": [deliver(1, 2), deliver(1, 1)]})] == [1]


def test_the_job_counts_stream_order_violations(spark: SparkSession, tmp_path: Path) -> None:
    histories = tmp_path / "histories"
    histories.mkdir()
    lines = [deliver(1, 1), deliver(2, 3), deliver(3, 2)]
    (histories / "history-c1.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_lifecycle([histories], [], tmp_path / "out", spark=spark)
    assert (summary.order_violations, summary.violation_count, summary.messages) == (1, 1, 0)
    assert [(v.kind, v.publisher, v.seq, v.client) for v in summary.violations] == [("order", "stream:s", 2, "c1")]
