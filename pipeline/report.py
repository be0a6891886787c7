"""The report files: report.md, latency.png and throughput.png.

Responsible for: rendering a Summary (and the per-second throughput collected from the small
`throughput` table) as Markdown and two PNG charts. throughput.png has the whole run per second and,
under it, one panel per fault (up to ZOOMED_FAULTS) in the Summary's 100 ms buckets from 2 s before the
fault to 3 s after it, the failover window (fault → first positive confirm) shaded and its length in ms
written on it (`failover_zoom` is what such a panel draws).

Guarantees: works from plain Python values only (no Spark); always writes all three files, even
when there is nothing to plot (the chart then says so); the Markdown starts with the summary table
(published, confirmed, delivered, lost, duplicates, order violations, redeliveries, failover window),
then latency by stage, throughput and the violation lists, each list capped and saying so. Charts
use matplotlib's Agg canvas directly (no pyplot, no display, no global state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pipeline.summary import (
    FailoverWindow,
    FaultBuckets,
    Summary,
    Violation,
    bucket_columns,
    failover_cell,
    gap_text,
    iso_time,
    stall_lines,
)

THROUGHPUT_ROWS_SHOWN = 120
ZOOMED_FAULTS = 3  # faults with a 100 ms panel of their own in throughput.png


@dataclass(frozen=True)
class Second:
    """One row of the throughput table."""

    second: int
    publishes: int
    confirms: int
    deliveries: int
    acks: int
    faults: int


@dataclass(frozen=True)
class FailoverZoom:
    """What a zoomed panel draws around one fault: counts per bucket, and the failover window.

    Times are ms from the fault. The window is shaded from the fault (0) to the first positive confirm after it;
    when none came it runs to the end of the panel and `gap_ms` is None. `note` is the text on the chart."""

    title: str
    bucket_ms: int
    edges_ms: tuple[int, ...]  # bucket edges: one more than there are buckets
    publishes: tuple[int, ...]
    confirms: tuple[int, ...]
    deliveries: tuple[int, ...]
    window_ms: tuple[float, float]
    gap_ms: float | None  # fault → first confirm
    delivery_ms: float | None  # fault → first delivery
    empty_confirm_buckets: int  # consecutive buckets without a confirm, from the fault's own
    note: str


def _what(window: FailoverWindow) -> str:
    return " ".join(part for part in (window.what, window.node) if part) or "fault"


def failover_zoom(window: FailoverWindow, buckets: FaultBuckets) -> FailoverZoom:
    """The data of one fault's zoomed panel, from its failover window and its buckets."""
    offsets = buckets.offsets_ms()
    edges = (*offsets, offsets[-1] + buckets.bucket_ms) if offsets else (0,)
    gap = None if window.confirm_after_s is None else round(window.confirm_after_s * 1000, 3)
    delivery = None if window.delivery_after_s is None else round(window.delivery_after_s * 1000, 3)
    empty = buckets.empty_from_fault(buckets.confirms)
    what = _what(window)
    note = f"no confirm after {what}" if gap is None else f"failover {gap:,.0f} ms\n{what} → first confirm"
    note += f"\n{empty} empty {buckets.bucket_ms} ms bucket{'' if empty == 1 else 's'} of confirms"
    return FailoverZoom(
        title=f"around {what} ({buckets.bucket_ms} ms buckets)",
        bucket_ms=buckets.bucket_ms,
        edges_ms=edges,
        publishes=buckets.publishes,
        confirms=buckets.confirms,
        deliveries=buckets.deliveries,
        window_ms=(0.0, float(edges[-1]) if gap is None else gap),
        gap_ms=gap,
        delivery_ms=delivery,
        empty_confirm_buckets=empty,
        note=note,
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    def cell(value: object) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def _summary_rows(summary: Summary) -> list[tuple[str, object]]:
    return [
        ("published", summary.published),
        ("confirmed", summary.confirmed),
        (
            "unconfirmed (not lost): nacked / rejected / in flight",
            f"{summary.unconfirmed}: {summary.nacked} / {summary.rejected} / {summary.in_flight}",
        ),
        ("delivered", f"{summary.delivered} ({summary.deliveries} deliveries, {summary.acked} acked)"),
        ("**lost**", f"**{summary.lost}**"),
        ("**duplicates**", f"**{summary.duplicates}**"),
        ("**order violations**", f"**{summary.order_violations}**"),
        ("redeliveries (flagged; allowed)", summary.redeliveries),
        ("failover window", failover_cell(summary)),
        ("longest gap between confirms", gap_text(summary.longest_confirm_gap, summary)),
        ("longest gap between deliveries", gap_text(summary.longest_delivery_gap, summary)),
        ("traced messages (with an enqueue span)", summary.traced),
        ("malformed lines skipped", summary.malformed_lines),
    ]


def _violation_section(title: str, kind: str, total: int, violations: Sequence[Violation]) -> list[str]:
    shown = [v for v in violations if v.kind == kind]
    lines = [f"### {title} ({total})", ""]
    if not total:
        return [*lines, "None.", ""]
    lines += _table(
        ["publisher", "seq", "client", "detail"], [(v.publisher, v.seq, v.client or "", v.detail) for v in shown]
    )
    if len(shown) < total:
        lines += ["", f"Showing {len(shown)} of {total}; all of them are in `violations/`."]
    return [*lines, ""]


def _buckets_section(window: FailoverWindow, buckets: FaultBuckets) -> list[str]:
    shown = bucket_columns(buckets)
    offsets = buckets.offsets_ms()
    lines = [f"### Around {_what(window)} ({buckets.bucket_ms} ms buckets)", ""]
    lines += [f"- {line}." for line in stall_lines(window, buckets)]
    lines.append("")
    lines += _table(
        ["ms from the fault", "publishes", "confirms", "deliveries", "acks"],
        [
            (
                f"{offsets[i]:+d}",
                buckets.publishes[i],
                buckets.confirms[i],
                buckets.deliveries[i],
                buckets.acks[i],
            )
            for i in shown
        ],
    )
    return [*lines, "", "Every bucket of the window is in `failover_buckets/`.", ""]


def markdown(summary: Summary, seconds: Sequence[Second]) -> str:
    lines = ["# ringq message lifecycle", ""]
    span = ""
    if summary.start_ts is not None and summary.end_ts is not None:
        length = summary.end_ts - summary.start_ts
        span = f" from {iso_time(summary.start_ts)} to {iso_time(summary.end_ts)} ({length:.3f} s)"
    lines += [
        f"{summary.history_events} history events from {summary.history_files} file(s){span}; "
        f"{summary.spans} spans from {summary.span_files} file(s); "
        f"{summary.malformed_lines} malformed line(s) skipped.",
        "Times marked +s are seconds since the first history event.",
        "",
        "## Summary",
        "",
        *_table(["measure", "value"], _summary_rows(summary)),
        "",
        "## Latency by stage (ms)",
        "",
    ]
    if summary.stages:
        lines += _table(
            ["stage", "source", "n", "p50", "p99", "max"],
            [
                (s.label, s.source, s.count, f"{s.p50_ms:.3f}", f"{s.p99_ms:.3f}", f"{s.max_ms:.3f}")
                for s in summary.stages
            ],
        )
        lines += [
            "",
            "p50 and p99 are nearest-rank percentiles. History stages use client clocks, span stages span start times.",
            "",
        ]
    else:
        lines += ["Nothing measured.", ""]
    lines += [f"![latency by stage]({Path(summary.latency_chart).name})", "", "## Throughput (per second)", ""]
    if seconds:
        peak = max(seconds, key=lambda s: s.confirms)
        lines += [
            f"Totals: {sum(s.publishes for s in seconds)} publishes, {sum(s.confirms for s in seconds)} confirms, "
            f"{sum(s.deliveries for s in seconds)} deliveries, {sum(s.acks for s in seconds)} acks "
            f"over {len(seconds)} s; peak {peak.confirms} confirms/s.",
            "",
        ]
        first = seconds[0].second
        lines += _table(
            ["second", "publishes", "confirms", "deliveries", "acks", "fault"],
            [
                (f"+{s.second - first}", s.publishes, s.confirms, s.deliveries, s.acks, "**fault**" if s.faults else "")
                for s in seconds[:THROUGHPUT_ROWS_SHOWN]
            ],
        )
        if len(seconds) > THROUGHPUT_ROWS_SHOWN:
            lines += [
                "",
                f"Showing the first {THROUGHPUT_ROWS_SHOWN} of {len(seconds)} seconds; all are in `throughput/`.",
            ]
        lines.append("")
    else:
        lines += ["No events.", ""]
    for window, buckets in zip(summary.failover, summary.failover_buckets, strict=False):
        lines += _buckets_section(window, buckets)
    lines += [f"![throughput]({Path(summary.throughput_chart).name})", "", "## Violations", ""]
    lines += _violation_section("Lost", "lost", summary.lost, summary.violations)
    lines += _violation_section("Duplicates", "duplicate", summary.duplicates, summary.violations)
    lines += _violation_section("Order violations", "order", summary.order_violations, summary.violations)
    if summary.malformed_files:
        lines += ["## Malformed lines", ""]
        lines += _table(["file", "lines skipped"], sorted(summary.malformed_files.items()))
        lines.append("")
    lines += ["## Tables (Parquet)", ""]
    lines += [f"- `{name}/`: {path}" for name, path in summary.tables.items()]
    return "\n".join(lines) + "\n"


def _save(figure: Figure, path: Path) -> None:
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)


