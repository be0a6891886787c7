"""The lifecycle job end to end: `run_lifecycle` reads the inputs, builds the tables, checks the guarantees
and writes every output.

Responsible for: the Spark session (a light local one unless the caller passes or already has one),
the order of the steps, writing the Parquet tables (`messages/`, `stages/`, `throughput/`,
`failover_buckets/`, `violations/`), collecting the small aggregates the report needs, and
`summary.json`.

Guarantees: input problems raise `InputError` before Spark starts; a session this function
created is stopped when it returns or fails, a session it was given (or found active) is left
running; the Parquet tables are overwritten as a whole; only small aggregates reach the driver
(per-stage percentiles, per-second counts, 100 ms counts around each fault, per-kind counts and at
most VIOLATION_CAP violations per kind, one row per fault); the returned Summary and summary.json
hold the same numbers.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from pyspark.sql import DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as F

from pipeline import report
from pipeline.failover import fault_windows, longest_gaps
from pipeline.guarantees import KINDS, VIOLATION_COLUMNS, violations
from pipeline.inputs import Input, InputStats, discover_history, discover_spans, read_history, read_spans
from pipeline.summary import FaultBuckets, StageLatency, Summary, Violation
from pipeline.tables import (
    BUCKET_MS,
    POSITIVE_OUTCOMES,
    STAGE_COLUMNS,
    STAGES,
    SpanLifecycle,
    failover_buckets,
    history_messages,
    history_stages,
    messages_table,
    throughput,
)

DEFAULT_OUT = "var/pipeline"
DEFAULT_MASTER = "local[*]"
VIOLATION_CAP = 50
PERCENTILE_ACCURACY = 10_000  # percentile_approx is exact (nearest rank) below this many values per stage


# A light session. Adaptive execution and whole-stage code generation are off: on the inputs this job
# sees (test and demo histories) planning and compiling cost more than they save (the test module runs ~30%
# faster without them). Override any of these with `conf` / `--conf KEY=VALUE` for large inputs.
SESSION_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.codegen.wholeStage": "false",
}
# Only for a local master: everything stays on the loopback interface, workers run this interpreter.
LOCAL_CONF: dict[str, str] = {"spark.driver.bindAddress": "127.0.0.1", "spark.driver.host": "127.0.0.1"}


def spark_session(master: str = DEFAULT_MASTER, conf: Mapping[str, str] | None = None) -> SparkSession:
    """A new (or the running) session on `master` with SESSION_CONF, then `conf`; logs at ERROR. For a
    local master, PYSPARK_PYTHON is this interpreter and SPARK_LOCAL_IP the loopback address; a cluster
    master keeps the environment's (its executors cannot use either)."""
    settings = dict(SESSION_CONF)
    if master.startswith("local"):
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        settings.update(LOCAL_CONF)
    builder = SparkSession.builder.master(master).appName("ringq-lifecycle")
    for key, value in {**settings, **(conf or {})}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


