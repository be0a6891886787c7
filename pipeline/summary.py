"""The job's result as plain Python values: what `run_lifecycle` returns and `summary.json` holds.

Responsible for: the Summary dataclass and its parts (stage latencies, failover windows, the
100 ms buckets around each fault, gaps, violations), their JSON form and their short plain-text
form (`Summary.text()`, what `python -m pipeline` prints). Guarantees: values only (no Spark
objects), immutable; `to_dict()` is JSON-serialisable with the same field names as the
attributes, plus `violation_count`; times in text are seconds since the first history event
("+1.500 s"), except around a fault, where they are milliseconds from it ("+300 ms").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class StageLatency:
    """Latency of one stage over every message measured: nearest-rank p50 and p99, and the max, in ms."""

    stage: str
    source: str  # "history" (client clocks) or "spans" (span start times)
    label: str
    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float


@dataclass(frozen=True)
class Gap:
    """The longest time between two consecutive events of one kind ("confirm" or "delivery")."""

    kind: str
    start_ts: float
    end_ts: float
    seconds: float


@dataclass(frozen=True)
class FailoverWindow:
    """A fault event and how long until the next positive confirm and the next delivery (None: none came)."""

    fault_ts: float
    what: str | None
    node: str | None
    client: str | None
    first_confirm_ts: float | None
    confirm_after_s: float | None
    first_delivery_ts: float | None
    delivery_after_s: float | None


@dataclass(frozen=True)
class FaultBuckets:
    """Counts in fixed buckets around one fault (`Summary.failover_buckets[i]` is around `Summary.failover[i]`).

    Bucket i covers [first_offset_ms + i * bucket_ms, first_offset_ms + (i + 1) * bucket_ms) milliseconds from
    the fault's time: buckets are aligned on the fault, whose own bucket starts at 0. Every bucket of the
    window is there, empty ones as zeros."""

    fault_ts: float
    bucket_ms: int
    first_offset_ms: int
    publishes: tuple[int, ...]
    confirms: tuple[int, ...]  # positive confirms, as everywhere else
    deliveries: tuple[int, ...]
    acks: tuple[int, ...]

    def offsets_ms(self) -> list[int]:
        """The start of each bucket, in ms from the fault."""
        return [self.first_offset_ms + i * self.bucket_ms for i in range(len(self.confirms))]

    def fault_bucket(self) -> int:
        """The index of the bucket starting at the fault (len() when the window ends before it)."""
        return min(max(-self.first_offset_ms // self.bucket_ms, 0), len(self.confirms))

    def empty_from_fault(self, counts: tuple[int, ...]) -> int:
        """How many consecutive buckets of `counts`, from the fault's own, are empty."""
        quiet = 0
        for count in counts[self.fault_bucket() :]:
            if count:
                break
            quiet += 1
        return quiet


@dataclass(frozen=True)
class Violation:
    kind: str  # "lost", "duplicate" or "order"
    publisher: str
    seq: int
    client: str | None
    detail: str


