"""Inputs of the lifecycle job: which files to read, their schemas, and reading them as JSON lines.

Responsible for: turning the `--history` and `--spans` arguments into file lists, the explicit
schemas of client histories and span files (docs/observability.md; nothing is inferred), and
reading them into flat DataFrames.

Guarantees:
- a path that does not exist, or a history argument with no history file in it, raises
  `InputError` before any Spark work starts;
- every non-blank line of every file read is either one row of `Input.rows` or counted in
  `InputStats.malformed`: a line is malformed when it is not a JSON object of the schema (bad JSON,
  not an object, a known field of the wrong type) or lacks the fields the job keys on (histories:
  `ts` and `event`; spans: `name`, `trace_id` and `start_unix_nano`);
- every row keeps where it came from (`_file`, `_block`, `_row`): ordering by those three gives
  the order of the lines in their file (a split's rows are read in order and get increasing row
  ids), so "then file line order" tie-breaks are exact;
- a span's `name` column is the lifecycle step it records: a node's span name as it is
  (`ringq.enqueue`, ...), and for a client span named by the OpenTelemetry messaging conventions
  (`publish orders`, `receive orders`, ...; `messaging.system` "ringq") the step of its
  `messaging.operation.type` (CLIENT_STEPS: send is `ringq.publish`); `span_name` keeps the name
  written. Its `queue` and `message_id` come from `messaging.destination.name` and
  `messaging.message.id` where the ringq attributes are absent. Span files of older clients
  (`ringq.publish` with `ringq.queue`) read the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, DoubleType, LongType, StringType, StructField, StructType

HISTORY_PATTERN = "history-*.jsonl"
SPANS_PATTERN = "spans-*.jsonl"
CORRUPT = "_corrupt_record"
# Columns every parsed row carries: its file, the byte offset of its split, its row id within the read.
POSITION = ("_file", "_block", "_row")


class InputError(Exception):
    """An input path is missing or holds nothing to read; the message names it."""


HISTORY_SCHEMA = StructType(
    [
        StructField("ts", DoubleType()),
        StructField("event", StringType()),
        StructField("client", StringType()),
        StructField("queue", StringType()),
        StructField("publisher", StringType()),
        StructField("seq", LongType()),
        StructField("outcome", StringType()),
        StructField("error", StringType()),
        StructField("message_id", LongType()),
        StructField("redelivered", BooleanType()),
        StructField("delivery_count", LongType()),
        StructField("trace_id", StringType()),
        StructField("what", StringType()),
        StructField("node", StringType()),
        # Ordered streams (event "stream_deliver", recorded by the ringq-stream Spark source).
        StructField("stream", StringType()),
        StructField("stream_seq", LongType()),
        StructField("group", StringType()),
    ]
)

# Span attributes the job reads, and the flat column each becomes.
SPAN_ATTRIBUTES: dict[str, tuple[str, StringType | LongType | BooleanType]] = {
    "ringq.queue": ("queue", StringType()),
    "ringq.node": ("node", StringType()),
    "ringq.message_id": ("message_id", LongType()),
    "ringq.publisher": ("publisher", StringType()),
    "ringq.seq": ("seq", LongType()),
    "ringq.outcome": ("outcome", StringType()),
    "ringq.group": ("group", StringType()),
    "ringq.view_version": ("view_version", LongType()),
    "ringq.hop_from": ("hop_from", StringType()),
    "ringq.master_node": ("master_node", StringType()),
    "ringq.consumer": ("consumer", StringType()),
    "ringq.redelivered": ("redelivered", BooleanType()),
    "ringq.delivery_count": ("delivery_count", LongType()),
    "ringq.settle": ("settle", StringType()),
}

# The OpenTelemetry messaging conventions' attributes of client spans (docs/observability.md).
MESSAGING_ATTRIBUTES: dict[str, tuple[str, StringType]] = {
    "messaging.system": ("_messaging_system", StringType()),
    "messaging.operation.type": ("_operation_type", StringType()),
    "messaging.destination.name": ("_destination", StringType()),
    "messaging.message.id": ("_messaging_message_id", StringType()),
}
# The lifecycle step of a ringq client span, by its messaging.operation.type.
CLIENT_STEPS = {
    "send": "ringq.publish",
    "receive": "ringq.receive",
    "process": "ringq.process",
    "settle": "ringq.ack",
}
MESSAGING_SYSTEM = "ringq"

SPAN_SCHEMA = StructType(
    [
        StructField("name", StringType()),
        StructField("trace_id", StringType()),
        StructField("span_id", StringType()),
        StructField("parent_span_id", StringType()),
        StructField("start_unix_nano", LongType()),
        StructField("end_unix_nano", LongType()),
        StructField("process", StringType()),
        StructField("service", StringType()),
        StructField(
            "attributes",
            StructType(
                [StructField(key, kind) for key, (_, kind) in [*SPAN_ATTRIBUTES.items(), *MESSAGING_ATTRIBUTES.items()]]
            ),
        ),
    ]
)

HISTORY_REQUIRED = ("ts", "event")
SPANS_REQUIRED = ("name", "trace_id", "start_unix_nano")


@dataclass(frozen=True)
class InputStats:
    """What reading one kind of input found."""

    files: int = 0
    lines: int = 0  # non-blank lines
    records: int = 0  # lines that became rows
    malformed: int = 0
    malformed_by_file: dict[str, int] = field(default_factory=dict)
    min_ts: float | None = None  # histories: the earliest and latest event time (seconds since the epoch)
    max_ts: float | None = None


@dataclass(frozen=True)
class Input:
    """The rows read from one kind of input (cached until `release()`), and what reading found."""

    rows: DataFrame
    stats: InputStats
    _cached: DataFrame

    def release(self) -> None:
        self._cached.unpersist()


def _jsonl_in(directory: Path, pattern: str) -> list[Path]:
    return sorted(p for p in directory.glob(pattern) if p.is_file())


def discover_history(paths: Iterable[str | Path]) -> list[Path]:
    """History files: each directory's `history-*.jsonl` (or, when it has none, its `*.jsonl` other than
    span files); each file as given. Raises InputError for a missing path or when nothing is found."""
    found: list[Path] = []
    given = [Path(p) for p in paths]
    if not given:
        raise InputError("no history input given")
    for path in given:
        if path.is_dir():
            files = _jsonl_in(path, HISTORY_PATTERN) or [
                p for p in _jsonl_in(path, "*.jsonl") if not p.name.startswith("spans-")
            ]
            if not files:
                raise InputError(f"no history files ({HISTORY_PATTERN} or *.jsonl) in {path}")
            found.extend(files)
        elif path.is_file():
            found.append(path)
        else:
            raise InputError(f"history input not found: {path}")
    return found


def discover_spans(paths: Iterable[str | Path]) -> list[Path]:
    """Span files: each directory's `spans-*.jsonl` (none is fine: spans are optional); each file as given.
    Raises InputError for a missing path."""
    found: list[Path] = []
    for path in (Path(p) for p in paths):
        if path.is_dir():
            found.extend(_jsonl_in(path, SPANS_PATTERN))
        elif path.is_file():
            found.append(path)
        else:
            raise InputError(f"span input not found: {path}")
    return found


def _read_jsonl(spark: SparkSession, files: Sequence[Path], schema: StructType, required: Sequence[str]) -> DataFrame:
    """Every non-blank line parsed: the schema's columns, `_ok` (a usable row) and the position columns; cached."""
    with_corrupt = StructType([*schema.fields, StructField(CORRUPT, StringType())])
    text = spark.read.text([str(f.resolve()) for f in files]).select(
        F.input_file_name().alias("_file"),
        F.input_file_block_start().alias("_block"),
        F.monotonically_increasing_id().alias("_row"),
        F.col("value"),
    )
    parsed = text.where(F.trim(F.col("value")) != "").select(
        *POSITION,
        F.from_json("value", with_corrupt, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT}).alias("j"),
    )
    ok: Column = F.col("j").isNotNull() & F.col(f"j.{CORRUPT}").isNull()
    for name in required:
        ok = ok & F.col(f"j.{name}").isNotNull()
    rows = parsed.select(*POSITION, *(F.col(f"j.`{f.name}`").alias(f.name) for f in schema.fields), ok.alias("_ok"))
    return rows.persist(StorageLevel.MEMORY_AND_DISK)