def latency_chart(summary: Summary, path: Path) -> None:
    """Horizontal bars: p50 and p99 per stage (log scale), max as a tick."""
    figure = Figure(figsize=(9, 1.2 + 0.6 * max(len(summary.stages), 2)))
    axes = figure.subplots()
    stages = list(reversed(summary.stages))
    if not stages:
        axes.text(0.5, 0.5, "no latency measured", ha="center", va="center")
        axes.set_axis_off()
    else:
        rows = range(len(stages))
        height = 0.38
        floor = 1e-3  # log scale: show zero or negative latencies (clock skew) at 1 µs
        axes.barh([r + height / 2 for r in rows], [max(s.p50_ms, floor) for s in stages], height, label="p50")
        axes.barh([r - height / 2 for r in rows], [max(s.p99_ms, floor) for s in stages], height, label="p99")
        axes.scatter([max(s.max_ms, floor) for s in stages], list(rows), marker="|", s=200, color="black", label="max")
        axes.set_yticks(list(rows), [f"{s.label} (n={s.count})" for s in stages])
        axes.set_xscale("log")
        axes.set_xlim(left=min(max(s.p50_ms, floor) for s in stages) / 2)
        axes.set_xlabel("milliseconds")
        axes.legend(loc="lower right")
    axes.set_title("ringq latency by stage")
    _save(figure, path)