def run_lifecycle(
    history_paths: Iterable[str | Path],
    span_paths: Iterable[str | Path] = (),
    out_dir: str | Path = DEFAULT_OUT,
    master: str = DEFAULT_MASTER,
    spark: SparkSession | None = None,
    conf: Mapping[str, str] | None = None,
) -> Summary:
    """Run the job over history files/directories and span files/directories; write every output to
    `out_dir` and return the Summary. Uses `spark` if given, else the active session, else a new one on
    `master` with `conf` (stopped at the end; `master` and `conf` only apply to a session started here).
    Raises InputError (before Spark starts) for a missing input or no history file."""
    history_files = discover_history(history_paths)
    span_files = discover_spans(span_paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    session = spark or SparkSession.getActiveSession()
    owned = session is None
    if session is None:
        session = spark_session(master, conf)
    try:
        return _run(session, history_files, span_files, out)
    finally:
        if owned:
            session.stop()


def _write(frame: DataFrame, path: Path) -> str:
    frame.write.mode("overwrite").parquet(str(path))
    return str(path)


def _run(spark: SparkSession, history_files: list[Path], span_files: list[Path], out: Path) -> Summary:
    history = read_history(spark, history_files)
    spans: Input | None = read_spans(spark, span_files) if span_files else None
    lifecycle = SpanLifecycle.of(spans.rows) if spans is not None else None
    events = history.rows
    tables = {name: str(out / name) for name in ("messages", "stages", "throughput", "failover_buckets", "violations")}
    messages: DataFrame | None = None
    try:
        messages = messages_table(history_messages(events), lifecycle).persist()
        _write(messages, Path(tables["messages"]))
        stages = history_stages(messages, events)
        if lifecycle is not None:
            stages = stages.unionByName(lifecycle.stages())
        _write(stages.select(*STAGE_COLUMNS), Path(tables["stages"]))
        stats = history.stats
        _write(throughput(spark, events, stats.min_ts, stats.max_ts), Path(tables["throughput"]))
        _write(failover_buckets(spark, events), Path(tables["failover_buckets"]))
        _write(violations(messages, events).select(*VIOLATION_COLUMNS), Path(tables["violations"]))

        counts = _message_counts(messages)
        stage_stats = _stage_latencies(spark.read.parquet(tables["stages"]))
        seconds = _seconds(spark.read.parquet(tables["throughput"]))
        around_faults = _fault_buckets(spark.read.parquet(tables["failover_buckets"]))
        by_kind, shown = _violations(spark.read.parquet(tables["violations"]))
        failover = fault_windows(events)
        confirm_gap, delivery_gap = longest_gaps(events)
    finally:
        if messages is not None:
            messages.unpersist()
        history.release()
        if spans is not None:
            spans.release()
        if lifecycle is not None:
            lifecycle.release()

    span_stats = spans.stats if spans is not None else InputStats()
    summary = Summary(
        messages=counts["messages"],
        published=counts["published"],
        confirmed=counts["confirmed"],
        unconfirmed=counts["unconfirmed"],
        nacked=counts["nacked"],
        rejected=counts["rejected"],
        in_flight=counts["in_flight"],
        delivered=counts["delivered"],
        deliveries=counts["deliveries"],
        redeliveries=counts["redeliveries"],
        acked=counts["acked"],
        traced=counts["traced"],
        lost=by_kind.get("lost", 0),
        duplicates=by_kind.get("duplicate", 0),
        order_violations=by_kind.get("order", 0),
        malformed_lines=history.stats.malformed + span_stats.malformed,
        malformed_history_lines=history.stats.malformed,
        malformed_span_lines=span_stats.malformed,
        malformed_files={**history.stats.malformed_by_file, **span_stats.malformed_by_file},
        history_files=len(history_files),
        span_files=len(span_files),
        history_events=history.stats.records,
        spans=span_stats.records,
        start_ts=history.stats.min_ts,
        end_ts=history.stats.max_ts,
        stages=stage_stats,
        failover=failover,
        longest_confirm_gap=confirm_gap,
        longest_delivery_gap=delivery_gap,
        violations=shown,
        out_dir=str(out),
        report=str(out / "report.md"),
        latency_chart=str(out / "latency.png"),
        throughput_chart=str(out / "throughput.png"),
        summary_json=str(out / "summary.json"),
        tables=tables,
        failover_buckets=around_faults,
    )
    report.write(summary, seconds)
    Path(summary.summary_json).write_text(json.dumps(summary.to_dict(), indent=2) + "\n", encoding="utf-8")
    return summary


def _message_counts(messages: DataFrame) -> dict[str, int]:
    outcome = F.col("outcome")
    published = F.col("publishes") > 0
    row = messages.agg(
        F.count(F.lit(1)).alias("messages"),
        F.count(F.when(published, 1)).alias("published"),
        F.count(F.when(outcome.isin(*POSITIVE_OUTCOMES), 1)).alias("confirmed"),
        F.count(F.when(published & outcome.isin("nacked", "rejected", "in_flight"), 1)).alias("unconfirmed"),
        F.count(F.when(outcome == "nacked", 1)).alias("nacked"),
        F.count(F.when(outcome == "rejected", 1)).alias("rejected"),
        F.count(F.when(outcome == "in_flight", 1)).alias("in_flight"),
        F.count(F.when(F.col("deliveries") > 0, 1)).alias("delivered"),
        F.sum("deliveries").alias("deliveries"),
        F.sum("redeliveries").alias("redeliveries"),
        F.count(F.when(F.col("acks") > 0, 1)).alias("acked"),
        F.count(F.when(F.col("traced"), 1)).alias("traced"),
    ).collect()[0]
    return {key: int(value or 0) for key, value in row.asDict().items()}


def _stage_latencies(stages: DataFrame) -> tuple[StageLatency, ...]:
    rows = (
        stages.where(F.col("latency_ms").isNotNull())
        .groupBy("stage")
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.percentile_approx("latency_ms", [0.5, 0.99], PERCENTILE_ACCURACY).alias("p"),
            F.max("latency_ms").alias("max"),
        )
        .collect()
    )
    found = {r["stage"]: r for r in rows}
    return tuple(
        StageLatency(
            stage=name,
            source=source,
            label=label,
            count=int(found[name]["n"]),
            p50_ms=float(found[name]["p"][0]),
            p99_ms=float(found[name]["p"][1]),
            max_ms=float(found[name]["max"]),
        )
        for name, source, label in STAGES
        if name in found
    )


