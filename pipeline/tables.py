"""The tables of the lifecycle job: one row per message, per-stage latency rows and per-second throughput.

Responsible for: turning history events and spans (pipeline.inputs) into
- `messages`: one row per message, keyed by (publisher, seq) as docs/observability.md defines it,
  with what the client histories saw (publish, confirm outcome, deliveries, acks, consumers) and
  what the spans saw (master node, enqueue, mirror applies per node, ring hops, server confirm,
  nodes and processes involved);
- `stages`: one row per measured stage of one message (publish→confirm, publish→first delivery,
  delivery→ack from histories; publish→enqueue, enqueue→mirror apply, enqueue→confirm and each
  ring hop from spans) with its latency in milliseconds;
- `throughput`: per-second counts of publishes, positive confirms, deliveries, acks and faults;
- `failover_buckets`: the same counts in 100 ms buckets from 2 s before each fault to 3 s after it,
  aligned on the fault (the failover window, a few hundred ms, vanishes into a 1 s bucket).

Guarantees:
- every history event that names a publisher and a seq, and every span that can be tied to one
  (its own ringq.publisher + ringq.seq; else its trace and ringq.message_id matching an enqueue
  span; else its trace alone), counts towards exactly one message row;
- history times are the clients' wall clocks, span times are span start times (the moment the
  step happened); both are seconds since the epoch in the tables. Span latencies are computed from
  the nanosecond fields, history latencies are rounded to the microsecond the clients record;
- a message's deliveries are ranked in event order (time, then line order in its file), so
  "repeat" means any delivery after its first;
- outcome is the best answer the producer got: confirmed > duplicate > rejected > nacked >
  in_flight (published, never answered) > unknown (no publish in the histories); a confirm event
  without an outcome counts as confirmed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

POSITIVE_OUTCOMES = ("confirmed", "duplicate")
# Event order: the event's time, then its line's position in its file.
EVENT_ORDER = ("ts", "_file", "_block", "_row")
KEY = ("publisher", "seq")
MESSAGE_EVENTS = ("publish", "confirm", "nack", "deliver", "ack")

PUBLISH, ENQUEUE, HOP, APPLY, CONFIRM = (
    "ringq.publish",
    "ringq.enqueue",
    "ringq.ring.hop",
    "ringq.mirror.apply",
    "ringq.confirm",
)

# Stages in report order: (name, source, label).
STAGES: tuple[tuple[str, str, str], ...] = (
    ("publish_to_confirm", "history", "publish → confirm"),
    ("publish_to_first_delivery", "history", "publish → first delivery (end to end)"),
    ("delivery_to_ack", "history", "delivery → ack"),
    ("publish_to_enqueue", "spans", "publish → enqueue"),
    ("enqueue_to_mirror_apply", "spans", "enqueue → mirror apply"),
    ("enqueue_to_confirm", "spans", "enqueue → confirm (server)"),
    ("ring_hop", "spans", "ring hop"),
)

# The span-side columns of `messages`, with their types (null when a message has no spans).
SPAN_MESSAGE_COLUMNS: dict[str, str] = {
    "trace_ids": "array<string>",
    "master_node": "string",
    "span_publish_ts": "double",
    "enqueue_ts": "double",
    "mirror_apply": "map<string,double>",
    "ring_hops": "bigint",
    "server_confirm_ts": "double",
    "nodes": "array<string>",
    "processes": "array<string>",
}

STAGE_COLUMNS = ("publisher", "seq", "stage", "source", "node", "start_ts", "latency_ms")


def positive_confirm() -> Column:
    """A confirm event with a positive outcome (confirmed or duplicate; no outcome counts as confirmed)."""
    return (F.col("event") == "confirm") & F.coalesce(F.col("outcome"), F.lit("confirmed")).isin(*POSITIVE_OUTCOMES)


def _flagged() -> Column:
    return F.coalesce(F.col("redelivered"), F.lit(False))


def _first_by_time(condition: Column, value: str) -> Column:
    """The value of the earliest (by ts) row meeting `condition` with a non-null value."""
    return F.min(F.when(condition & F.col(value).isNotNull(), F.struct(F.col("ts"), F.col(value))))[value]


def history_messages(history: DataFrame) -> DataFrame:
    """One row per (publisher, seq) named by a history event: the client side of the lifecycle."""
    events = history.where(
        F.col("event").isin(*MESSAGE_EVENTS) & F.col("publisher").isNotNull() & F.col("seq").isNotNull()
    )
    ranked = events.withColumn("_n", F.row_number().over(Window.partitionBy(*KEY, "event").orderBy(*EVENT_ORDER)))
    event = F.col("event")
    deliver = event == "deliver"
    outcome = F.coalesce(F.col("outcome"), F.lit("confirmed"))
    grouped = ranked.groupBy(*KEY).agg(
        _first_by_time(F.lit(True), "queue").alias("queue"),
        _first_by_time(event == "publish", "client").alias("producer"),
        F.count(F.when(event == "publish", 1)).alias("publishes"),
        F.min(F.when(event == "publish", F.col("ts"))).alias("publish_ts"),
        F.min(F.when(positive_confirm(), F.col("ts"))).alias("confirm_ts"),
        F.bool_or((event == "confirm") & (outcome == "confirmed")).alias("_confirmed"),
        F.bool_or((event == "confirm") & (outcome == "duplicate")).alias("_duplicate"),
        F.bool_or((event == "confirm") & ~outcome.isin(*POSITIVE_OUTCOMES)).alias("_rejected"),
        F.bool_or(event == "nack").alias("_nacked"),
        F.min(F.when(deliver, F.col("ts"))).alias("first_deliver_ts"),
        F.count(F.when(deliver, 1)).alias("deliveries"),
        F.count(F.when(deliver & _flagged(), 1)).alias("redeliveries"),
        F.count(F.when(deliver & (F.col("_n") > 1) & ~_flagged(), 1)).alias("unflagged_repeats"),
        F.array_sort(F.collect_set(F.when(deliver, F.col("message_id")))).alias("delivered_message_ids"),
        F.array_sort(F.collect_set(F.when(deliver, F.col("client")))).alias("consumers"),
        F.min(F.when(event == "ack", F.col("ts"))).alias("first_ack_ts"),
        F.count(F.when(event == "ack", 1)).alias("acks"),
    )
    return grouped.select(
        *KEY,
        "queue",
        "producer",
        F.when(F.col("_confirmed"), "confirmed")
        .when(F.col("_duplicate"), "duplicate")
        .when(F.col("_rejected"), "rejected")
        .when(F.col("_nacked"), "nacked")
        .when(F.col("publishes") > 0, "in_flight")
        .otherwise("unknown")
        .alias("outcome"),
        "publishes",
        "publish_ts",
        "confirm_ts",
        "first_deliver_ts",
        "deliveries",
        "redeliveries",
        "unflagged_repeats",
        "delivered_message_ids",
        "consumers",
        "first_ack_ts",
        "acks",
    )


def keyed_spans(spans: DataFrame) -> DataFrame:
    """Spans tied to a message: (publisher, seq) from the span's own attributes, else from the enqueue span
    with the same trace and message id, else from the enqueue span(s) of the same trace."""
    has_key = F.col("publisher").isNotNull() & F.col("seq").isNotNull()
    enqueues = spans.where((F.col("name") == ENQUEUE) & has_key & F.col("message_id").isNotNull())
    by_message = enqueues.select("trace_id", "message_id", *KEY).distinct()
    by_trace = enqueues.select("trace_id", *KEY).distinct()
    own = spans.where(has_key)
    rest = spans.where(~has_key).drop(*KEY)
    via_message = rest.where(F.col("message_id").isNotNull()).join(by_message, ["trace_id", "message_id"])
    via_trace = rest.where(F.col("message_id").isNull()).join(by_trace, ["trace_id"])
    return own.unionByName(via_message).unionByName(via_trace)


@dataclass(frozen=True)
class SpanLifecycle:
    """The span side of every traced message. `per_node`: one row per (message, span name, node) with the
    first start (`first_ns`) and count; `per_message`: times in nanoseconds, for the stages; both cached."""

    keyed: DataFrame
    per_node: DataFrame
    per_message: DataFrame

    @staticmethod
    def of(spans: DataFrame) -> SpanLifecycle:
        keyed = keyed_spans(spans).persist(StorageLevel.MEMORY_AND_DISK)
        per_node = (
            keyed.groupBy(*KEY, "name", "node")
            .agg(
                F.min("start_ns").alias("first_ns"),
                F.count(F.lit(1)).alias("n"),
                F.min("queue").alias("queue"),
                F.collect_set("process").alias("processes"),
                F.collect_set("trace_id").alias("trace_ids"),
                F.collect_set("message_id").alias("message_ids"),
            )
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        name = F.col("name")
        enqueue = F.min(F.when(name == ENQUEUE, F.struct(F.col("first_ns"), F.col("node"))))
        per_message = (
            per_node.groupBy(*KEY)
            .agg(
                F.min("queue").alias("span_queue"),
                F.array_sort(F.array_distinct(F.flatten(F.collect_list("trace_ids")))).alias("trace_ids"),
                enqueue["node"].alias("master_node"),
                F.min(F.when(name == PUBLISH, F.col("first_ns"))).alias("publish_ns"),
                enqueue["first_ns"].alias("enqueue_ns"),
                F.map_from_entries(
                    F.collect_list(
                        F.when(
                            (name == APPLY) & F.col("node").isNotNull(),
                            F.struct(F.col("node"), F.col("first_ns") / 1e9),
                        )
                    )
                ).alias("mirror_apply"),
                F.coalesce(F.sum(F.when(name == HOP, F.col("n"))), F.lit(0)).alias("ring_hops"),
                F.min(F.when(name == CONFIRM, F.col("first_ns"))).alias("server_confirm_ns"),
                F.array_sort(F.collect_set("node")).alias("nodes"),
                F.array_sort(F.array_distinct(F.flatten(F.collect_list("processes")))).alias("processes"),
                F.array_sort(
                    F.array_distinct(F.flatten(F.collect_list(F.when(name == ENQUEUE, F.col("message_ids")))))
                ).alias("stored_message_ids"),
            )
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        return SpanLifecycle(keyed, per_node, per_message)

    def release(self) -> None:
        for frame in (self.per_message, self.per_node, self.keyed):
            frame.unpersist()

    def stages(self) -> DataFrame:
        """Stage rows measured from spans (latencies from the nanosecond start times)."""
        m = self.per_message

        def ms(later: Column, earlier: Column) -> Column:
            return (later - earlier) / 1e6

        no_node = F.lit(None).cast("string")
        publish_to_enqueue = m.where(F.col("publish_ns").isNotNull() & F.col("enqueue_ns").isNotNull()).select(
            *KEY,
            F.lit("publish_to_enqueue").alias("stage"),
            no_node.alias("node"),
            (F.col("publish_ns") / 1e9).alias("start_ts"),
            ms(F.col("enqueue_ns"), F.col("publish_ns")).alias("latency_ms"),
        )
        enqueue_to_confirm = m.where(F.col("enqueue_ns").isNotNull() & F.col("server_confirm_ns").isNotNull()).select(
            *KEY,
            F.lit("enqueue_to_confirm").alias("stage"),
            F.col("master_node").alias("node"),
            (F.col("enqueue_ns") / 1e9).alias("start_ts"),
            ms(F.col("server_confirm_ns"), F.col("enqueue_ns")).alias("latency_ms"),
        )
        applies = (
            self.per_node.where(F.col("name") == APPLY)
            .select(*KEY, "node", "first_ns")
            .join(m.where(F.col("enqueue_ns").isNotNull()).select(*KEY, "enqueue_ns"), list(KEY))
            .select(
                *KEY,
                F.lit("enqueue_to_mirror_apply").alias("stage"),
                "node",
                (F.col("enqueue_ns") / 1e9).alias("start_ts"),
                ms(F.col("first_ns"), F.col("enqueue_ns")).alias("latency_ms"),
            )
        )
        rows = publish_to_enqueue.unionByName(enqueue_to_confirm).unionByName(applies).unionByName(self._hops())
        return rows.select(*KEY, "stage", F.lit("spans").alias("source"), "node", "start_ts", "latency_ms")

    def _hops(self) -> DataFrame:
        """One row per ring hop that has a predecessor: the time from when the member it came from
        (`ringq.hop_from`; any member when absent) last had the report (the enqueue at the master, or an
        earlier hop there) to when this member received it."""
        hops = self.keyed.where(F.col("name") == HOP).select(
            *KEY, "node", "hop_from", F.col("start_ns").alias("hop_ns"), F.col("_row").alias("hop_row")
        )
        holders = self.keyed.where(F.col("name").isin(ENQUEUE, HOP)).select(
            *KEY, F.col("node").alias("holder"), F.col("start_ns").alias("held_ns"), F.col("_row").alias("held_row")
        )
        matched = hops.join(
            holders,
            (hops["publisher"] == holders["publisher"])
            & (hops["seq"] == holders["seq"])
            & (hops["hop_from"].isNull() | (hops["hop_from"] == holders["holder"]))
            & (holders["held_ns"] <= hops["hop_ns"])
            & (holders["held_row"] != hops["hop_row"]),
        )
        return (
            matched.groupBy(hops["publisher"], hops["seq"], "node", "hop_ns", "hop_row")
            .agg(F.max("held_ns").alias("from_ns"))
            .select(
                *KEY,
                F.lit("ring_hop").alias("stage"),
                "node",
                (F.col("from_ns") / 1e9).alias("start_ts"),
                ((F.col("hop_ns") - F.col("from_ns")) / 1e6).alias("latency_ms"),
            )
        )


def messages_table(history_side: DataFrame, spans: SpanLifecycle | None) -> DataFrame:
    """The `messages` table: the history side joined with the span side on (publisher, seq)."""
    if spans is None:
        joined = history_side.select(
            "*",
            *(F.lit(None).cast(kind).alias(name) for name, kind in SPAN_MESSAGE_COLUMNS.items()),
            F.lit(None).cast("array<bigint>").alias("stored_message_ids"),
            F.lit(None).cast("string").alias("span_queue"),
        )
    else:
        m = spans.per_message
        joined = history_side.join(
            m.select(
                *KEY,
                "span_queue",
                "trace_ids",
                "master_node",
                (F.col("publish_ns") / 1e9).alias("span_publish_ts"),
                (F.col("enqueue_ns") / 1e9).alias("enqueue_ts"),
                "mirror_apply",
                "ring_hops",
                (F.col("server_confirm_ns") / 1e9).alias("server_confirm_ts"),
                "nodes",
                "processes",
                "stored_message_ids",
            ),
            list(KEY),
            "full_outer",
        )
    empty_ids = F.array().cast("array<bigint>")
    message_ids = F.array_sort(
        F.array_union(
            F.coalesce(F.col("delivered_message_ids"), empty_ids), F.coalesce(F.col("stored_message_ids"), empty_ids)
        )
    )
    zero = F.lit(0).cast("bigint")
    return joined.select(
        *KEY,
        F.coalesce(F.col("queue"), F.col("span_queue")).alias("queue"),
        "producer",
        F.coalesce(F.col("outcome"), F.lit("unknown")).alias("outcome"),
        F.coalesce(F.col("publishes"), zero).alias("publishes"),
        "publish_ts",
        "confirm_ts",
        "first_deliver_ts",
        F.coalesce(F.col("deliveries"), zero).alias("deliveries"),
        F.coalesce(F.col("redeliveries"), zero).alias("redeliveries"),
        F.coalesce(F.col("unflagged_repeats"), zero).alias("unflagged_repeats"),
        message_ids.alias("message_ids"),
        F.size(message_ids).alias("distinct_message_ids"),
        "first_ack_ts",
        F.coalesce(F.col("acks"), zero).alias("acks"),
        F.coalesce(F.col("consumers"), F.array().cast("array<string>")).alias("consumers"),
        F.col("enqueue_ts").isNotNull().alias("traced"),
        *SPAN_MESSAGE_COLUMNS,
    )


def _rounded_ms(later: Column, earlier: Column) -> Column:
    return F.round((later - earlier) * 1000.0, 3)


def history_stages(messages: DataFrame, history: DataFrame) -> DataFrame:
    """Stage rows measured from client histories: publish→confirm and publish→first delivery per message, and
    delivery→ack per ack (from the latest delivery of that message to the acking client before the ack)."""
    no_node = F.lit(None).cast("string")
    publish_to_confirm = messages.where(F.col("publish_ts").isNotNull() & F.col("confirm_ts").isNotNull()).select(
        *KEY,
        F.lit("publish_to_confirm").alias("stage"),
        no_node.alias("node"),
        F.col("publish_ts").alias("start_ts"),
        _rounded_ms(F.col("confirm_ts"), F.col("publish_ts")).alias("latency_ms"),
    )
    end_to_end = messages.where(F.col("publish_ts").isNotNull() & F.col("first_deliver_ts").isNotNull()).select(
        *KEY,
        F.lit("publish_to_first_delivery").alias("stage"),
        no_node.alias("node"),
        F.col("publish_ts").alias("start_ts"),
        _rounded_ms(F.col("first_deliver_ts"), F.col("publish_ts")).alias("latency_ms"),
    )
    settled = history.where(
        F.col("event").isin("deliver", "ack") & F.col("publisher").isNotNull() & F.col("seq").isNotNull()
    )
    so_far = (
        Window.partitionBy("client", *KEY)
        .orderBy(*EVENT_ORDER)
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    acks = (
        settled.withColumn(
            "delivered_ts", F.last(F.when(F.col("event") == "deliver", F.col("ts")), ignorenulls=True).over(so_far)
        )
        .where((F.col("event") == "ack") & F.col("delivered_ts").isNotNull())
        .select(
            *KEY,
            F.lit("delivery_to_ack").alias("stage"),
            no_node.alias("node"),
            F.col("delivered_ts").alias("start_ts"),
            _rounded_ms(F.col("ts"), F.col("delivered_ts")).alias("latency_ms"),
        )
    )
    rows = publish_to_confirm.unionByName(end_to_end).unionByName(acks)
    return rows.select(*KEY, "stage", F.lit("history").alias("source"), "node", "start_ts", "latency_ms")


# Per-second counts are filled with zeros between the first and last second when the histories span at
# most this long; a longer (or clock-broken) span keeps only the seconds that had events.
MAX_FILLED_SECONDS = 7 * 24 * 3600


def throughput(spark: SparkSession, history: DataFrame, first_ts: float | None, last_ts: float | None) -> DataFrame:
    """Per-second counts: second (epoch second), publishes, confirms (positive), deliveries, acks, faults."""
    event = F.col("event")
    counts = (
        history.withColumn("second", F.floor(F.col("ts")).cast("bigint"))
        .groupBy("second")
        .agg(
            F.count(F.when(event == "publish", 1)).alias("publishes"),
            F.count(F.when(positive_confirm(), 1)).alias("confirms"),
            F.count(F.when(event == "deliver", 1)).alias("deliveries"),
            F.count(F.when(event == "ack", 1)).alias("acks"),
            F.count(F.when(event == "fault", 1)).alias("faults"),
        )
    )
    if first_ts is not None and last_ts is not None and last_ts - first_ts <= MAX_FILLED_SECONDS:
        seconds = spark.range(int(first_ts // 1), int(last_ts // 1) + 1).select(F.col("id").alias("second"))
        counts = seconds.join(counts, "second", "left").fillna(0)
    return counts.orderBy("second")


# The zoomed view around each fault: buckets of BUCKET_MS from BEFORE_FAULT_MS before it to AFTER_FAULT_MS after.
BUCKET_MS = 100
BEFORE_FAULT_MS = 2000
AFTER_FAULT_MS = 3000


def failover_buckets(spark: SparkSession, history: DataFrame) -> DataFrame:
    """Per fault: fault (0, 1, ... in event order, as `failover.fault_windows` lists them), fault_ts, bucket
    (index from the fault's own, negative before it), offset_ms (the bucket's start, ms from the fault) and the
    counts of publishes, confirms (positive), deliveries and acks in it. Buckets are aligned on the fault (bucket
    0 is [fault, fault + BUCKET_MS)), measured on the microsecond offset so a time exactly on a boundary falls in
    the later bucket; every bucket of every fault's window is there (zeros when empty)."""
    event = F.col("event")
    faults = history.where(event == "fault").select(
        (F.row_number().over(Window.orderBy(*EVENT_ORDER)) - 1).alias("fault"), F.col("ts").alias("fault_ts")
    )
    first, last = -BEFORE_FAULT_MS // BUCKET_MS, AFTER_FAULT_MS // BUCKET_MS  # bucket indexes [first, last)
    near = (F.col("ts") >= F.col("fault_ts") - (BEFORE_FAULT_MS + 1) / 1000) & (
        F.col("ts") < F.col("fault_ts") + (AFTER_FAULT_MS + 1) / 1000
    )
    micros = F.round((F.col("ts") - F.col("fault_ts")) * 1e6).cast("bigint")
    counts = (
        history.where(event.isin("publish", "confirm", "deliver", "ack"))
        .join(F.broadcast(faults), near)
        .withColumn("bucket", F.floor(micros / (BUCKET_MS * 1000)))
        .where(F.col("bucket").between(first, last - 1))
        .groupBy("fault", "bucket")
        .agg(
            F.count(F.when(event == "publish", 1)).alias("publishes"),
            F.count(F.when(positive_confirm(), 1)).alias("confirms"),
            F.count(F.when(event == "deliver", 1)).alias("deliveries"),
            F.count(F.when(event == "ack", 1)).alias("acks"),
        )
    )
    grid = faults.crossJoin(spark.range(first, last).select(F.col("id").alias("bucket")))
    return (
        grid.join(counts, ["fault", "bucket"], "left")
        .fillna(0, ["publishes", "confirms", "deliveries", "acks"])
        .select(
            "fault",
            "fault_ts",
            "bucket",
            (F.col("bucket") * BUCKET_MS).alias("offset_ms"),
            "publishes",
            "confirms",
            "deliveries",
            "acks",
        )
        .orderBy("fault", "bucket")
    )