def _per_second_panel(axes: Axes, summary: Summary, seconds: Sequence[Second]) -> None:
    """The whole run, per second, each fault marked and its failover window shaded."""
    first = seconds[0].second
    edges = [s.second - first for s in seconds] + [seconds[-1].second - first + 1]
    axes.stairs([s.publishes for s in seconds], edges, label="publishes/s", color="C0", baseline=None)
    axes.stairs([s.confirms for s in seconds], edges, label="confirms/s", color="C1", baseline=None)
    axes.stairs([s.deliveries for s in seconds], edges, label="deliveries/s", color="C2", baseline=None)
    for i, window in enumerate(summary.failover):
        axes.axvline(
            window.fault_ts - first, color="red", linestyle="--", label=f"fault: {_what(window)}" if i < 3 else None
        )
        if window.first_confirm_ts is not None:
            axes.axvspan(window.fault_ts - first, window.first_confirm_ts - first, color="red", alpha=0.15)
    axes.set_xlabel(f"seconds since {iso_time(float(first))}")
    axes.set_ylabel("events per second")
    axes.set_ylim(bottom=0)
    axes.legend(loc="upper right")
    axes.set_title("ringq throughput (1 s buckets)")


def _zoom_panel(axes: Axes, zoom: FailoverZoom) -> None:
    """One fault up close: counts per bucket, the fault, the failover window shaded, its length written."""
    edges = list(zoom.edges_ms)
    axes.set_title(f"ringq throughput {zoom.title}")
    if not zoom.confirms:
        axes.text(0.5, 0.5, "no buckets", ha="center", va="center")
        axes.set_axis_off()
        return
    axes.stairs(zoom.publishes, edges, label="publishes", color="C0", baseline=None)
    axes.stairs(zoom.confirms, edges, label="confirms", color="C1", linewidth=2, baseline=None)
    axes.stairs(zoom.deliveries, edges, label="deliveries", color="C2", baseline=None)
    left, right = edges[0], edges[-1]
    start, end = zoom.window_ms[0], min(zoom.window_ms[1], right)
    axes.axvspan(start, end, color="red", alpha=0.15, label="failover window (fault → first confirm)")
    axes.axvline(0, color="red", linestyle="--", label="fault")
    if zoom.delivery_ms is not None and zoom.delivery_ms <= right:
        axes.axvline(
            zoom.delivery_ms, color="C2", linestyle=":", label=f"first delivery after it (+{zoom.delivery_ms:,.0f} ms)"
        )
    pad = zoom.bucket_ms / 2
    inside = end + pad > right - 0.35 * (right - left)  # no room to the right of the window: write inside it
    axes.text(
        end - pad if inside else end + pad,
        0.95,
        zoom.note,
        transform=axes.get_xaxis_transform(),
        ha="right" if inside else "left",
        va="top",
        bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "red"},
    )
    axes.set_xlim(left, right)
    axes.set_xticks(range(left, right + 1, 5 * zoom.bucket_ms))
    axes.set_xticks(edges, minor=True)
    axes.grid(axis="x", which="both", alpha=0.25)
    top = max([*zoom.publishes, *zoom.confirms, *zoom.deliveries, 1])
    axes.set_ylim(0, top * 1.7)  # room above the lines for the legend and the note
    axes.set_xlabel(f"ms from the fault ({zoom.bucket_ms} ms buckets, aligned on it)")
    axes.set_ylabel(f"events per {zoom.bucket_ms} ms")
    axes.legend(loc="upper left", fontsize="small")


