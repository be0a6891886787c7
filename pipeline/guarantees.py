"""The delivery guarantees checked against what the clients saw: lost, duplicated and reordered messages.

Responsible for: the `violations` table, one row per violation with kind, publisher, seq, client
(where one applies) and a human-readable detail.

Guarantees (the definitions, applied exactly):
- `lost`: a message whose producer got a positive confirm (outcome confirmed or duplicate) and that
  no consumer history shows delivered. Messages never confirmed (nacked, rejected, in flight at the
  end) are never lost: the broker did not take responsibility for them;
- `duplicate`: a message delivered more than once where a delivery after its first is NOT flagged
  redelivered, or a message stored under two or more message ids (seen in deliveries or in enqueue
  spans). One row per message;
- `order`: per consumer client, queue and publisher, in the client's delivery order (time, then line
  order in its file), the first delivery of a message to that client, not flagged redelivered, whose
  seq is lower than a seq of the same publisher already delivered to that client. One row per such
  delivery. Flagged redeliveries and repeats of a message the client already had are never order
  violations.
- `order` on an ordered stream (history events `stream_deliver`: stream, stream_seq, redelivered,
  client): in delivery order over every client of the stream (time, then file, then line order), a
  delivery whose stream_seq is not above the highest stream_seq delivered before it for that stream,
  except a delivery flagged redelivered of a stream_seq delivered before (the documented repeat of what a
  consumer had not acknowledged, after a consumer failover or a broken consume call). So an unflagged
  repeat, and any delivery that goes back below the stream's high mark to a stream_seq never delivered
  (a skip then a step back), is one. Its row: publisher `stream:<stream>`, seq the stream_seq.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from pipeline.tables import EVENT_ORDER, KEY, POSITIVE_OUTCOMES

KINDS = ("lost", "duplicate", "order")
VIOLATION_COLUMNS = ("kind", "publisher", "seq", "client", "detail")


def lost(messages: DataFrame) -> DataFrame:
    return messages.where(F.col("outcome").isin(*POSITIVE_OUTCOMES) & (F.col("deliveries") == 0)).select(
        F.lit("lost").alias("kind"),
        *KEY,
        F.lit(None).cast("string").alias("client"),
        F.format_string("confirm (%s) at %.6f, never delivered", F.col("outcome"), F.col("confirm_ts")).alias("detail"),
    )


def duplicates(messages: DataFrame) -> DataFrame:
    return messages.where((F.col("unflagged_repeats") > 0) | (F.col("distinct_message_ids") > 1)).select(
        F.lit("duplicate").alias("kind"),
        *KEY,
        F.array_join(F.col("consumers"), ",").alias("client"),
        F.format_string(
            "delivered %d time(s), %d repeat(s) not flagged redelivered; message ids [%s]",
            F.col("deliveries"),
            F.col("unflagged_repeats"),
            F.array_join(F.col("message_ids"), ","),
        ).alias("detail"),
    )


def order_violations(history: DataFrame) -> DataFrame:
    deliveries = history.where(
        (F.col("event") == "deliver")
        & F.col("publisher").isNotNull()
        & F.col("seq").isNotNull()
        & F.col("client").isNotNull()
    ).withColumn("_queue", F.coalesce(F.col("queue"), F.lit("")))
    stream = Window.partitionBy("client", "_queue", "publisher").orderBy(*EVENT_ORDER)
    per_message = Window.partitionBy("client", "_queue", *KEY).orderBy(*EVENT_ORDER)
    ranked = deliveries.withColumn(
        "_highest_before", F.max("seq").over(stream.rowsBetween(Window.unboundedPreceding, -1))
    ).withColumn("_n", F.row_number().over(per_message))
    return ranked.where(
        (F.col("_n") == 1) & ~F.coalesce(F.col("redelivered"), F.lit(False)) & (F.col("_highest_before") > F.col("seq"))
    ).select(
        F.lit("order").alias("kind"),
        *KEY,
        "client",
        F.format_string(
            "%s got seq %d after seq %d (queue %s, at %.6f)",
            F.col("client"),
            F.col("seq"),
            F.col("_highest_before"),
            F.col("_queue"),
            F.col("ts"),
        ).alias("detail"),
    )


STREAM_DELIVER = "stream_deliver"
STREAM_PREFIX = "stream:"


def stream_order_violations(history: DataFrame) -> DataFrame:
    """The stream-order violations (see the module docstring) among the `stream_deliver` rows of `history`
    (columns event, client, stream, stream_seq, redelivered and EVENT_ORDER's)."""
    deliveries = history.where(
        (F.col("event") == STREAM_DELIVER) & F.col("stream").isNotNull() & F.col("stream_seq").isNotNull()
    )
    before = Window.partitionBy("stream").orderBy(*EVENT_ORDER).rowsBetween(Window.unboundedPreceding, -1)
    per_seq = Window.partitionBy("stream", "stream_seq").orderBy(*EVENT_ORDER)
    ranked = deliveries.withColumn("_highest_before", F.max("stream_seq").over(before)).withColumn(
        "_n", F.row_number().over(per_seq)
    )
    flagged_repeat = (F.col("_n") > 1) & F.coalesce(F.col("redelivered"), F.lit(False))
    return ranked.where((F.col("_highest_before") >= F.col("stream_seq")) & ~flagged_repeat).select(
        F.lit("order").alias("kind"),
        F.concat(F.lit(STREAM_PREFIX), F.col("stream")).alias("publisher"),
        F.col("stream_seq").alias("seq"),
        "client",
        F.format_string(
            "%s got stream_seq %d after stream_seq %d (stream %s, %s, at %.6f)",
            F.coalesce(F.col("client"), F.lit("?")),
            F.col("stream_seq"),
            F.col("_highest_before"),
            F.col("stream"),
            F.when(F.col("_n") > 1, F.lit("a repeat not flagged redelivered")).otherwise(
                F.lit("never delivered before")
            ),
            F.col("ts"),
        ).alias("detail"),
    )


def violations(messages: DataFrame, history: DataFrame) -> DataFrame:
    """Every violation: lost, then duplicates, then order violations (queues, then streams)."""
    return (
        lost(messages)
        .unionByName(duplicates(messages))
        .unionByName(order_violations(history))
        .unionByName(stream_order_violations(history))
    )