@dataclass(frozen=True)
class Summary:
    """What one run found. Counts are of messages (publisher, seq) unless they say events."""

    messages: int  # distinct (publisher, seq) seen anywhere
    published: int  # with a publish event
    confirmed: int  # outcome confirmed or duplicate
    unconfirmed: int  # published, never confirmed (nacked + rejected + in_flight): not lost
    nacked: int
    rejected: int
    in_flight: int
    delivered: int  # delivered at least once
    deliveries: int  # deliver events
    redeliveries: int  # deliver events flagged redelivered (allowed; not violations)
    acked: int
    traced: int  # with an enqueue span
    lost: int
    duplicates: int
    order_violations: int
    malformed_lines: int  # history + span lines skipped as malformed
    malformed_history_lines: int
    malformed_span_lines: int
    malformed_files: dict[str, int]  # file -> malformed lines in it
    history_files: int
    span_files: int
    history_events: int
    spans: int
    start_ts: float | None  # earliest history event
    end_ts: float | None  # latest history event
    stages: tuple[StageLatency, ...]  # in report order; stages with no measurement are left out
    failover: tuple[FailoverWindow, ...]  # one per fault event, in time order
    longest_confirm_gap: Gap | None
    longest_delivery_gap: Gap | None
    violations: tuple[Violation, ...]  # up to VIOLATION_CAP per kind, by kind, publisher, seq
    out_dir: str
    report: str
    latency_chart: str
    throughput_chart: str
    summary_json: str
    tables: dict[str, str] = field(default_factory=dict)  # name -> Parquet directory
    failover_buckets: tuple[FaultBuckets, ...] = ()  # one per fault, as `failover`: 100 ms buckets around it

    @property
    def violation_count(self) -> int:
        """Lost + duplicates + order violations: what `--fail-on-violation` fails on."""
        return self.lost + self.duplicates + self.order_violations

    def stage(self, name: str) -> StageLatency | None:
        return next((s for s in self.stages if s.stage == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "violation_count": self.violation_count}

    def text(self) -> str:
        """A few lines: counts, violations, latency by stage, failover window, gaps, where the outputs are."""
        lines = [
            f"ringq lifecycle: {self.published} published, {self.confirmed} confirmed, "
            f"{self.delivered} delivered, {self.unconfirmed} unconfirmed (not lost)",
            f"lost: {self.lost}  duplicates: {self.duplicates}  order violations: {self.order_violations}  "
            f"redeliveries (flagged, allowed): {self.redeliveries}  malformed lines: {self.malformed_lines}",
        ]
        if self.stages:
            width = max(len(s.label) for s in self.stages)
            lines.append(f"latency (ms)  {'stage':<{width}} {'n':>7} {'p50':>10} {'p99':>10} {'max':>10}")
            lines += [
                f"              {s.label:<{width}} {s.count:>7} {s.p50_ms:>10.3f} {s.p99_ms:>10.3f} {s.max_ms:>10.3f}"
                for s in self.stages
            ]
        lines.append(f"failover: {failover_cell(self)}")
        for window, buckets in zip(self.failover, self.failover_buckets, strict=False):
            lines += buckets_text(window, buckets)
        lines += [
            f"longest gap: confirms {gap_text(self.longest_confirm_gap, self)}, "
            f"deliveries {gap_text(self.longest_delivery_gap, self)}",
            f"report: {self.report}",
            f"charts: {self.latency_chart} {self.throughput_chart}",
            f"summary: {self.summary_json}  tables: {' '.join(self.tables.values())}",
        ]
        return "\n".join(lines)


def iso_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def relative_time(ts: float, summary: Summary) -> str:
    return f"+{ts - summary.start_ts:.3f} s" if summary.start_ts is not None else iso_time(ts)


def failover_text(window: FailoverWindow, summary: Summary) -> str:
    what = " ".join(part for part in (window.what, window.node) if part) or "fault"
    confirm = (
        "no confirm after it"
        if window.confirm_after_s is None
        else f"first confirm after {window.confirm_after_s:.3f} s"
    )
    delivery = (
        "no delivery after it"
        if window.delivery_after_s is None
        else f"first delivery after {window.delivery_after_s:.3f} s"
    )
    return f"{what} at {relative_time(window.fault_ts, summary)}: {confirm}, {delivery}"


def failover_cell(summary: Summary) -> str:
    if not summary.failover:
        return "no fault event"
    return "; ".join(failover_text(w, summary) for w in summary.failover)


def gap_text(gap: Gap | None, summary: Summary) -> str:
    if gap is None:
        return "n/a (fewer than two)"
    return f"{gap.seconds:.3f} s ({relative_time(gap.start_ts, summary)} → {relative_time(gap.end_ts, summary)})"


# The columns `buckets_text` shows: from this many buckets before the fault to this many after the last
# empty one (confirms or deliveries), at most BUCKET_COLUMNS in all.
BUCKETS_BEFORE, BUCKETS_AFTER, BUCKET_COLUMNS = 3, 3, 16


def bucket_columns(buckets: FaultBuckets) -> range:
    """The indexes of the buckets worth showing in text: a few before the fault, the empty ones after it and
    a few more."""
    start = buckets.fault_bucket()
    quiet = max(buckets.empty_from_fault(buckets.confirms), buckets.empty_from_fault(buckets.deliveries))
    first = max(start - BUCKETS_BEFORE, 0)
    last = min(start + quiet + BUCKETS_AFTER, first + BUCKET_COLUMNS, len(buckets.confirms))
    return range(first, last)


def stall_lines(window: FailoverWindow, buckets: FaultBuckets) -> list[str]:
    """One sentence per kind (confirms, deliveries): the empty buckets from the fault's own, and when the first
    one after the fault came (ms), e.g. "confirms: none in the 4 buckets from the fault (+0 → +400 ms); the
    first 400 ms after it"."""
    size = buckets.bucket_ms
    lines = []
    for kind, counts, after in (
        ("confirms", buckets.confirms, window.confirm_after_s),
        ("deliveries", buckets.deliveries, window.delivery_after_s),
    ):
        quiet = buckets.empty_from_fault(counts)
        plural = "" if quiet == 1 else "s"
        empty = (
            f"none in the {quiet} bucket{plural} from the fault (+0 → +{quiet * size} ms)"
            if quiet
            else f"some in the fault's own bucket (+0 → +{size} ms)"
        )
        first = "none after it" if after is None else f"the first {after * 1000:,.0f} ms after it"
        lines.append(f"{kind}: {empty}; {first}")
    return lines


def buckets_text(window: FailoverWindow, buckets: FaultBuckets) -> list[str]:
    """The failover at bucket resolution: a small table of confirms and deliveries per bucket around the fault
    (bucket starts in ms from it), the empty buckets, and the measured window in ms."""
    what = " ".join(part for part in (window.what, window.node) if part) or "fault"
    shown = bucket_columns(buckets)
    offsets = buckets.offsets_ms()
    head = [f"{offsets[i]:+d}" if offsets[i] else "0" for i in shown]
    width = max([6, *(len(h) + 1 for h in head), *(len(str(c)) + 1 for c in buckets.confirms + buckets.deliveries)])

    def row(label: str, cells: list[str]) -> str:
        return f"  {label:<12}" + "".join(f"{cell:>{width}}" for cell in cells)

    return [
        f"failover in {buckets.bucket_ms} ms buckets ({what}; bucket start, ms from the fault):",
        row("", head),
        row("confirms", [str(buckets.confirms[i]) for i in shown]),
        row("deliveries", [str(buckets.deliveries[i]) for i in shown]),
        *(f"  {line}" for line in stall_lines(window, buckets)),
    ]
