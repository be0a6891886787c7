"""`make soak`: W2 at a fixed 10,000 msgs/s for 30 minutes against a 3-node ringq cluster, every node's
memory recorded each minute (issue 13 item 4: RSS flat within 10 % after warm-up).

Responsible for: the soak run and its report. The cluster (3 nodes with default node settings and a
coordinator on 127.0.0.1), the queue (durable, mirrored on every node by the `ha` policy, master on node1)
and the clients are bench/ringq_workloads.py's: one paced producer with confirms (up to 1000 in flight,
one Publish stream) and one consumer (prefetch 1000, acks batched as W2 of `make bench` does: `--ack-each`
for one ack per message), each in a spawned process,
here also sharing their running counts with this process. Every minute (`--sample-s`) it records each
node's RSS (VmRSS of the node's process), the queue's depth, the messages confirmed and delivered so far,
how far the producer is behind its schedule, and the CPU the nodes used over that minute (cores). At
the end the consumer drains the queue, and the report gives: lost (confirmed, never delivered),
duplicates (delivered again without the redelivered flag), messages behind the schedule, each node's RSS
growth from the end of the warm-up (minute 2) to the end and its largest deviation from the warm-up
value, and the verdict against "flat within 10 %". `--write FILE` puts the section "Soak (`make soak`)"
into a Markdown file, the file's other sections kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.synchronize
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bench.ack_batching import BATCHED, EACH, AckPolicy
from bench.bench_gm import machine
from bench.bench_queues import _StopOnSignal, markdown_table, text_table
from bench.markdown import command_line, replace_marked
from bench.process_stats import MIB, CpuMeter, node_pids, rss_bytes
from bench.reference.rabbitmq_workloads import _CTX, MAX_IN_FLIGHT, PAYLOAD_SIZE, PREFETCH, PairSpec, run_pair
from bench.ringq_workloads import (
    NODE_ARGS,
    NODES,
    POLICY,
    ConsumerConfig,
    ProducerConfig,
    RingqCluster,
    RingqConsumerReport,
    RingqProducerReport,
    _admin,
    _Consumer,
    _Producer,
    delete_queue,
    prepare_queue,
    ringq_version,
    take_leftovers,
)
from ringq import aio

RATE = 10_000.0
MINUTES = 30.0
WARMUP_MINUTES = 2
FLAT_TOLERANCE = 0.10  # issue 13: RSS flat within 10 % after warm-up
QUEUE = "ha.soak"
PROGRESS_S = 0.1  # how often the clients publish their counts to this process
DRAIN_S = 60.0
MARK_BEGIN = "<!-- soak:begin -->"
MARK_END = "<!-- soak:end -->"
SECTION_TITLE = "## Soak (`make soak`)"
_Report = TypeVar("_Report")


# --- the figures ------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One minute's record; minute 0 is taken when the producer starts (no CPU window yet)."""

    minute: int
    elapsed_s: float
    rss: dict[str, int]  # node -> bytes
    depth: int | None  # None: the queue's status could not be read
    confirmed: int
    delivered: int
    behind: int  # messages due by the schedule but not yet published
    cpu_by_node: dict[str, float] = field(default_factory=dict)  # node -> cores over the minute

    @property
    def cpu_cores(self) -> float | None:
        return sum(self.cpu_by_node.values()) if self.cpu_by_node else None


@dataclass
class NodeGrowth:
    """One node's memory over the soak, against its RSS at the end of the warm-up."""

    node: str
    warm_rss: int
    end_rss: int
    max_deviation: float  # the largest |RSS - warm_rss| / warm_rss from the warm-up on
    max_deviation_minute: int

    @property
    def growth(self) -> float:
        return (self.end_rss - self.warm_rss) / self.warm_rss


def node_growth(samples: Sequence[Sample], warmup_minutes: int) -> list[NodeGrowth]:
    """Each node's growth from the sample at minute `warmup_minutes` (the last sample if the run was
    shorter) to the last, and its largest deviation from the warm-up value in between; nodes missing
    from the warm-up sample are left out."""
    if not samples:
        return []
    warm = next((s for s in samples if s.minute >= warmup_minutes), samples[-1])
    after = [s for s in samples if s.minute >= warm.minute]
    out = []
    for node, warm_rss in warm.rss.items():
        worst, worst_minute = 0.0, warm.minute
        for sample in after:
            rss = sample.rss.get(node)
            if rss is not None and abs(rss - warm_rss) / warm_rss > worst:
                worst, worst_minute = abs(rss - warm_rss) / warm_rss, sample.minute
        end = next(s.rss[node] for s in reversed(after) if node in s.rss)
        out.append(NodeGrowth(node, warm_rss, end, worst, worst_minute))
    return out


