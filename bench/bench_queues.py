"""`make bench`: ringq mirrored queues against RabbitMQ classic mirrored queues, in one run, side by side.

Runs the workloads of ARCHITECTURE section 10 (W1, W2, W2 at a fixed rate, W3) first against a 3-node
ringq cluster (bench/ringq_workloads.py) and then against a 3-node RabbitMQ cluster
(bench/reference), with the same method and the same result record; prints both with their ratios and
the goals of issue 4, and with `--write` puts the section "Mirrored queues vs RabbitMQ (`make bench`)"
into a Markdown file (the file's other sections are kept). Every process either side starts listens on
127.0.0.1 only and is stopped at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bench_gm import machine
from bench.reference.rabbitmq_cluster import SETUP_HINT, unavailable_reason
from bench.reference.rabbitmq_workloads import FIXED_RATE, WORKLOADS, ReferenceReport, WorkloadResult, run_reference
from bench.ringq_workloads import RingqReport, run_ringq

SECTION_TITLE = "## Mirrored queues vs RabbitMQ (`make bench`)"
# The goals of issue 4.
W1_MIN_RATIO = 5.0
W2_MIN_RATIO = 3.0
W3_MAX_GAP_S = 0.5
W2_RATE_MAX_P99_MS = 2.0


# --- comparing ---------------------------------------------------------------------------------------


@dataclass
class Row:
    """One measured figure of one workload, both sides."""

    workload: str
    metric: str
    ringq: float | int | None
    reference: float | int | None
    fmt: str
    ratio: bool = True  # print ringq / RabbitMQ

    def cells(self) -> tuple[str, str, str, str, str]:
        ratio = "-"
        if self.ratio and self.ringq is not None and self.reference:
            ratio = f"{self.ringq / self.reference:.2f}x"
        return self.workload, self.metric, _fmt(self.ringq, self.fmt), _fmt(self.reference, self.fmt), ratio


@dataclass
class Goal:
    name: str
    target: str
    measured: str
    met: bool | None  # None: not measured in this run

    @property
    def verdict(self) -> str:
        return "n/a" if self.met is None else ("met" if self.met else "missed")


def _fmt(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _by_name(results: Sequence[WorkloadResult]) -> dict[str, WorkloadResult]:
    return {r.name: r for r in results}


def compare(ringq: Sequence[WorkloadResult], reference: Sequence[WorkloadResult], rate: float) -> list[Row]:
    """The side-by-side rows: throughput, latency, gap, lost, duplicates per workload."""
    ours, theirs = _by_name(ringq), _by_name(reference)
    rows: list[Row] = []
    w2rate, w3 = f"W2@{rate:g}/s", f"W3@{rate:g}/s"
    specs: list[tuple[str, str, str, str, bool]] = [
        ("W1", "confirmed msgs/s", "rate", ",.0f", True),
        ("W2", "delivered msgs/s", "rate", ",.0f", True),
        ("W2", "latency p50 ms", "p50_ms", ",.2f", True),
        ("W2", "latency p99 ms", "p99_ms", ",.2f", True),
        (w2rate, "delivered msgs/s", "rate", ",.0f", True),
        (w2rate, "latency p50 ms", "p50_ms", ",.2f", True),
        (w2rate, "latency p99 ms", "p99_ms", ",.2f", True),
        (w3, "gap s", "gap_s", ",.2f", True),
        (w3, "lost", "lost", ",d", False),
        (w3, "duplicates", "duplicates", ",d", False),
    ]
    for workload, metric, attribute, fmt, ratio in specs:
        mine, other = ours.get(workload), theirs.get(workload)
        if mine is None and other is None:
            continue
        rows.append(
            Row(
                workload,
                metric,
                getattr(mine, attribute) if mine is not None else None,
                getattr(other, attribute) if other is not None else None,
                fmt,
                ratio,
            )
        )
    return rows


def goals(ringq: Sequence[WorkloadResult], reference: Sequence[WorkloadResult] | None, rate: float) -> list[Goal]:
    """Issue 4's goals, each met, missed or not measured (None)."""
    ours, theirs = _by_name(ringq), _by_name(reference or [])
    out: list[Goal] = []

    w1, w1_ref = ours.get("W1"), theirs.get("W1")
    if w1 is not None and w1.rate is not None and w1_ref is not None and w1_ref.rate:
        ratio = w1.rate / w1_ref.rate
        out.append(Goal("W1 throughput", f">= {W1_MIN_RATIO:g}x RabbitMQ", f"{ratio:.2f}x", ratio >= W1_MIN_RATIO))
    else:
        out.append(Goal("W1 throughput", f">= {W1_MIN_RATIO:g}x RabbitMQ", "not measured", None))

    w2, w2_ref = ours.get("W2"), theirs.get("W2")
    target = f">= {W2_MIN_RATIO:g}x RabbitMQ, p99 no worse"
    if w2 is not None and w2_ref is not None and w2.rate is not None and w2_ref.rate:
        ratio = w2.rate / w2_ref.rate
        p99, p99_ref = w2.p99_ms, w2_ref.p99_ms
        p99_ok = p99 is not None and p99_ref is not None and p99 <= p99_ref
        measured = f"{ratio:.2f}x, p99 {_fmt(p99, ',.1f')} ms vs {_fmt(p99_ref, ',.1f')} ms"
        out.append(Goal("W2 throughput and latency", target, measured, ratio >= W2_MIN_RATIO and p99_ok))
    else:
        out.append(Goal("W2 throughput and latency", target, "not measured", None))

    w3 = ours.get(f"W3@{rate:g}/s")
    target = f"gap <= {W3_MAX_GAP_S:g} s, 0 lost, 0 duplicates"
    if w3 is not None and w3.gap_s is not None:
        measured = f"gap {w3.gap_s:.2f} s, {w3.lost} lost, {w3.duplicates} duplicates"
        still_queued = w3.details.get("lost_still_queued")
        if w3.lost and isinstance(still_queued, int) and still_queued:
            measured += f" ({still_queued} of the lost still queued, not delivered in time)"
        met = w3.gap_s <= W3_MAX_GAP_S and w3.lost == 0 and w3.duplicates == 0
        out.append(Goal("W3 master SIGKILL", target, measured, met))
    else:
        out.append(Goal("W3 master SIGKILL", target, "not measured", None))

    w2rate = ours.get(f"W2@{rate:g}/s")
    target = f"p99 < {W2_RATE_MAX_P99_MS:g} ms"
    if w2rate is not None and w2rate.p99_ms is not None:
        measured = f"p99 {w2rate.p99_ms:,.2f} ms"
        out.append(Goal(f"W2@{rate:g}/s latency", target, measured, w2rate.p99_ms < W2_RATE_MAX_P99_MS))
    else:
        out.append(Goal(f"W2@{rate:g}/s latency", target, "not measured", None))
    return out


