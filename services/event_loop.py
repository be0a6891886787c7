"""The event loop a node runs on.

Responsible for: running a node's main coroutine on the event loop its operator chose (`--event-loop`):
`uvloop` (libuv's loop, the default) or `asyncio` (the standard library's). Guarantees: both run the same
code with the same semantics (callbacks in the order they were scheduled, the same task and future
types); only the loop's own cost differs. Both loops keep time in whole milliseconds: asyncio's fires a
timer at the first millisecond after its delay, uvloop's at the nearest one (a delay under half a
millisecond fires on the next turn of the loop). A node's timers are all longer (the shortest is the flush
interval, 2 ms by default).

Why uvloop by default: a node is a gRPC asyncio server whose poller thread wakes the loop for every
stream message read or written, several times per message, so the loop's own scheduling work is paid
at every hop. At 2,000 msgs/s (`make bench`'s W2 at the fixed rate, 13 alternating runs) uvloop cut the
three nodes' CPU from 0.72 to 0.67 cores and the median latency by 0.06 ms, both lower in every pair;
saturated W1 and W2 did not move (docs/benchmarks.md, twentieth update).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

UVLOOP = "uvloop"
ASYNCIO = "asyncio"
EVENT_LOOPS = (UVLOOP, ASYNCIO)
DEFAULT_EVENT_LOOP = UVLOOP


def loop_factory(event_loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What creates a loop of kind `event_loop` (None: asyncio's default); ValueError for an unknown kind."""
    if event_loop == UVLOOP:
        import uvloop  # only a process that runs on it loads it

        return uvloop.new_event_loop
    if event_loop == ASYNCIO:
        return None
    raise ValueError(f"unknown event loop {event_loop!r}; choose one of {', '.join(EVENT_LOOPS)}")


def run(main: Coroutine[Any, Any, T], event_loop: str = DEFAULT_EVENT_LOOP) -> T:
    """`asyncio.run(main)` on a loop of kind `event_loop`."""
    with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
        return runner.run(main)