def flat_verdict(growths: Sequence[NodeGrowth], samples: Sequence[Sample], warmup_minutes: int) -> tuple[bool, str]:
    """Whether every node stayed within FLAT_TOLERANCE of its warm-up RSS, and the sentence that says so."""
    target = f"flat within {FLAT_TOLERANCE:.0%}".replace("%", " %")
    if not growths:
        return False, f"not {target}: no memory samples"
    after_warmup = [s for s in samples if s.minute > warmup_minutes]
    worst = max(growths, key=lambda g: g.max_deviation)
    if worst.max_deviation > FLAT_TOLERANCE:
        return False, (
            f"not {target}: {worst.node} was {_percent(worst.max_deviation)} from its warm-up RSS at minute "
            f"{worst.max_deviation_minute} ({_mib(worst.warm_rss)} MiB at minute {warmup_minutes})"
        )
    if not after_warmup:
        return False, f"not measured: the run ended by minute {warmup_minutes}, the end of the warm-up"
    return (
        True,
        f"{target}: the largest deviation from the warm-up RSS was {_percent(worst.max_deviation)} ({worst.node})",
    )


def missing(confirmed: Iterable[int], delivered: Iterable[int], sequence_numbers: int) -> list[int]:
    """The `confirmed` sequence numbers (each below `sequence_numbers`) that are not among `delivered`."""
    seen = bytearray(sequence_numbers)
    for seq in delivered:
        if 0 <= seq < sequence_numbers:
            seen[seq] = 1
    return [seq for seq in confirmed if not seen[seq]]


def count_duplicates(seqs: Sequence[int], redelivered_flags: Sequence[int]) -> int:
    """Deliveries of a sequence number delivered before that do not carry the redelivered flag."""
    if len(seqs) != len(redelivered_flags):
        raise ValueError("one redelivered flag per delivery")
    seen = bytearray(max(seqs, default=-1) + 1)
    duplicates = 0
    for seq, flag in zip(seqs, redelivered_flags, strict=True):
        if seen[seq] and not flag:
            duplicates += 1
        seen[seq] = 1
    return duplicates


@dataclass
class SoakRun:
    """What a soak run measured, and how."""

    command: str
    began: str
    minutes: float
    rate: float
    warmup_minutes: int
    version: str
    commit: str
    setup: str
    master: str
    samples: list[Sample] = field(default_factory=list)
    published: int = 0
    confirmed: int = 0
    delivered: int = 0
    lost: int = 0
    lost_still_queued: int | None = None  # of the lost, how many a check consumer found still queued
    duplicates: int = 0
    redelivered: int = 0
    behind_at_end: int = 0
    behind_max: int = 0
    node_log_problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def growths(self) -> list[NodeGrowth]:
        return node_growth(self.samples, self.warmup_minutes)

    def verdict(self) -> tuple[bool, str]:
        return flat_verdict(self.growths(), self.samples, self.warmup_minutes)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["growths"] = [asdict(g) | {"growth": g.growth} for g in self.growths()]
        out["flat"], out["verdict"] = self.verdict()
        return out


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.1f} %"


# --- the report -------------------------------------------------------------------------------------


def sample_rows(run: SoakRun) -> tuple[list[str], list[list[str]], list[bool]]:
    nodes = list(run.samples[0].rss) if run.samples else []
    header = [
        "minute",
        *(f"{n}{' (master)' if n == run.master else ''} RSS MiB" for n in nodes),
        "depth",
        "confirmed",
        "delivered",
        "behind schedule",
        "nodes CPU cores",
    ]
    rows = []
    for s in run.samples:
        cores = s.cpu_cores
        rows.append(
            [
                str(s.minute),
                *(_mib(s.rss.get(n)) for n in nodes),
                "-" if s.depth is None else f"{s.depth:,}",
                f"{s.confirmed:,}",
                f"{s.delivered:,}",
                f"{s.behind:,}",
                "-" if cores is None else f"{cores:.2f}",
            ]
        )
    return header, rows, [True] * len(header)


