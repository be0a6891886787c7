"""`make bench`: ringq mirrored queues against RabbitMQ classic mirrored queues and NATS JetStream R3, in one run.

Runs the workloads of ARCHITECTURE section 10 with one method for every system (bench/reference/
rabbitmq_workloads.py; the clients configured as their users would for throughput, bench/ack_batching.py):
- ringq: a 3-node cluster with default settings (bench/ringq_workloads.py), each node bound to one CPU as
  docs/configuration.md recommends: W1, W2 (batched acks), W2 with one ack per message, W2 at a fixed rate;
  then, the nodes unbound (their default placement), W2 at the fixed rate again and W3 (a SIGKILL of the
  master);
- RabbitMQ: a 3-node cluster of classic mirrored queues (bench/reference): the same five;
- NATS JetStream: a 3-server cluster, streams with 3 replicas, memory storage and then file storage, each
  its own system (bench/nats_workloads.py): W1, W2 and W2 at the fixed rate.
Each run of a system starts its cluster afresh, runs its workloads and stops it; the systems take turns
(run 1 of ringq, RabbitMQ, NATS memory, NATS file, then run 2 of each, ...), `--runs` times (3), and each
figure is reported as the median with the min and max over the runs, the brokers' CPU with it. Prints the
table and the goals of issue 13; with `--write`, puts the section "Mirrored queues vs RabbitMQ and NATS
JetStream (`make bench`)" into a Markdown file (the file's other sections are kept). A system whose server
is not installed is left out and its column says why. Every process any side starts listens on 127.0.0.1
only and is stopped at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import nats_cluster, nats_workloads
from bench.ack_batching import BATCHED, EACH
from bench.bench_gm import machine
from bench.markdown import command_line
from bench.reference import rabbitmq_cluster
from bench.reference.rabbitmq_workloads import (
    FIXED_RATE,
    WORKLOADS,
    Durations,
    WorkloadResult,
    run_reference,
    workload_name,
)
from bench.ringq_workloads import RINGQ_WORKLOADS, run_ringq
from bench.stream_metrics import Spread, spread

SECTION_TITLE = "## Mirrored queues vs RabbitMQ and NATS JetStream (`make bench`)"
OLD_TITLES = ("## Mirrored queues vs RabbitMQ (`make bench`)",)  # replaced by this section too
SYSTEMS = ("ringq", "rabbitmq", "nats-memory", "nats-file")
LABELS = {
    "ringq": "ringq",
    "rabbitmq": "RabbitMQ mirrored",
    "nats-memory": "NATS R3 memory",
    "nats-file": "NATS R3 file",
}
ALL_WORKLOADS = RINGQ_WORKLOADS  # ringq runs every workload, the others a subset of them
SYSTEM_WORKLOADS = {
    "ringq": RINGQ_WORKLOADS,
    "rabbitmq": WORKLOADS,
    "nats-memory": nats_workloads.WORKLOADS,
    "nats-file": nats_workloads.WORKLOADS,
}
SETUP_TARGETS = {"rabbitmq": "make setup-rabbitmq", "nats-memory": "make setup-nats", "nats-file": "make setup-nats"}
# The goals of issue 13.
W1_MIN_VS_NATS = 1.0
W1_MIN_VS_RABBITMQ = 5.0
W2_MIN_VS_RABBITMQ = 3.0
W2_RATE_MAX_P50_MS = 1.5
W2_RATE_MAX_P99_MS = 3.0
CPU_MAX_VS_NATS = 1.0


# --- one run of one system ---------------------------------------------------------------------------


@dataclass
class SystemRun:
    """One run of one system: its cluster started, its workloads run, its cluster stopped."""

    system: str
    run: int
    version: str = ""
    setup: str = ""
    results: dict[str, WorkloadResult] = field(default_factory=dict)  # by workload key ("w1", ...)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def unavailable_reason(system: str) -> str | None:
    """Why `system` cannot run here (its server is not installed), or None."""
    if system == "rabbitmq":
        problem = rabbitmq_cluster.unavailable_reason()
    elif system.startswith("nats-"):
        problem = nats_cluster.unavailable_reason()
    else:
        return None
    return None if problem is None else f"{problem}: run {SETUP_TARGETS[system]}"


def _keyed(results: Sequence[WorkloadResult], keys: Sequence[str], rate: float) -> dict[str, WorkloadResult]:
    names = {workload_name(key, rate): key for key in keys}
    return {names[r.name]: r for r in results}


def run_system(
    system: str,
    run: int,
    durations: Durations,
    only: Sequence[str],
    rate: float,
    progress: Callable[[str], None],
    stop_requested: Callable[[], bool],
) -> SystemRun:
    """Start `system`'s cluster, run the workloads of `only` it has, stop the cluster."""
    chosen = [key for key in SYSTEM_WORKLOADS[system] if key in only]
    if system == "ringq":
        ringq = run_ringq(durations=durations, only=chosen, rate=rate, progress=progress, stop_requested=stop_requested)
        version, setup, results = f"ringq {ringq.version} ({ringq.commit})", ringq.setup, ringq.results
    elif system == "rabbitmq":
        reference = run_reference(durations=durations, only=chosen, rate=rate, progress=progress)
        version, setup, results = reference.version, reference.setup, reference.results
    else:
        storage = system.removeprefix("nats-")
        nats = nats_workloads.run_nats(
            storage, durations=durations, only=chosen, rate=rate, progress=progress, stop_requested=stop_requested
        )
        version, setup, results = f"NATS server {nats.version}", nats.setup, nats.results
    return SystemRun(system, run, version, setup, _keyed(results, chosen, rate))


