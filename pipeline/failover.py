"""Failover windows and stalls, measured from the client histories.

Responsible for: for each `fault` event, the time from the fault until the first positive confirm
after it and until the first delivery after it; and the longest gap between consecutive positive
confirms and between consecutive deliveries, with where it starts and ends.

Guarantees: times are the clients' wall clocks (seconds since the epoch); "after" is strictly
later than the fault; a fault with nothing after it gets None, never a made-up window; with fewer
than two events of a kind there is no gap (None). Everything collected is small (one row per fault
and one per kind).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from pipeline.summary import FailoverWindow, Gap
from pipeline.tables import EVENT_ORDER, positive_confirm


def fault_windows(history: DataFrame) -> tuple[FailoverWindow, ...]:
    faults = (
        history.where(F.col("event") == "fault").orderBy(*EVENT_ORDER).select("ts", "what", "node", "client")
    ).collect()
    if not faults:
        return ()
    aggregates: list[Column] = []
    for i, fault in enumerate(faults):
        later = F.col("ts") > F.lit(float(fault["ts"]))
        aggregates.append(F.min(F.when(positive_confirm() & later, F.col("ts"))).alias(f"confirm_{i}"))
        aggregates.append(F.min(F.when((F.col("event") == "deliver") & later, F.col("ts"))).alias(f"deliver_{i}"))
    firsts = history.agg(*aggregates).collect()[0]
    windows = []
    for i, fault in enumerate(faults):
        at = float(fault["ts"])
        confirm, deliver = firsts[f"confirm_{i}"], firsts[f"deliver_{i}"]
        windows.append(
            FailoverWindow(
                fault_ts=at,
                what=fault["what"],
                node=fault["node"],
                client=fault["client"],
                first_confirm_ts=confirm,
                confirm_after_s=None if confirm is None else round(confirm - at, 6),
                first_delivery_ts=deliver,
                delivery_after_s=None if deliver is None else round(deliver - at, 6),
            )
        )
    return tuple(windows)


def longest_gaps(history: DataFrame) -> tuple[Gap | None, Gap | None]:
    """(longest gap between consecutive positive confirms, between consecutive deliveries)."""
    marks = history.where(positive_confirm() | (F.col("event") == "deliver")).select(
        F.when(F.col("event") == "deliver", "delivery").otherwise("confirm").alias("kind"), "ts"
    )
    previous = F.lag("ts").over(Window.partitionBy("kind").orderBy("ts"))
    rows = (
        marks.withColumn("start", previous)
        .where(F.col("start").isNotNull())
        .groupBy("kind")
        .agg(F.max(F.struct((F.col("ts") - F.col("start")).alias("gap"), F.col("start"), F.col("ts"))).alias("g"))
        .collect()
    )
    gaps = {
        r["kind"]: Gap(r["kind"], float(r["g"]["start"]), float(r["g"]["ts"]), round(float(r["g"]["gap"]), 6))
        for r in rows
    }
    return gaps.get("confirm"), gaps.get("delivery")