def growth_rows(run: SoakRun) -> tuple[list[str], list[list[str]], list[bool]]:
    header = ["node", f"RSS at minute {run.warmup_minutes} MiB", "at the end MiB", "growth", "largest deviation"]
    rows = [
        [
            g.node,
            _mib(g.warm_rss),
            _mib(g.end_rss),
            _percent(g.growth),
            f"{_percent(g.max_deviation)} (minute {g.max_deviation_minute})",
        ]
        for g in run.growths()
    ]
    return header, rows, [False, True, True, True, True]


def outcome_lines(run: SoakRun) -> list[str]:
    lost = f"{run.lost:,}"
    if run.lost and run.lost_still_queued:
        lost += f" ({run.lost_still_queued:,} of them still in the queue after the drain)"
    flat, verdict = run.verdict()
    lines = [
        f"- published {run.published:,}, confirmed {run.confirmed:,}, delivered {run.delivered:,} "
        f"({run.redelivered:,} flagged redelivered)",
        f"- lost (confirmed, never delivered): {lost}",
        f"- duplicates (delivered again, not flagged redelivered): {run.duplicates:,}",
        f"- behind the schedule: {run.behind_at_end:,} at the end, {run.behind_max:,} at the most",
        f"- verdict: {'met' if flat else 'missed'}: {verdict}",
    ]
    if run.node_log_problems:
        lines.append(
            f"- the nodes logged {len(run.node_log_problems)} warnings/errors, e.g. "
            + "; ".join(run.node_log_problems[:3])
        )
    if run.errors:
        lines.append("- client errors: " + "; ".join(run.errors[:5]))
    return lines


def report_text(run: SoakRun) -> str:
    return "\n".join(
        [
            f"ringq {run.version} ({run.commit}); {machine()}; {run.began}",
            run.setup,
            "",
            text_table(*sample_rows(run)),
            "",
            text_table(*growth_rows(run)),
            "",
            *outcome_lines(run),
        ]
    )


def section(run: SoakRun) -> str:
    return "\n".join(
        [
            MARK_BEGIN,
            SECTION_TITLE,
            "",
            f"Command: `{run.command}`  ",
            f"Machine: {machine()}  ",
            f"ringq {run.version} ({run.commit})  ",
            f"Measured: {run.began}" + ("" if run.minutes >= MINUTES else f" (shortened: {run.minutes:g} minutes)"),
            "",
            run.setup,
            "",
            markdown_table(*sample_rows(run)),
            "",
            f"Memory from the end of the warm-up (minute {run.warmup_minutes}) on (goal of issue 13: flat within "
            f"{FLAT_TOLERANCE:.0%}):".replace("%", " %"),
            "",
            markdown_table(*growth_rows(run)),
            "",
            *outcome_lines(run),
            MARK_END,
        ]
    )


# --- the clients (spawned processes) ----------------------------------------------------------------


@dataclass
class SoakProducerConfig(ProducerConfig):
    """The workloads' producer config, and where the producer shares its running counts with this process:
    an Array('q', 4) of [confirmed, sequence numbers published, behind schedule now, at the most]."""

    progress: Any = None


@dataclass
class SoakConsumerConfig(ConsumerConfig):
    """The workloads' consumer config, and an Array('q', 1) where the consumer shares its delivery count."""

    progress: Any = None


async def _sharing(share: Callable[[], None], run: Awaitable[_Report]) -> _Report:
    """Await `run`, calling `share` every PROGRESS_S meanwhile."""

    async def every() -> None:
        while True:
            share()
            await asyncio.sleep(PROGRESS_S)

    task = asyncio.ensure_future(every())
    try:
        return await run
    finally:
        task.cancel()


class _ReportingProducer(_Producer):
    """bench/ringq_workloads.py's producer, also sharing its counts every PROGRESS_S."""

    cfg: SoakProducerConfig

    async def run(self) -> RingqProducerReport:
        return await _sharing(self._share, super().run())

    def _share(self) -> None:
        progress, behind = self.cfg.progress, self.report.behind_schedule
        progress[0], progress[1], progress[2] = self.report.confirmed, self.next_seq, behind
        progress[3] = max(progress[3], behind)


class _ReportingConsumer(_Consumer):
    """bench/ringq_workloads.py's consumer, also sharing its delivery count every PROGRESS_S."""

    cfg: SoakConsumerConfig

    async def run(self) -> RingqConsumerReport:
        return await _sharing(self._share, super().run())

    def _share(self) -> None:
        self.cfg.progress[0] = len(self.report.seqs)


