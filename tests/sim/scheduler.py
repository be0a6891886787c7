"""The simulated clock of the queue simulation: callbacks run in time order, ties in the order they
were scheduled, so a seed replays exactly."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True)
class Timer:
    """A callback due at `time_ms`; `cancel()` keeps it from running."""

    time_ms: int
    order: int
    run: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    def __init__(self, max_events: int) -> None:
        self.now_ms = 0
        self.events = 0
        self.max_events = max_events
        self._queue: list[Timer] = []
        self._order = itertools.count()

    def at(self, delay_ms: int, run: Callable[[], None]) -> Timer:
        timer = Timer(self.now_ms + max(0, delay_ms), next(self._order), run)
        heapq.heappush(self._queue, timer)
        return timer

    def run_until(self, until_ms: int, after_each: Callable[[], None] | None = None) -> None:
        while self._queue and self._queue[0].time_ms <= until_ms:
            timer = heapq.heappop(self._queue)
            if timer.cancelled:
                continue
            self.now_ms = timer.time_ms
            self.events += 1
            if self.events > self.max_events:
                raise AssertionError("the simulation did not settle (event budget exhausted)")
            timer.run()
            if after_each is not None:
                after_each()
        self.now_ms = max(self.now_ms, until_ms) if until_ms != float("inf") else self.now_ms
