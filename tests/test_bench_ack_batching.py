"""The acknowledgement policy of `make bench`'s consumers (bench/ack_batching.py): count and time triggers,
the tag a batched ack covers, one ack per message, and the timer that runs the time trigger. No broker."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench.ack_batching import BATCHED, EACH, Ack, AckBatching, AckPolicy, AckTimer


def test_the_count_trigger_acknowledges_up_to_the_latest_tag_with_multiple() -> None:
    batching = AckBatching(AckPolicy(every=3, interval_s=10.0))
    assert batching.delivered(1, 0.0) is None
    assert batching.delivered(2, 0.1) is None
    assert batching.pending == 2
    assert batching.delivered(3, 0.2) == Ack(3, multiple=True)
    assert batching.pending == 0
    assert batching.deadline is None
    # the next batch counts from zero again and covers its own latest tag
    assert batching.delivered(4, 0.3) is None
    assert batching.delivered(5, 0.4) is None
    assert batching.delivered(6, 0.5) == Ack(6, multiple=True)


def test_the_time_trigger_runs_from_the_oldest_unacknowledged_delivery() -> None:
    batching = AckBatching(AckPolicy(every=100, interval_s=0.05))
    assert batching.due(5.0) is None  # nothing pending: nothing due, whatever the time
    batching.delivered(7, 1.0)
    batching.delivered(8, 1.04)
    assert batching.deadline == pytest.approx(1.05)  # the oldest's time, not the latest's
    assert batching.due(1.049) is None
    assert batching.due(1.05) == Ack(8, multiple=True)
    assert batching.pending == 0
    assert batching.due(2.0) is None  # acknowledged once only


def test_whichever_trigger_comes_first_wins() -> None:
    batching = AckBatching(BATCHED)
    now = 0.0
    acks = []
    for tag in range(1, 251):  # 250 deliveries 0.1 ms apart: the count triggers at 100 and 200
        now += 0.0001
        ack = batching.delivered(tag, now)
        if ack is not None:
            acks.append(ack)
    assert acks == [Ack(100, True), Ack(200, True)]
    assert batching.due(now) is None  # the last 50 came within 5 ms
    assert batching.due(now + 0.05) == Ack(250, True)


def test_one_ack_per_message_acknowledges_each_delivery_alone() -> None:
    batching = AckBatching(EACH)
    assert batching.delivered(1, 0.0) == Ack(1, multiple=False)
    assert batching.delivered(2, 0.0) == Ack(2, multiple=False)
    assert batching.pending == 0
    assert batching.deadline is None
    assert batching.flush() is None


def test_a_flush_right_after_the_count_trigger_has_nothing_to_acknowledge() -> None:
    """Regression: the benchmark's drain acknowledged its last delivery again when the count was a
    multiple of its batch (1,000,000 of 500), and the broker refused the unknown tag."""
    batching = AckBatching(AckPolicy(every=2, interval_s=1.0))
    assert batching.delivered(1, 0.0) is None
    assert batching.delivered(2, 0.0) == Ack(2, multiple=True)
    assert batching.flush() is None


def test_flush_and_reset() -> None:
    batching = AckBatching(AckPolicy(every=10, interval_s=1.0))
    batching.delivered(1, 0.0)
    batching.delivered(2, 0.0)
    assert batching.flush() == Ack(2, multiple=True)
    assert batching.flush() is None
    batching.delivered(3, 0.0)
    batching.reset()  # the channel is gone: nothing to acknowledge on the next one
    assert batching.pending == 0
    assert batching.due(100.0) is None
    assert batching.delivered(1, 5.0) is None  # tags start again on a new channel
    assert batching.deadline == pytest.approx(6.0)


def test_policies_are_checked_and_described() -> None:
    with pytest.raises(ValueError):
        AckPolicy(every=0)
    with pytest.raises(ValueError):
        AckPolicy(every=5, interval_s=0.0)
    assert not EACH.batched and BATCHED.batched
    assert (BATCHED.every, BATCHED.interval_s) == (100, 0.05)
    assert EACH.describe() == "one ack per message"
    assert "100 messages or 50 ms" in BATCHED.describe()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeLoop:
    """call_later on a hand-driven clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.timers.append((self.clock.now + delay, callback))

    def advance(self, to: float) -> None:
        self.clock.now = to
        while True:
            due = sorted((t for t in self.timers if t[0] <= to), key=lambda t: t[0])
            if not due:
                return
            self.timers.remove(due[0])
            due[0][1]()


def test_the_timer_sends_what_the_time_triggers_with_one_timer_at_a_time() -> None:
    clock = Clock()
    loop = FakeLoop(clock)
    sent: list[Ack] = []
    timer = AckTimer(AckPolicy(every=3, interval_s=0.05), loop.call_later, sent.append, clock=clock)
    timer.delivered(1)
    loop.advance(0.01)
    timer.delivered(2)
    assert len(loop.timers) == 1  # armed once for the batch
    loop.advance(0.049)
    assert sent == []
    loop.advance(0.05)
    assert sent == [Ack(2, True)]
    assert loop.timers == []  # nothing pending: not armed again
    # a batch the count closes: its timer finds nothing due and is not armed again
    loop.advance(0.1)
    timer.delivered(3)
    timer.delivered(4)
    timer.delivered(5)
    assert sent == [Ack(2, True), Ack(5, True)]
    loop.advance(1.0)
    assert sent == [Ack(2, True), Ack(5, True)]
    assert loop.timers == []


def test_one_ack_per_message_needs_no_timer() -> None:
    clock = Clock()
    loop = FakeLoop(clock)
    sent: list[Ack] = []
    timer = AckTimer(EACH, loop.call_later, sent.append, clock=clock)
    timer.delivered(1)
    timer.delivered(2)
    assert sent == [Ack(1, False), Ack(2, False)]
    assert loop.timers == []


def test_the_timer_after_a_reset_arms_again_on_the_new_loop() -> None:
    clock = Clock()
    old, new = FakeLoop(clock), FakeLoop(clock)
    sent: list[Ack] = []
    timer = AckTimer(AckPolicy(every=100, interval_s=0.05), old.call_later, sent.append, clock=clock)
    timer.delivered(1)
    assert len(old.timers) == 1  # a connection's loop that dies with it: this timer never fires
    timer.reset(new.call_later)
    clock.now = 0.01
    timer.delivered(1)  # tags start again on the new channel
    assert len(new.timers) == 1
    new.advance(0.07)
    assert sent == [Ack(1, True)]