def _seconds(table: DataFrame) -> list[report.Second]:
    return [
        report.Second(
            second=int(r["second"]),
            publishes=int(r["publishes"]),
            confirms=int(r["confirms"]),
            deliveries=int(r["deliveries"]),
            acks=int(r["acks"]),
            faults=int(r["faults"]),
        )
        for r in table.orderBy("second").collect()
    ]


def _fault_buckets(table: DataFrame) -> tuple[FaultBuckets, ...]:
    """The failover_buckets table as one FaultBuckets per fault, in fault order."""
    per_fault: dict[int, list[Row]] = {}
    for r in table.orderBy("fault", "bucket").collect():
        per_fault.setdefault(int(r["fault"]), []).append(r)
    return tuple(
        FaultBuckets(
            fault_ts=float(rs[0]["fault_ts"]),
            bucket_ms=BUCKET_MS,
            first_offset_ms=int(rs[0]["offset_ms"]),
            publishes=tuple(int(r["publishes"]) for r in rs),
            confirms=tuple(int(r["confirms"]) for r in rs),
            deliveries=tuple(int(r["deliveries"]) for r in rs),
            acks=tuple(int(r["acks"]) for r in rs),
        )
        for _, rs in sorted(per_fault.items())
    )


def _violations(table: DataFrame) -> tuple[dict[str, int], tuple[Violation, ...]]:
    """(count per kind, up to VIOLATION_CAP of each kind ordered by publisher, seq)."""
    per_kind = Window.partitionBy("kind").orderBy("publisher", "seq", "client")
    rows = (
        table.withColumn("_n", F.row_number().over(per_kind))
        .withColumn("_total", F.count(F.lit(1)).over(Window.partitionBy("kind")))
        .where(F.col("_n") <= VIOLATION_CAP)
        .collect()
    )
    counts = {r["kind"]: int(r["_total"]) for r in rows}
    order = {kind: i for i, kind in enumerate(KINDS)}
    rows.sort(key=lambda r: (order.get(r["kind"], len(order)), r["_n"]))
    shown = tuple(Violation(r["kind"], r["publisher"], int(r["seq"]), r["client"], r["detail"]) for r in rows)
    return counts, shown