# --- printing --------------------------------------------------------------------------------------


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


COMPARISON_HEADER = ("workload", "metric", "ringq", "RabbitMQ", "ringq / RabbitMQ")
COMPARISON_RIGHT = (False, False, True, True, True)
GOALS_HEADER = ("goal (issue 4)", "target", "ringq measured", "verdict")
GOALS_RIGHT = (False, False, False, False)


def _goal_cells(goal: Goal) -> tuple[str, str, str, str]:
    return goal.name, goal.target, goal.measured, goal.verdict


def _notes(side: str, results: Sequence[WorkloadResult]) -> list[str]:
    return [f"- {side} {r.name}: {r.notes}" for r in results]


# --- the Markdown section --------------------------------------------------------------------------


@dataclass
class Run:
    command: str
    began: str
    seconds: float
    load: tuple[float, float, float]
    quick: bool
    rate: float
    ringq: RingqReport
    reference: ReferenceReport | None


def section(run: Run) -> str:
    reference = run.reference
    rows = compare(run.ringq.results, reference.results if reference else [], run.rate)
    versions = (
        f"RabbitMQ {reference.rabbitmq_version} on Erlang/OTP {reference.erlang_version}"
        if reference
        else "RabbitMQ not run"
    )
    lines = [
        SECTION_TITLE,
        "",
        f"Command: `{run.command}`  ",
        f"Machine: {machine()}  ",
        f"ringq {run.ringq.version} ({run.ringq.commit}); {versions}  ",
        f"Measured: {run.began} ({run.seconds:.0f} s in all; load average before the run "
        f"{run.load[0]:.2f} {run.load[1]:.2f} {run.load[2]:.2f})" + ("; --quick (short runs)" if run.quick else ""),
        "",
        "Both sides measured in this run, one after the other, with the same method (bench/reference/"
        "rabbitmq_workloads.py, reused by bench/ringq_workloads.py): producer and consumer in separate "
        "processes, 256-byte transient bodies carrying a sequence number and a send timestamp, a durable "
        "queue declared through node 1 (its master there) and mirrored on all 3 nodes, clients on the "
        "master's node, confirms with at most 1000 in flight, prefetch 1000 and one acknowledgement per "
        "message, only confirms/deliveries inside the measured window counted; at the fixed rate, latency "
        "runs from each message's scheduled send time. W3 is W2 at the fixed rate with the master's node "
        "SIGKILLed: gap = longest time without a delivery from 1 s before the kill, lost = confirmed but "
        "never delivered, duplicates = deliveries of an already delivered message.",
        "",
        f"- ringq: {run.ringq.setup}",
        f"- RabbitMQ: {reference.setup}" if reference else "- RabbitMQ: not run",
        "",
        markdown_table(COMPARISON_HEADER, [r.cells() for r in rows], COMPARISON_RIGHT),
        "",
        "For latency and gap a ratio above 1 means ringq is slower.",
        "",
        markdown_table(
            GOALS_HEADER,
            [_goal_cells(g) for g in goals(run.ringq.results, reference.results if reference else None, run.rate)],
            GOALS_RIGHT,
        ),
        "",
        "Notes per workload:",
        "",
        *_notes("ringq", run.ringq.results),
        *(_notes("RabbitMQ", reference.results) if reference else []),
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    """Replace the section (from its title to the next "## " heading) or append it; keep the rest."""
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION_TITLE in current:
        head, _, rest = current.partition(SECTION_TITLE)
        _, separator, tail = rest.partition("\n## ")
        updated = head + text.rstrip("\n") + "\n" + ("\n## " + tail if separator else "")
    else:
        updated = current.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(updated)


# --- main ------------------------------------------------------------------------------------------


def _say(side: str) -> Callable[[str], None]:
    return lambda message: print(f"[{side}] {message}", file=sys.stderr, flush=True)


def _command(argv: list[str] | None) -> str:
    if argv is None and os.environ.get("MAKELEVEL"):
        return "make bench"
    return "python -m bench.bench_queues " + " ".join(sys.argv[1:] if argv is None else argv)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_queues", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a few minutes in all)")
    parser.add_argument(
        "--only", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)} (W3 runs last)"
    )
    parser.add_argument("--rate", type=float, default=FIXED_RATE, help="the fixed rate of W2@rate and W3, msgs/s")
    parser.add_argument("--skip-reference", action="store_true", help="run the ringq side only")
    parser.add_argument(
        "--ack-every",
        type=int,
        default=1,
        help="ringq consumer: 1 (default, the reference's method) acknowledges each message; N > 1 settles "
        "every Nth with `multiple` (for investigation only; not comparable, and not written with --write)",
    )
    parser.add_argument("--write", type=Path, help="put the results into this Markdown file (e.g. docs/benchmarks.md)")
    parser.add_argument("--json", type=Path, help="also write both reports to this file as JSON")
    args = parser.parse_args(argv)
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = set(only) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    if args.write and (args.skip_reference or args.ack_every != 1):
        parser.error("--write needs both sides measured with the same method (no --skip-reference, --ack-every 1)")
    if not args.skip_reference:
        problem = unavailable_reason()
        if problem is not None:
            print(f"cannot run the RabbitMQ reference: {problem}; {SETUP_HINT}", file=sys.stderr)
            return 2
    stop = _StopOnSignal()
    load = os.getloadavg()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    started = time.monotonic()
    try:
        ringq = run_ringq(
            quick=args.quick,
            only=only,
            rate=args.rate,
            ack_every=args.ack_every,
            progress=_say("ringq"),
            stop_requested=lambda: stop.signalled,
        )
        reference = None
        reference_failed = False
        if not args.skip_reference:
            if stop.signalled:
                raise KeyboardInterrupt
            try:
                reference = run_reference(quick=args.quick, only=only, rate=args.rate, progress=_say("reference"))
            except Exception as error:  # still show ringq's figures
                print(f"the RabbitMQ reference failed: {error}", file=sys.stderr)
                reference_failed = True
    except (KeyboardInterrupt, SystemExit):
        print("interrupted: every process this run started has been stopped", file=sys.stderr)
        return 130
    run = Run(
        command=_command(argv),
        began=began,
        seconds=time.monotonic() - started,
        load=load,
        quick=args.quick,
        rate=args.rate,
        ringq=ringq,
        reference=reference,
    )
    print(report_text(run))
    if args.json is not None:
        payload: dict[str, Any] = {"ringq": ringq.to_dict(), "reference": reference.to_dict() if reference else None}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if reference_failed:
        if args.write is not None:
            print(f"{args.write} not written: the reference did not run", file=sys.stderr)
        return 1
    if args.write is not None:
        write_section(args.write, section(run))
        print(f"wrote {args.write}")
    return 0


def report_text(run: Run) -> str:
    reference = run.reference
    rows = compare(run.ringq.results, reference.results if reference else [], run.rate)
    goal_rows = goals(run.ringq.results, reference.results if reference else None, run.rate)
    versions = (
        f"RabbitMQ {reference.rabbitmq_version} on Erlang/OTP {reference.erlang_version}"
        if reference
        else "RabbitMQ not run"
    )
    return "\n".join(
        [
            "",
            f"ringq {run.ringq.version} ({run.ringq.commit}); {versions}; {machine()}",
            f"load average before the run: {run.load[0]:.2f} {run.load[1]:.2f} {run.load[2]:.2f}; "
            f"{run.seconds:.0f} s in all",
            "",
            text_table(COMPARISON_HEADER, [r.cells() for r in rows], COMPARISON_RIGHT),
            "",
            text_table(GOALS_HEADER, [_goal_cells(g) for g in goal_rows], GOALS_RIGHT),
            "",
            *_notes("ringq", run.ringq.results),
            *(_notes("RabbitMQ", reference.results) if reference else []),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
