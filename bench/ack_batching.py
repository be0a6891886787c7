"""When a benchmark consumer acknowledges, and up to which delivery: one policy for every broker's consumer.

Responsible for: the acknowledgement policy of `make bench`'s consumers (bench/reference/rabbitmq_workloads.py
and bench/ringq_workloads.py use this one class, so both brokers are acknowledged alike). Batched, as
users who care about throughput configure it: one acknowledgement with `multiple` covering every delivery
so far, once `every` deliveries are unacknowledged or once the oldest unacknowledged one has waited
`interval_s`, whichever comes first; or one acknowledgement per message (`EACH`).

`AckBatching` is pure: it is told "delivered tag X at time t" and answers with the acknowledgement to send
now, if any. Its time trigger needs a timer in the client: `AckTimer` runs one on any event loop that has
`call_later(delay, callback)` (pika's IOLoop and asyncio's loop both do).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AckPolicy:
    """How a consumer acknowledges (picklable: it travels to the client processes in their config)."""

    every: int = 1  # 1: one acknowledgement per message, without `multiple`
    interval_s: float = 0.0  # batched: the longest a delivery stays unacknowledged

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError("every must be at least 1")
        if self.every > 1 and self.interval_s <= 0:
            raise ValueError("a batched policy needs an interval above 0")

    @property
    def batched(self) -> bool:
        return self.every > 1

    def describe(self) -> str:
        if not self.batched:
            return "one ack per message"
        return f"acks with multiple every {self.every} messages or {self.interval_s * 1000:g} ms, whichever first"


EACH = AckPolicy()
BATCHED = AckPolicy(every=100, interval_s=0.05)


@dataclass(frozen=True)
class Ack:
    """Acknowledge delivery `tag`, and with `multiple` every earlier one of the same channel or stream."""

    tag: int
    multiple: bool


class AckBatching:
    """The unacknowledged deliveries of one channel (or consume stream) and when to acknowledge them."""

    def __init__(self, policy: AckPolicy) -> None:
        self.policy = policy
        self._last_tag = 0
        self._pending = 0
        self._oldest: float | None = None  # when the oldest unacknowledged delivery came

    @property
    def pending(self) -> int:
        """Deliveries taken and not acknowledged yet."""
        return self._pending

    @property
    def deadline(self) -> float | None:
        """When the time trigger acknowledges what is pending (None: nothing is)."""
        return None if self._oldest is None else self._oldest + self.policy.interval_s

    def delivered(self, tag: int, now: float) -> Ack | None:
        """Delivery `tag` was taken at `now`: the acknowledgement to send at once, if any."""
        if not self.policy.batched:
            return Ack(tag, multiple=False)
        self._last_tag = tag
        self._pending += 1
        if self._oldest is None:
            self._oldest = now
        return self.flush() if self._pending >= self.policy.every else None

    def due(self, now: float) -> Ack | None:
        """The time trigger: acknowledge what is pending if the oldest of it has waited long enough."""
        deadline = self.deadline
        return self.flush() if deadline is not None and now >= deadline else None

    def flush(self) -> Ack | None:
        """Acknowledge everything pending now (None if nothing is)."""
        if not self._pending:
            return None
        ack = Ack(self._last_tag, multiple=True)
        self.reset()
        return ack

    def reset(self) -> None:
        """Forget what is pending: its channel or stream is gone (the broker delivers it again)."""
        self._pending = 0
        self._oldest = None


class AckTimer:
    """An `AckBatching` with its time trigger run on an event loop: `delivered` sends what the count triggers,
    a timer (armed while anything is pending, one at a time) sends what the time triggers."""

    def __init__(
        self,
        policy: AckPolicy,
        call_later: Callable[[float, Callable[[], None]], Any],
        send: Callable[[Ack], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.batching = AckBatching(policy)
        self._call_later = call_later
        self._send = send
        self._clock = clock
        self._armed = False

    def delivered(self, tag: int) -> None:
        ack = self.batching.delivered(tag, self._clock())
        if ack is not None:
            self._send(ack)
        self._arm()

    def reset(self, call_later: Callable[[float, Callable[[], None]], Any] | None = None) -> None:
        """A new channel or stream (on a new event loop, if given): forget what is pending."""
        self.batching.reset()
        self._armed = False
        if call_later is not None:
            self._call_later = call_later

    def _arm(self) -> None:
        deadline = self.batching.deadline
        if self._armed or deadline is None:
            return
        self._armed = True
        self._call_later(max(0.0, deadline - self._clock()), self._fire)

    def _fire(self) -> None:
        self._armed = False
        ack = self.batching.due(self._clock())
        if ack is not None:
            self._send(ack)
        self._arm()