def _producer_process(cfg: SoakProducerConfig, started: Any, results: multiprocessing.Queue[Any]) -> None:
    try:
        report = asyncio.run(_ReportingProducer(cfg, started).run())
    except BaseException as exc:
        report = RingqProducerReport(errors=[f"producer crashed: {exc!r}"])
    results.put(("producer", report))


def _consumer_process(
    cfg: SoakConsumerConfig,
    ready: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[Any],
) -> None:
    try:
        report = asyncio.run(_ReportingConsumer(cfg, ready, stop).run())
    except BaseException as exc:
        report = RingqConsumerReport(errors=[f"consumer crashed: {exc!r}"])
    results.put(("consumer", report))


# --- the run (this process) ---------------------------------------------------------------------------


def _depth(rc: RingqCluster, queue: str) -> int | None:
    async def status(connection: aio.Connection) -> int:
        return (await connection.queue_status(queue)).depth

    try:
        depth: int = _admin(status, rc.live_addresses(), retry_for=5.0, access=rc.access)
    except Exception:
        return None
    return depth


class _Sampler:
    """Takes the samples: RSS and CPU of the node processes, the queue's depth, the clients' counts."""

    def __init__(self, rc: RingqCluster, queue: str, producer: Any, consumer: Any) -> None:
        self.rc, self.queue = rc, queue
        self.pids = node_pids(rc.info)
        self.producer, self.consumer = producer, consumer
        self.cpu = CpuMeter(list(self.pids.values()))

    def take(self, minute: int, elapsed_s: float) -> Sample:
        cpu = self.cpu.read()
        rss = {name: value for name, pid in self.pids.items() if (value := rss_bytes(pid)) is not None}
        confirmed, behind, delivered = self.producer[0], self.producer[2], self.consumer[0]
        cores = {name: cpu[pid] / 100 for name, pid in self.pids.items() if pid in cpu} if minute else {}
        return Sample(minute, elapsed_s, rss, _depth(self.rc, self.queue), confirmed, delivered, behind, cores)

    def every(
        self, sample_s: float, duration_s: float, into: list[Sample], say: Callable[[str], None]
    ) -> Callable[[float], None]:
        """run_pair's `on_started`: a sample at time zero, then one every `sample_s` until `duration_s`."""

        def sample(started_s: float) -> None:
            into.append(self.take(0, 0.0))
            minute = 0
            while (minute + 1) * sample_s <= duration_s + 1e-6:
                minute += 1
                time.sleep(max(0.0, started_s + minute * sample_s - time.monotonic()))
                into.append(self.take(minute, time.monotonic() - started_s))
                say(_progress_line(into[-1]))

        return sample


def soak(
    *,
    minutes: float = MINUTES,
    rate: float = RATE,
    warmup_minutes: int = WARMUP_MINUTES,
    sample_s: float = 60.0,
    acks: AckPolicy = BATCHED,
    command: str = "make soak",
    say: Callable[[str], None] = lambda _message: None,
) -> SoakRun:
    """Start the cluster, run W2 at `rate` for `minutes` sampling every `sample_s`, drain, stop the cluster."""
    version, commit = ringq_version()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    duration_s = minutes * 60
    say(f"starting a {NODES}-node ringq cluster")
    with RingqCluster(NODES) as rc:
        queue, master, problems = prepare_queue(rc, QUEUE)
        setup = (
            f"{NODES} nodes and a coordinator on 127.0.0.1, default node settings (node flags "
            f"`{' '.join(NODE_ARGS)}`); queue `{queue}` durable, mirrored on every node ({json.dumps(POLICY)}), "
            f"master on {master}; W2 at a fixed {rate:,.0f} msgs/s for {minutes:g} minutes: one producer "
            f"({PAYLOAD_SIZE}-byte transient bodies, confirms with up to {MAX_IN_FLIGHT} in flight) and one "
            f"consumer (prefetch {PREFETCH}, {acks.describe()}), each in its own process, connected to {master}; "
            "after the producer stops the consumer drains the queue. RSS is VmRSS of each node's process; CPU "
            "is the nodes' (not the coordinator's) over each minute."
        )
        run = SoakRun(command, began, minutes, rate, warmup_minutes, version, commit, setup, master)
        run.errors.extend(f"queue redeclared: {p}" for p in problems)
        offsets = rc.log_offsets()
        addresses = rc.addresses_from(master)
        producer_progress, consumer_progress = _CTX.Array("q", 4), _CTX.Array("q", 1)
        spec = PairSpec(
            producer_main=_producer_process,
            producer_cfg=SoakProducerConfig(
                addresses,
                queue,
                0.0,
                duration_s,
                rate=rate,
                record_confirmed=True,
                access=rc.access,
                progress=producer_progress,
            ),
            consumer_main=_consumer_process,
            consumer_cfg=SoakConsumerConfig(
                addresses, queue, acks=acks, drain=True, drain_s=DRAIN_S, access=rc.access, progress=consumer_progress
            ),
            cpu_seconds=rc.cpu_seconds,
            warmup_s=0.0,
            measure_s=duration_s,
            drain_s=DRAIN_S,
            subscribe_timeout_s=60.0,
        )
        sampler = _Sampler(rc, queue, producer_progress, consumer_progress)
        outcome = run_pair(spec, sampler.every(sample_s, duration_s, run.samples, say))
        producer, consumer = outcome.producer, outcome.consumer
        assert isinstance(producer, RingqProducerReport) and isinstance(consumer, RingqConsumerReport)
        say("analysing the deliveries")
        _account(run, producer, consumer)
        run.behind_max = max(int(producer_progress[3]), producer.behind_schedule)
        if run.lost:
            leftovers = take_leftovers(rc, queue)
            if leftovers is not None:
                lost = missing(producer.confirmed_seqs, consumer.seqs, producer.sequence_numbers)
                run.lost_still_queued = len(set(lost) & set(leftovers))
        run.node_log_problems = rc.log_problems(offsets)
        delete_queue(rc, queue)
    return run