# --- figures over the runs (pure) --------------------------------------------------------------------


Runs = Sequence[SystemRun]


def figure(runs: Runs, system: str, key: str, attribute: str) -> Spread:
    """The median, min and max of one figure of one workload over `system`'s runs that measured it."""
    values = []
    for r in runs:
        result = r.results.get(key) if r.system == system else None
        if result is not None:
            values.append(getattr(result, attribute))
    return spread(values)


@dataclass(frozen=True)
class Row:
    label: str
    key: str
    attribute: str
    fmt: str


def table_rows(rate: float) -> list[Row]:
    fixed = f"W2 at {rate:,.0f} msgs/s"
    return [
        Row("W1 confirmed msgs/s", "w1", "rate", ",.0f"),
        Row("W1 brokers CPU, cores", "w1", "broker_cores", ".2f"),
        Row("W2 delivered msgs/s (batched acks)", "w2", "rate", ",.0f"),
        Row("W2 latency p50 ms", "w2", "p50_ms", ",.1f"),
        Row("W2 latency p99 ms", "w2", "p99_ms", ",.1f"),
        Row("W2 brokers CPU, cores", "w2", "broker_cores", ".2f"),
        Row("W2 one ack per message: delivered msgs/s", "w2each", "rate", ",.0f"),
        Row("W2 one ack per message: p50 ms", "w2each", "p50_ms", ",.1f"),
        Row("W2 one ack per message: p99 ms", "w2each", "p99_ms", ",.1f"),
        Row("W2 one ack per message: brokers CPU, cores", "w2each", "broker_cores", ".2f"),
        Row(f"{fixed}: delivered msgs/s", "w2rate", "rate", ",.0f"),
        Row(f"{fixed}: p50 ms", "w2rate", "p50_ms", ",.2f"),
        Row(f"{fixed}: p99 ms", "w2rate", "p99_ms", ",.2f"),
        Row(f"{fixed}: p50 ms from the scheduled send time", "w2rate", "p50_from_schedule_ms", ",.2f"),
        Row(f"{fixed}: p99 ms from the scheduled send time", "w2rate", "p99_from_schedule_ms", ",.2f"),
        Row(f"{fixed}: brokers CPU, cores", "w2rate", "broker_cores", ".2f"),
        Row(f"{fixed}, nodes unbound: p50 ms", "w2rate_unbound", "p50_ms", ",.2f"),
        Row(f"{fixed}, nodes unbound: p99 ms", "w2rate_unbound", "p99_ms", ",.2f"),
        Row(f"{fixed}, nodes unbound: brokers CPU, cores", "w2rate_unbound", "broker_cores", ".2f"),
        Row("W3 (SIGKILL of the master) gap s", "w3", "gap_s", ",.2f"),
        Row("W3 lost", "w3", "lost", ",.0f"),
        Row("W3 duplicates", "w3", "duplicates", ",.0f"),
        Row("W3 surviving brokers' CPU after the kill, cores", "w3", "broker_cores", ".2f"),
    ]


