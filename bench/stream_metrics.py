"""The figures of `make bench-streams`, computed from what the clients recorded (pure: no broker, no clock).

A run records, client side, on CLOCK_MONOTONIC nanoseconds:
- confirms: (time, application sequence number) for each message whose publisher confirm arrived, in
  arrival order; a message confirmed twice (sent again after a failover) appears once per confirm;
- deliveries: (time, application sequence number) for each message the consumer handed to the
  application, in delivery order (after whatever duplicate dropping the client library does itself).

The application sequence number is the producer's own count (0, 1, 2, ...), carried in the body, the
same for every broker, so the figures mean the same thing for each:
- lost: confirmed, never delivered;
- duplicates: deliveries of a message already delivered;
- order violations: first deliveries of a message numbered below one delivered before it (the
  application saw it out of order; duplicates are counted apart, not here);
- gap: the longest interval without a confirm (confirm gap) or without a delivery (delivery gap) from
  1 s before the kill to the end of the producer's sending; "gap" is the larger of the two, so a stall
  of either side counts. If nothing came after the kill, the stretch runs to the end of sending.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NS = 1_000_000_000
BEFORE_KILL_NS = NS  # the gap is looked for from 1 s before the kill


def rate(times_ns: Iterable[int], start_ns: int, end_ns: int) -> float:
    """Events per second in [start_ns, end_ns)."""
    if end_ns <= start_ns:
        return 0.0
    count = sum(1 for t in times_ns if start_ns <= t < end_ns)
    return count * NS / (end_ns - start_ns)


def longest_gap(times_ns: Iterable[int], start_ns: int, end_ns: int) -> tuple[int, int]:
    """The longest interval without an event in [start_ns, end_ns], counting both bounds as events:
    (its length, when it ended), both in ns."""
    if end_ns <= start_ns:
        return 0, start_ns
    points = [start_ns, *sorted(t for t in times_ns if start_ns < t < end_ns), end_ns]
    best, ended = 0, start_ns
    for a, b in itertools.pairwise(points):
        if b - a > best:
            best, ended = b - a, b
    return best, ended


def lost(confirmed: Iterable[int], delivered: Iterable[int]) -> int:
    """Messages confirmed but never delivered."""
    return len(set(confirmed) - set(delivered))


def duplicates(delivered: Sequence[int]) -> int:
    """Deliveries of a message already delivered."""
    return len(delivered) - len(set(delivered))


def order_violations(delivered: Iterable[int]) -> int:
    """First deliveries of a message numbered below the highest one delivered before it."""
    seen: set[int] = set()
    highest = -1
    count = 0
    for seq in delivered:
        if seq in seen:
            continue
        seen.add(seq)
        if seq < highest:
            count += 1
        else:
            highest = seq
    return count


def per_second(times_ns: Iterable[int], start_ns: int, seconds: int) -> list[int]:
    """How many events fell in each of `seconds` one-second buckets from start_ns."""
    counts = [0] * max(0, seconds)
    for t in times_ns:
        i = (t - start_ns) // NS
        if 0 <= i < len(counts):
            counts[i] += 1
    return counts


@dataclass(frozen=True)
class FailoverFigures:
    gap_s: float  # max(confirm_gap_s, delivery_gap_s)
    confirm_gap_s: float
    delivery_gap_s: float
    confirms_resumed_s: float  # after the kill, when the longest confirm gap ended (relative to the kill)
    deliveries_resumed_s: float
    lost: int
    duplicates: int
    order_violations: int
    confirmed: int  # distinct messages confirmed
    delivered: int  # distinct messages delivered


def failover_figures(
    confirm_ns: Sequence[int],
    confirmed: Sequence[int],
    delivered_ns: Sequence[int],
    delivered: Sequence[int],
    kill_ns: int,
    end_ns: int,
) -> FailoverFigures:
    """The failover run's figures; `end_ns` is when the producer stopped sending new messages."""
    start = kill_ns - BEFORE_KILL_NS
    end = max(end_ns, kill_ns)
    confirm_gap, confirm_ended = longest_gap(confirm_ns, start, end)
    delivery_gap, delivery_ended = longest_gap(delivered_ns, start, end)
    return FailoverFigures(
        gap_s=max(confirm_gap, delivery_gap) / NS,
        confirm_gap_s=confirm_gap / NS,
        delivery_gap_s=delivery_gap / NS,
        confirms_resumed_s=(confirm_ended - kill_ns) / NS,
        deliveries_resumed_s=(delivery_ended - kill_ns) / NS,
        lost=lost(confirmed, delivered),
        duplicates=duplicates(delivered),
        order_violations=order_violations(delivered),
        confirmed=len(set(confirmed)),
        delivered=len(set(delivered)),
    )


@dataclass(frozen=True)
class Spread:
    """The median, min and max of one figure over the repeats (None: no repeat measured it)."""

    median: float | None
    low: float | None
    high: float | None
    count: int

    def text(self, fmt: str) -> str:
        if self.median is None or self.low is None or self.high is None:
            return "-"
        if self.count == 1:
            return format(self.median, fmt)
        return f"{format(self.median, fmt)} ({format(self.low, fmt)}-{format(self.high, fmt)})"


def spread(values: Iterable[float | int | None]) -> Spread:
    measured = [float(v) for v in values if v is not None]
    if not measured:
        return Spread(None, None, None, 0)
    return Spread(statistics.median(measured), min(measured), max(measured), len(measured))


def ratio(ours: Spread, theirs: Spread) -> float | None:
    """Median over median (None if either is missing or theirs is 0)."""
    if ours.median is None or not theirs.median:
        return None
    return ours.median / theirs.median