def _stats(rows: DataFrame, files: int, with_ts: bool) -> InputStats:
    aggregates = [F.count(F.lit(1)).alias("lines"), F.sum(F.when(~F.col("_ok"), 1).otherwise(0)).alias("malformed")]
    if with_ts:
        aggregates += [
            F.min(F.when(F.col("_ok"), F.col("ts"))).alias("lo"),
            F.max(F.when(F.col("_ok"), F.col("ts"))).alias("hi"),
        ]
    per_file = rows.groupBy("_file").agg(*aggregates).collect()
    lines = sum(int(r["lines"]) for r in per_file)
    malformed = sum(int(r["malformed"]) for r in per_file)
    lows = [float(r["lo"]) for r in per_file if with_ts and r["lo"] is not None]
    highs = [float(r["hi"]) for r in per_file if with_ts and r["hi"] is not None]
    return InputStats(
        files=files,
        lines=lines,
        records=lines - malformed,
        malformed=malformed,
        malformed_by_file={_local_name(r["_file"]): int(r["malformed"]) for r in per_file if r["malformed"]},
        min_ts=min(lows) if lows else None,
        max_ts=max(highs) if highs else None,
    )


def _local_name(uri: str) -> str:
    """The local path of a file URI as Spark reports it (`file:///a%20b/x.jsonl` -> `/a b/x.jsonl`)."""
    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme in ("", "file") else uri