def cell(runs: Runs, system: str, row: Row, missing: dict[str, str]) -> str:
    if system in missing:
        return missing[system]
    if row.key not in SYSTEM_WORKLOADS[system]:
        return "n/a"
    return figure(runs, system, row.key, row.attribute).text(row.fmt)


def figures_table(
    runs: Runs, systems: Sequence[str], workloads: Sequence[str], rate: float, missing: dict[str, str]
) -> tuple[list[str], list[list[str]], list[bool]]:
    """The per-system table: a row per figure of `workloads`, a column per system (median (min-max) over the
    runs); a system in `missing` has why in each of its cells."""
    header = ["figure", *(LABELS[s] for s in systems)]
    rows = []
    for row in table_rows(rate):
        if row.key in workloads:
            rows.append([row.label, *(cell(runs, s, row, missing) for s in systems)])
    return header, rows, [False, *(True for _ in systems)]


def cpu_per_run_table(runs: Runs, systems: Sequence[str], rate: float) -> tuple[list[str], list[list[str]], list[bool]]:
    """The brokers' CPU (cores) of every run, in run order, a row per workload and a column per system."""
    header = ["workload", *(LABELS[s] for s in systems)]
    rows = []
    for key in ALL_WORKLOADS:
        cells = []
        for system in systems:
            values = [r.results[key].broker_cores for r in runs if r.system == system and key in r.results]
            cells.append(" / ".join("-" if v is None else f"{v:.2f}" for v in values) or "-")
        if any(c != "-" for c in cells):
            rows.append([workload_name(key, rate), *cells])
    return header, rows, [False, *(True for _ in systems)]


# --- the goals (pure) --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    name: str
    target: str
    measured: str
    met: bool | None  # None: not measured in this run
    shortfall: str = ""  # when missed: by how much (the measured ratio)

    @property
    def verdict(self) -> str:
        if self.met is None:
            return "not measured"
        return "met" if self.met else f"missed: {self.shortfall}"


def _ratio(ours: Spread, theirs: Spread) -> float | None:
    if ours.median is None or not theirs.median:
        return None
    return ours.median / theirs.median


def _at_least(name: str, runs: Runs, key: str, other: str, minimum: float, unit: str) -> Goal:
    """ringq's median rate of `key` against `other`'s: at least `minimum` times it."""
    target = f">= {minimum:g}x {LABELS[other]}"
    ours, theirs = figure(runs, "ringq", key, "rate"), figure(runs, other, key, "rate")
    ratio = _ratio(ours, theirs)
    if ratio is None:
        return Goal(name, target, "not measured", None)
    measured = f"{ratio:.2f}x ({ours.text(',.0f')} vs {theirs.text(',.0f')} {unit})"
    return Goal(name, target, measured, ratio >= minimum, f"{ratio:.2f}x")