def throughput_chart(summary: Summary, seconds: Sequence[Second], path: Path) -> None:
    """Per-second publishes, confirms and deliveries, each fault marked, then one 100 ms panel per fault (up
    to ZOOMED_FAULTS) with the failover window shaded and its length written on it."""
    zooms = [
        failover_zoom(window, buckets)
        for window, buckets in zip(summary.failover, summary.failover_buckets, strict=False)
    ][:ZOOMED_FAULTS]
    rows = 1 + len(zooms)
    figure = Figure(figsize=(10, 4.5 * rows))
    axes = figure.add_subplot(rows, 1, 1)
    if not seconds:
        axes.text(0.5, 0.5, "no events", ha="center", va="center")
        axes.set_axis_off()
        axes.set_title("ringq throughput")
    else:
        _per_second_panel(axes, summary, seconds)
    for i, zoom in enumerate(zooms):
        _zoom_panel(figure.add_subplot(rows, 1, i + 2), zoom)
    _save(figure, path)


def write(summary: Summary, seconds: Sequence[Second]) -> None:
    """Write report.md and both charts where `summary` says they are."""
    latency_chart(summary, Path(summary.latency_chart))
    throughput_chart(summary, seconds, Path(summary.throughput_chart))
    Path(summary.report).write_text(markdown(summary, seconds), encoding="utf-8")
