"""The report files: report.md, latency.png and throughput.png.

Responsible for: rendering a Summary (and the per-second throughput collected from the small
`throughput` table) as Markdown and two PNG charts.

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

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pipeline.summary import Summary, Violation, failover_cell, gap_text, iso_time

THROUGHPUT_ROWS_SHOWN = 120


@dataclass(frozen=True)
class Second:
    """One row of the throughput table."""

    second: int
    publishes: int
    confirms: int
    deliveries: int
    acks: int
    faults: int


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


def throughput_chart(summary: Summary, seconds: Sequence[Second], path: Path) -> None:
    """Per-second publishes, confirms and deliveries, with each fault marked."""
    figure = Figure(figsize=(10, 4.5))
    axes = figure.subplots()
    if not seconds:
        axes.text(0.5, 0.5, "no events", ha="center", va="center")
        axes.set_axis_off()
    else:
        first = seconds[0].second
        xs = [s.second - first for s in seconds]
        axes.plot(xs, [s.publishes for s in seconds], label="publishes/s", drawstyle="steps-post")
        axes.plot(xs, [s.confirms for s in seconds], label="confirms/s", drawstyle="steps-post")
        axes.plot(xs, [s.deliveries for s in seconds], label="deliveries/s", drawstyle="steps-post")
        for i, window in enumerate(summary.failover):
            label = " ".join(p for p in (window.what, window.node) if p) or "fault"
            axes.axvline(
                window.fault_ts - first, color="red", linestyle="--", label=f"fault: {label}" if i < 3 else None
            )
        axes.set_xlabel(f"seconds since {iso_time(float(first))}")
        axes.set_ylabel("events per second")
        axes.set_ylim(bottom=0)
        axes.legend(loc="upper right")
    axes.set_title("ringq throughput")
    _save(figure, path)


def write(summary: Summary, seconds: Sequence[Second]) -> None:
    """Write report.md and both charts where `summary` says they are."""
    latency_chart(summary, Path(summary.latency_chart))
    throughput_chart(summary, seconds, Path(summary.throughput_chart))
    Path(summary.report).write_text(markdown(summary, seconds), encoding="utf-8")