def goals(runs: Runs, rate: float) -> list[Goal]:
    """Issue 13's goals, each met, missed (with by how much) or not measured, from the medians of the runs."""
    out = [
        _at_least("W1 throughput vs NATS", runs, "w1", "nats-memory", W1_MIN_VS_NATS, "msgs/s"),
        _at_least("W1 throughput vs RabbitMQ", runs, "w1", "rabbitmq", W1_MIN_VS_RABBITMQ, "msgs/s"),
    ]

    w2 = _at_least("W2 throughput and p99 vs RabbitMQ", runs, "w2", "rabbitmq", W2_MIN_VS_RABBITMQ, "msgs/s")
    p99, p99_ref = figure(runs, "ringq", "w2", "p99_ms"), figure(runs, "rabbitmq", "w2", "p99_ms")
    p99_ratio = _ratio(p99, p99_ref)
    target = f"{w2.target}, p99 no worse (batched acks)"
    if w2.met is None or p99_ratio is None:
        out.append(Goal(w2.name, target, "not measured", None))
    else:
        measured = f"{w2.measured}; p99 {p99.text(',.1f')} vs {p99_ref.text(',.1f')} ms ({p99_ratio:.2f}x)"
        shortfalls = [f"{w2.shortfall} the rate"] if not w2.met else []
        if p99_ratio > 1:
            shortfalls.append(f"p99 {p99_ratio:.2f}x RabbitMQ's")
        out.append(Goal(w2.name, target, measured, not shortfalls, ", ".join(shortfalls)))

    name = f"W2 at {rate:,.0f} msgs/s latency"
    target = f"p50 < {W2_RATE_MAX_P50_MS:g} ms, p99 < {W2_RATE_MAX_P99_MS:g} ms"
    p50, p99 = figure(runs, "ringq", "w2rate", "p50_ms"), figure(runs, "ringq", "w2rate", "p99_ms")
    if p50.median is None or p99.median is None:
        out.append(Goal(name, target, "not measured", None))
    else:
        shortfalls = []
        if p50.median >= W2_RATE_MAX_P50_MS:
            shortfalls.append(f"p50 {p50.median / W2_RATE_MAX_P50_MS:.2f}x the limit")
        if p99.median >= W2_RATE_MAX_P99_MS:
            shortfalls.append(f"p99 {p99.median / W2_RATE_MAX_P99_MS:.2f}x the limit")
        measured = f"p50 {p50.text(',.2f')} ms, p99 {p99.text(',.2f')} ms from the send"
        p50_due, p99_due = (figure(runs, "ringq", "w2rate", f"p{q}_from_schedule_ms") for q in (50, 99))
        if p50_due.median is not None and p99_due.median is not None:
            measured += f" (from the scheduled send time: p50 {p50_due.text(',.2f')} ms, p99 {p99_due.text(',.2f')} ms)"
        out.append(Goal(name, target, measured, not shortfalls, ", ".join(shortfalls)))

    name = f"Brokers' CPU at {rate:,.0f} msgs/s"
    target = f"<= {CPU_MAX_VS_NATS:g}x {LABELS['nats-memory']}'s"
    ours, theirs = (
        figure(runs, "ringq", "w2rate", "broker_cores"),
        figure(runs, "nats-memory", "w2rate", "broker_cores"),
    )
    ratio = _ratio(ours, theirs)
    if ratio is None:
        out.append(Goal(name, target, "not measured", None))
    else:
        measured = f"{ratio:.2f}x ({ours.text('.2f')} vs {theirs.text('.2f')} cores)"
        unbound = figure(runs, "ringq", "w2rate_unbound", "broker_cores")
        unbound_ratio = _ratio(unbound, theirs)
        if unbound_ratio is not None:  # the goal is taken as deployed; the default placement is shown beside it
            measured += f"; with the nodes unbound {unbound_ratio:.2f}x ({unbound.text('.2f')} cores)"
        out.append(Goal(name, target, measured, ratio <= CPU_MAX_VS_NATS, f"{ratio:.2f}x"))

    name = "W3 master SIGKILL"
    target = "gap <= RabbitMQ's, 0 lost, 0 duplicates (every run)"
    gap, gap_ref = figure(runs, "ringq", "w3", "gap_s"), figure(runs, "rabbitmq", "w3", "gap_s")
    lost, duplicates = figure(runs, "ringq", "w3", "lost"), figure(runs, "ringq", "w3", "duplicates")
    ratio = _ratio(gap, gap_ref)
    if ratio is None or lost.high is None or duplicates.high is None:
        out.append(Goal(name, target, "not measured", None))
    else:
        measured = (
            f"gap {gap.text(',.2f')} vs {gap_ref.text(',.2f')} s ({ratio:.2f}x); lost {lost.high:.0f}, "
            f"duplicates {duplicates.high:.0f} at most"
        )
        shortfalls = []
        if ratio > 1:
            shortfalls.append(f"gap {ratio:.2f}x RabbitMQ's")
        if lost.high:
            shortfalls.append(f"{lost.high:.0f} lost")
        if duplicates.high:
            shortfalls.append(f"{duplicates.high:.0f} duplicates")
        out.append(Goal(name, target, measured, not shortfalls, ", ".join(shortfalls)))
    return out


# --- printing ----------------------------------------------------------------------------------------


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