def _account(run: SoakRun, producer: RingqProducerReport, consumer: RingqConsumerReport) -> None:
    run.published = producer.sequence_numbers
    run.confirmed = producer.confirmed
    run.delivered = len(consumer.seqs)
    run.redelivered = consumer.redelivered
    run.behind_at_end = producer.behind_schedule
    run.lost = len(missing(producer.confirmed_seqs, consumer.seqs, producer.sequence_numbers))
    run.duplicates = count_duplicates(consumer.seqs, consumer.redelivered_flags)
    run.errors.extend(f"producer: {e}" for e in producer.errors[:5])
    run.errors.extend(f"consumer: {e}" for e in consumer.errors[:5])


def _progress_line(s: Sample) -> str:
    rss = ", ".join(f"{node} {_mib(value)} MiB" for node, value in s.rss.items())
    cores = s.cpu_cores
    return (
        f"minute {s.minute}: {rss}; depth {s.depth}; confirmed {s.confirmed:,}, delivered {s.delivered:,}, "
        f"behind {s.behind:,}; nodes CPU {cores or 0:.2f} cores"
    )


# --- main -------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=MINUTES, help="how long the producer runs (default 30)")
    parser.add_argument("--rate", type=float, default=RATE, help="the producer's fixed rate, msgs/s")
    parser.add_argument(
        "--warmup-minutes", type=int, default=WARMUP_MINUTES, help="the sample RSS growth is measured from"
    )
    parser.add_argument(
        "--sample-s", type=float, default=60.0, help="seconds between samples (a 'minute'; shorter only for trials)"
    )
    parser.add_argument(
        "--ack-each",
        action="store_true",
        help=f"the consumer acknowledges each message (default: {BATCHED.describe()}, as W2 of `make bench`)",
    )
    parser.add_argument("--write", type=Path, help="put the section into this Markdown file (docs/benchmarks.md)")
    parser.add_argument("--json", type=Path, help="also write the run to this file as JSON")
    args = parser.parse_args(argv)
    if args.minutes * 60 < args.sample_s:
        parser.error("--minutes must cover at least one sample")
    _StopOnSignal()  # Ctrl-C and SIGTERM unwind through the cluster, which stops every process it started
    try:
        run = soak(
            minutes=args.minutes,
            rate=args.rate,
            warmup_minutes=args.warmup_minutes,
            sample_s=args.sample_s,
            acks=EACH if args.ack_each else BATCHED,
            command=command_line("bench.soak", "soak", argv),
            say=lambda message: print(f"[soak] {message}", file=sys.stderr, flush=True),
        )
    except KeyboardInterrupt:
        print("interrupted: every process this run started has been stopped", file=sys.stderr)
        return 130
    print(report_text(run))
    if args.json is not None:
        args.json.write_text(json.dumps(run.to_dict(), indent=2) + "\n")
    if args.write is not None:
        replace_marked(args.write, MARK_BEGIN, MARK_END, section(run))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