def read_history(spark: SparkSession, files: Sequence[Path]) -> Input:
    """Client history events: the HISTORY_SCHEMA columns plus the position columns."""
    rows = _read_jsonl(spark, files, HISTORY_SCHEMA, HISTORY_REQUIRED)
    stats = _stats(rows, len(files), with_ts=True)
    good = rows.where(F.col("_ok")).drop("_ok")
    return Input(good, stats, rows)


def read_spans(spark: SparkSession, files: Sequence[Path]) -> Input:
    """Finished spans, attributes flattened: name (the lifecycle step), span_name, trace_id (lower case),
    span_id, parent_span_id, start_ns, end_ns, process, service, then one column per SPAN_ATTRIBUTES entry,
    plus the position columns."""
    rows = _read_jsonl(spark, files, SPAN_SCHEMA, SPANS_REQUIRED)
    stats = _stats(rows, len(files), with_ts=False)
    attributes = F.col("attributes")
    flat = rows.where(F.col("_ok")).select(
        *POSITION,
        F.col("name").alias("span_name"),
        F.lower(F.col("trace_id")).alias("trace_id"),
        F.lower(F.col("span_id")).alias("span_id"),
        F.lower(F.col("parent_span_id")).alias("parent_span_id"),
        F.col("start_unix_nano").alias("start_ns"),
        F.col("end_unix_nano").alias("end_ns"),
        F.col("process"),
        F.col("service"),
        *(attributes.getField(key).alias(column) for key, (column, _) in SPAN_ATTRIBUTES.items()),
        *(attributes.getField(key).alias(column) for key, (column, _) in MESSAGING_ATTRIBUTES.items()),
    )
    step: Column = F.col("span_name")
    for operation, name in CLIENT_STEPS.items():
        ours = (F.col("_messaging_system") == MESSAGING_SYSTEM) & (F.col("_operation_type") == operation)
        step = F.when(ours, F.lit(name)).otherwise(step)
    overrides = {
        "queue": F.coalesce(F.col("queue"), F.col("_destination")),
        "message_id": F.coalesce(F.col("message_id"), F.col("_messaging_message_id").cast(LongType())),
    }
    columns = ["span_name", "trace_id", "span_id", "parent_span_id", "start_ns", "end_ns", "process", "service"]
    columns += [column for column, _ in SPAN_ATTRIBUTES.values()]
    good = flat.select(*POSITION, step.alias("name"), *(overrides.get(c, F.col(c)).alias(c) for c in columns))
    return Input(good, stats, rows)