GOALS_HEADER = ("goal (issue 13)", "target", "measured (medians over the runs)", "verdict")
GOALS_RIGHT = (False, False, False, False)


def _goal_cells(goal: Goal) -> tuple[str, str, str, str]:
    return goal.name, goal.target, goal.measured, goal.verdict


@dataclass
class Run:
    """Everything `make bench` measured, and how."""

    command: str
    began: str
    seconds: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    runs_per_system: int
    durations: Durations
    rate: float
    systems: list[str]
    workloads: list[str]
    missing: dict[str, str]  # system -> why it did not run
    runs: list[SystemRun]

    def first(self, system: str) -> SystemRun | None:
        """The first run of `system` that worked (for its version and setup)."""
        return next((r for r in self.runs if r.system == system and r.error is None), None)

    def columns(self) -> list[str]:
        return [s for s in SYSTEMS if s in self.systems]

    def failures(self) -> list[SystemRun]:
        return [r for r in self.runs if r.error is not None]

    def unmeasured(self) -> dict[str, str]:
        """The systems without a figure, and why: not installed, or every run failed."""
        failed = {s: "every run failed (see the notes)" for s in self.columns() if self.first(s) is None}
        return {**failed, **self.missing}


def _load(load: tuple[float, float, float]) -> str:
    return f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def versions(run: Run) -> str:
    clients = f"clients: the ringq SDK, pika {metadata.version('pika')}, nats-py {metadata.version('nats-py')}"
    seen: list[str] = []
    for system in run.columns():
        first = run.first(system)
        if first is not None and first.version not in seen:
            seen.append(first.version)
    return "; ".join([*seen, clients])


def method_text(run: Run) -> str:
    d = run.durations
    return (
        f"Every system measured in this run with one method (bench/reference/rabbitmq_workloads.py, shared by "
        f"bench/ringq_workloads.py and bench/nats_workloads.py), each configured as its users would for "
        f"throughput: producer and consumer in separate processes on the master's (leader's) node, 256-byte "
        f"transient bodies carrying a sequence number and a send timestamp, 3 replicas, confirms (NATS: "
        f"JetStream publish acks) with at most 1000 outstanding, prefetch 1000 (NATS: a pull consumer with 1000 "
        f"requested and max_ack_pending 1000); ringq's and RabbitMQ's consumers acknowledge through one shared "
        f"policy (bench/ack_batching.py): batched ({BATCHED.describe()}) in W2 and W2 at the fixed rate, "
        f'{EACH.describe()} in "W2 one ack per message" and W3 (so that a W3 duplicate is the broker\'s); a NATS '
        f"consumer with explicit acks acknowledges each message. Only confirms and deliveries inside the measured "
        f"window count ({d.warmup_s:g} s warm-up, {d.measure_s:g} s measured). Latency runs from each message's "
        f"send stamp, taken as the producer hands it to its client library, to its arrival in the consumer's "
        f"callback (every system's clock is CLOCK_MONOTONIC on this machine); at the fixed rate the producer "
        f"sends what fell due every 1 ms tick, and the rows 'from the scheduled send time' add that pacing "
        f"(each message's time zero + sequence number / rate), so a stalled producer shows there. Brokers' CPU: "
        f"all of the system's server processes together (ringq: 3 nodes and the coordinator), cores used over the "
        f"measured window. W3 is W2 at the fixed rate with the master's node SIGKILLed {d.w3_warmup_s:g} s in "
        f"({d.w3_after_kill_s:g} s more of sending): gap = "
        f"longest time without a delivery from 1 s before the kill, lost = confirmed but never delivered, "
        f"duplicates = deliveries of an already delivered message. Where the servers' threads run: RabbitMQ "
        f"binds each node's scheduler threads to the cores (its default, +stbt db); ringq's nodes are bound to a "
        f"CPU each, round-robin, as docs/configuration.md recommends (unbound in the fixed-rate row marked so, and "
        f"in W3, as by default); NATS is left to the system. Each run of a system starts its cluster "
        f"afresh; the systems take turns ({', '.join(LABELS[s] for s in run.columns())}, then again), "
        f"{run.runs_per_system} runs each; a cell is the median (min-max) of the runs."
    )


def _notes(run: Run) -> list[str]:
    lines = []
    for r in run.runs:
        label = f"run {r.run} {LABELS[r.system]}"
        if r.error is not None:
            lines.append(f"- {label}: FAILED: {r.error}")
        for key in ALL_WORKLOADS:
            if key in r.results:
                lines.append(f"- {label} {r.results[key].name}: {r.results[key].notes}")
    return lines


def _tables(run: Run, render: Callable[[Sequence[str], Sequence[Sequence[str]], Sequence[bool]], str]) -> list[str]:
    columns = run.columns()
    return [
        render(*figures_table(run.runs, columns, run.workloads, run.rate, run.unmeasured())),
        "",
        render(GOALS_HEADER, [_goal_cells(g) for g in goals(run.runs, run.rate)], GOALS_RIGHT),
        "",
        "Brokers' CPU per run, in cores (run 1 / run 2 / ...):",
        "",
        render(*cpu_per_run_table(run.runs, columns, run.rate)),
    ]


def _setups(run: Run) -> list[str]:
    lines = []
    for system in run.columns():
        first = run.first(system)
        lines.append(f"- {LABELS[system]}: {first.setup if first is not None else run.unmeasured()[system]}")
    return lines


def section(run: Run) -> str:
    return "\n".join(
        [
            SECTION_TITLE,
            "",
            f"Command: `{run.command}`  ",
            f"Machine: {machine()}  ",
            f"Versions: {versions(run)}  ",
            f"Measured: {run.began} ({run.seconds:.0f} s in all; load average before the run "
            f"{_load(run.load_before)}, after it {_load(run.load_after)})",
            "",
            method_text(run),
            "",
            *_setups(run),
            "",
            *_tables(run, markdown_table),
            "",
            "<details><summary>Notes per run and workload</summary>",
            "",
            *_notes(run),
            "",
            "</details>",
            "",
        ]
    )


def report_text(run: Run) -> str:
    return "\n".join(
        [
            "",
            f"{versions(run)}; {machine()}",
            f"load average before the run {_load(run.load_before)}, after it {_load(run.load_after)}; "
            f"{run.seconds:.0f} s in all",
            "",
            *_tables(run, text_table),
            "",
            *_notes(run),
        ]
    )


def write_section(path: Path, text: str) -> None:
    """Replace the section (from its title, or an older title of it, to the next "## " heading) or append it;
    keep the rest of the file."""
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    title = next((t for t in (SECTION_TITLE, *OLD_TITLES) if t in current), None)
    if title is not None:
        head, _, rest = current.partition(title)
        _, separator, tail = rest.partition("\n## ")
        updated = head + text.rstrip("\n") + "\n" + ("\n## " + tail if separator else "")
    else:
        updated = current.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(updated)


# --- main --------------------------------------------------------------------------------------------


def _say(side: str) -> Callable[[str], None]:
    return lambda message: print(f"[{side}] {message}", file=sys.stderr, flush=True)


class _StopOnSignal:
    """SIGINT and SIGTERM raise KeyboardInterrupt at once and are remembered.

    With a handler of our own in place, asyncio.run does not install its own, which turns Ctrl-C into
    cancelling the main task; gRPC's asyncio calls can absorb that cancellation (the call just ends
    CANCELLED), and a run would go on. The exception unwinds through the clusters' context managers,
    which stop every process they started."""

    def __init__(self) -> None:
        self.signalled = False
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signalled = True
        raise KeyboardInterrupt(signal.Signals(signum).name)


def _choices(parser: argparse.ArgumentParser, text: str, allowed: Sequence[str], what: str) -> list[str]:
    chosen = [w.strip() for w in text.split(",") if w.strip()]
    unknown = set(chosen) - set(allowed)
    if unknown:
        parser.error(f"unknown {what} {sorted(unknown)}; choose from {','.join(allowed)}")
    return chosen


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_queues", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each system, interleaved (default 3)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument(
        "--only",
        default=",".join(ALL_WORKLOADS),
        help=f"comma-separated subset of {','.join(ALL_WORKLOADS)} (W3 runs last)",
    )
    parser.add_argument("--rate", type=float, default=FIXED_RATE, help="the fixed rate of W2@rate and W3, msgs/s")
    defaults = Durations()
    quick = "0.5 s warm-up, 1.5 s measured, W3 killed 1 s in and 4 s after, 15 s drain"
    parser.add_argument("--quick", action="store_true", help=f"short durations ({quick}); the flags below override")
    parser.add_argument(
        "--warmup", type=float, help=f"seconds before the measured window (default {defaults.warmup_s:g})"
    )
    parser.add_argument("--measure", type=float, help=f"seconds measured (default {defaults.measure_s:g})")
    parser.add_argument("--w3-warmup", type=float, help=f"W3: seconds to the kill (default {defaults.w3_warmup_s:g})")
    parser.add_argument(
        "--w3-after-kill",
        type=float,
        help=f"W3: seconds of sending after the kill (default {defaults.w3_after_kill_s:g})",
    )
    parser.add_argument("--drain", type=float, help=f"W3: longest drain at the end (default {defaults.drain_s:g})")
    parser.add_argument("--write", type=Path, help="put the results into this Markdown file (e.g. docs/benchmarks.md)")
    parser.add_argument("--json", type=Path, help="also write every run's results to this file as JSON")
    return parser


def durations_from(args: argparse.Namespace) -> Durations:
    base = Durations.quick() if args.quick else Durations()
    given = {
        "warmup_s": args.warmup,
        "measure_s": args.measure,
        "w3_warmup_s": args.w3_warmup,
        "w3_after_kill_s": args.w3_after_kill,
        "drain_s": args.drain,
    }
    values = {**asdict(base), **{k: v for k, v in given.items() if v is not None}}
    return Durations(**values)


def measure(
    systems: Sequence[str],
    runs: int,
    durations: Durations,
    only: Sequence[str],
    rate: float,
    stop: _StopOnSignal,
) -> list[SystemRun]:
    """`runs` runs of every system in turn; a run that fails is recorded as failed and the others go on."""
    out: list[SystemRun] = []
    for number in range(1, runs + 1):
        for system in systems:
            if stop.signalled:
                raise KeyboardInterrupt
            say = _say(f"{LABELS[system]} run {number}/{runs}")
            try:
                out.append(run_system(system, number, durations, only, rate, say, lambda: stop.signalled))
            except Exception as error:
                say(f"failed: {error}")
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
                out.append(SystemRun(system, number, error=first_line[:300]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    systems = _choices(parser, args.systems, SYSTEMS, "systems")
    only = _choices(parser, args.only, ALL_WORKLOADS, "workloads")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.write and (set(systems) != set(SYSTEMS) or set(only) != set(ALL_WORKLOADS)):
        parser.error("--write needs every system and every workload measured (no --systems, no --only)")
    missing = {s: reason for s in systems if (reason := unavailable_reason(s)) is not None}
    for system, reason in missing.items():
        print(f"{LABELS[system]} is left out: {reason}", file=sys.stderr)
    durations = durations_from(args)
    stop = _StopOnSignal()
    load_before = os.getloadavg()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    started = time.monotonic()
    try:
        runs = measure([s for s in systems if s not in missing], args.runs, durations, only, args.rate, stop)
    except (KeyboardInterrupt, SystemExit):
        print("interrupted: every process this run started has been stopped", file=sys.stderr)
        return 130
    run = Run(
        command=command_line("bench.bench_queues", "bench", argv),
        began=began,
        seconds=time.monotonic() - started,
        load_before=load_before,
        load_after=os.getloadavg(),
        runs_per_system=args.runs,
        durations=durations,
        rate=args.rate,
        systems=systems,
        workloads=only,
        missing={s: f"not run ({reason})" for s, reason in missing.items()},
        runs=runs,
    )
    print(report_text(run))
    if args.json is not None:
        args.json.write_text(json.dumps([r.to_dict() for r in runs], indent=2) + "\n")
    if args.write is not None:
        unmeasured = run.unmeasured()
        if unmeasured:
            print(f"{args.write} not written: {', '.join(LABELS[s] for s in unmeasured)} not measured")
            return 1
        write_section(args.write, section(run))
        print(f"wrote {args.write}")
    return 1 if run.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
