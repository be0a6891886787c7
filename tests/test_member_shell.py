"""The member shell (services/gm/member.py): what waits on a member is never left waiting when it stops."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.gm.member import ACKS_ALONE_WAIT_SECONDS, SMALL_FLUSH_BYTES, MemberShell
from services.gm.messages import (
    Action,
    Activity,
    Catchup,
    Confirmed,
    Deliver,
    PublisherActivity,
    RingMessage,
    SendRight,
    StartFlushTimer,
    Stopped,
    WatchNeighbours,
)
from services.gm.ring import RingMember


class NoHost:
    flush_interval = 0.002
    join_timeout = 1.0

    def neighbours_changed(self) -> None:
        pass


def test_a_confirmed_broadcast_taken_in_the_pass_that_stops_the_member_fails() -> None:
    """Found by the partition test: a broadcast the core took in the same pass over the inbox as the
    member's stop registered its confirm waiter after _finish had failed every waiter, so the publisher
    behind it was never answered."""

    async def scenario() -> None:
        events: list[Any] = []
        shell = MemberShell(NoHost(), RingMember("g", "node1.a", "node1"), events.append)  # type: ignore[arg-type]
        taken: asyncio.Future[tuple[int, list[Action]]] = asyncio.get_running_loop().create_future()
        done = asyncio.ensure_future(shell._broadcast_done(taken, 1, confirmed=True))
        await asyncio.sleep(0)  # waiting for the core to take it
        taken.set_result((7, []))  # the core took it ...
        shell._finish(Stopped("recorded dead"))  # ... and stopped, before the waiter was registered
        with pytest.raises(ConnectionAbortedError, match="recorded dead"):
            await asyncio.wait_for(done, 1)

    asyncio.run(scenario())


def test_the_host_recomputes_its_links_only_when_a_neighbours_node_changes() -> None:
    """Each view re-read says a member's neighbours again; recomputing the node's wanted links every time
    cost O(members) per view, which with 1,000 idle queues was most of a node's idle CPU (issue 13)."""

    class CountingHost(NoHost):
        calls = 0

        def neighbours_changed(self) -> None:
            self.calls += 1

    async def scenario() -> None:
        host = CountingHost()
        shell = MemberShell(host, RingMember("g", "node1.a", "node1"), lambda event: None)  # type: ignore[arg-type]
        await shell._perform(WatchNeighbours("node2.b", "node2", "node3.c", "node3"))
        await shell._perform(WatchNeighbours("node2.b", "node2", "node3.c", "node3"))  # the same again
        assert host.calls == 1
        await shell._perform(WatchNeighbours("node2.x", "node2", "node3.c", "node3"))  # a new member there
        assert host.calls == 1 and shell.neighbours is not None and shell.neighbours.left == "node2.x"
        await shell._perform(WatchNeighbours("node2.x", "node2", "node4.d", "node4"))  # a new node
        assert host.calls == 2

    asyncio.run(scenario())


class LinkHost(NoHost):
    """A host whose link to the right is always idle, or always has a frame queued."""

    flush_interval = 60.0  # the flush timer never fires within a test

    def __init__(self, idle: bool) -> None:
        self.idle = idle

    def link_idle(self, node: str) -> bool:
        return self.idle


@pytest.mark.parametrize(
    ("buffered_bytes", "at_once"), [(256 * 3, True), (SMALL_FLUSH_BYTES - 1, True), (SMALL_FLUSH_BYTES, False)]
)
def test_a_few_publications_go_at_once_even_when_the_link_to_the_right_is_busy(
    buffered_bytes: int, at_once: bool
) -> None:
    """Light traffic (W2 at 2,000 msgs/s: publish steps of a few messages) found the link to the right
    with a frame queued about one time in seven, and each such publication waited the whole flush interval:
    the p90 of the master's time from broadcast to write was 2.4 ms. A small buffer now goes at once (the
    link's writer merges it with the frame ahead of it); a large one still batches for the interval."""

    async def scenario() -> None:
        shell = MemberShell(LinkHost(idle=False), RingMember("g", "node1.a", "node1"), lambda event: None)  # type: ignore[arg-type]
        await shell._perform(WatchNeighbours("node3.c", "node3", "node2.b", "node2"))
        await shell._perform(StartFlushTimer(buffered_bytes=buffered_bytes))
        await asyncio.sleep(0)  # a flush "at once" is queued after the current input, one loop turn later
        assert shell._inbox.qsize() == (1 if at_once else 0)
        assert shell._flush_armed is not at_once

    asyncio.run(scenario())


def _timers(loop: asyncio.AbstractEventLoop) -> list[float]:
    """The delays of every timer set on `loop` from now on."""
    delays: list[float] = []
    call_later = loop.call_later

    def noting(delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        delays.append(delay)
        return call_later(delay, callback, *args)

    loop.call_later = noting  # type: ignore[method-assign,assignment]
    return delays


class ShortFlushHost(LinkHost):
    flush_interval = 0.002  # the nodes' default


def test_acknowledgements_alone_wait_longer_than_the_flush_interval_even_on_an_idle_link() -> None:
    """At 2,000 msgs/s the master sent 123 ring frames a second of acknowledgements alone (17 % of its ring
    frames, 607 carrying publications), each after the 2 ms flush interval found no publication to ride on.
    They confirm nothing, so they now wait ACKS_ALONE_WAIT_SECONDS for one."""

    async def scenario() -> None:
        shell = MemberShell(ShortFlushHost(idle=True), RingMember("g", "node1.a", "node1"), lambda event: None)  # type: ignore[arg-type]
        await shell._perform(WatchNeighbours("node3.c", "node3", "node2.b", "node2"))
        delays = _timers(asyncio.get_running_loop())
        await shell._perform(StartFlushTimer(acks_only=True))
        await shell._perform(StartFlushTimer(acks_only=True))  # one timer for acknowledgements waiting together
        await asyncio.sleep(0)
        assert shell._inbox.qsize() == 0 and shell._acks_flush_armed
        assert delays == [ACKS_ALONE_WAIT_SECONDS] and ShortFlushHost.flush_interval < ACKS_ALONE_WAIT_SECONDS

    asyncio.run(scenario())


@pytest.mark.parametrize(("buffered_bytes", "at_once"), [(256 * 3, True), (SMALL_FLUSH_BYTES, False)])
def test_acknowledgements_waiting_never_hold_back_a_buffer(buffered_bytes: int, at_once: bool) -> None:
    """A publication after acknowledgements alone goes as it would without them (they ride on it): at once
    when small, after the flush interval when large on a busy link, not after the acknowledgements' wait."""

    async def scenario() -> None:
        shell = MemberShell(ShortFlushHost(idle=False), RingMember("g", "node1.a", "node1"), lambda event: None)  # type: ignore[arg-type]
        await shell._perform(WatchNeighbours("node3.c", "node3", "node2.b", "node2"))
        delays = _timers(asyncio.get_running_loop())
        await shell._perform(StartFlushTimer(acks_only=True))
        await shell._perform(StartFlushTimer(buffered_bytes=buffered_bytes))
        await asyncio.sleep(0)
        assert shell._inbox.qsize() == (1 if at_once else 0)
        assert delays == (
            [ACKS_ALONE_WAIT_SECONDS] if at_once else [ACKS_ALONE_WAIT_SECONDS, ShortFlushHost.flush_interval]
        )

    asyncio.run(scenario())


class RecordingHost(NoHost):
    """Notes, in one list with the application's events, when a frame was handed to a link."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def send_ring_message(self, node: str, message: RingMessage) -> None:
        self.seen.append(f"send {type(message.body).__name__}")
        # As the link's outbox does: queuing a frame wakes the link's writer, one turn of the loop later.
        asyncio.get_running_loop().call_soon(self.seen.append, "the writer's turn")

    def link_idle(self, node: str) -> bool:
        return True


def _passed_on(body: Activity | Catchup) -> list[Action]:
    """What a member's core returns for a frame from its left whose publications it delivers and passes on."""
    return [
        Deliver("node2.b", 5, [b"m5", b"m6"]),
        SendRight(RingMessage("g", "node1.a", "node3.c", 1, body), "node3"),
    ]


def _running_shell(seen: list[str]) -> MemberShell:
    """A member shell whose run loop is started, noting in `seen` what reaches its link and application."""

    def event(action: object) -> None:
        seen.append(f"deliver {action.first_seq}" if isinstance(action, Deliver) else type(action).__name__)

    shell = MemberShell(RecordingHost(seen), RingMember("g", "node1.a", "node1"), event)  # type: ignore[arg-type]
    shell._task = asyncio.ensure_future(shell._run())
    return shell


async def _settled_in_order(shell: MemberShell, seen: list[str]) -> None:
    """After a few turns of the loop: the frame went to the link, the writer had its turn, the publications
    reached the application, and only then the member's next input was taken; the run loop is stopped."""
    for _ in range(10):
        await asyncio.sleep(0)
    assert seen == ["send Activity", "the writer's turn", "deliver 5", "the next input"]
    assert shell._task is not None
    shell._task.cancel()


def test_a_frame_passed_on_goes_to_the_link_before_its_publications_reach_the_application() -> None:
    """Each mirror held a passing frame while it applied its publications (W2 at 2,000 msgs/s: 0.2 ms a
    mirror from read to write). The frame now goes to the link first, and the link's writer gets one turn
    of the event loop before the application sees them; the application still has them before the
    member's next input."""

    async def scenario() -> None:
        seen: list[str] = []
        activity = Activity([PublisherActivity("node2.b", 5, [b"m5", b"m6"], 0)])
        shell = _running_shell(seen)
        shell.post(lambda core: _passed_on(activity))
        shell.post(lambda core: seen.append("the next input") or [])  # type: ignore[func-returns-value]
        await _settled_in_order(shell, seen)

    asyncio.run(scenario())


def test_a_catchup_keeps_its_place_after_the_deliveries() -> None:
    async def scenario() -> None:
        seen: list[str] = []
        shell = MemberShell(RecordingHost(seen), RingMember("g", "node1.a", "node1"), lambda e: seen.append("deliver"))  # type: ignore[arg-type]
        await shell._execute(_passed_on(Catchup([])))
        assert seen[:2] == ["deliver", "send Catchup"]

    asyncio.run(scenario())


def test_prompt_acknowledgements_wait_only_the_flush_interval() -> None:
    """Acknowledgements of a dead member's publications hold back its erasure and the news of its death
    (a queue's promotion waits for it; services/gm/ring.py): they wait the flush interval, not longer."""

    async def scenario() -> None:
        shell = MemberShell(ShortFlushHost(idle=True), RingMember("g", "node1.a", "node1"), lambda event: None)  # type: ignore[arg-type]
        await shell._perform(WatchNeighbours("node3.c", "node3", "node2.b", "node2"))
        delays = _timers(asyncio.get_running_loop())
        await shell._perform(StartFlushTimer(acks_only=True))
        await shell._perform(StartFlushTimer(acks_only=True, prompt=True))
        await asyncio.sleep(0)
        assert shell._inbox.qsize() == 0 and shell._flush_armed and shell._acks_flush_armed
        assert delays == [ACKS_ALONE_WAIT_SECONDS, ShortFlushHost.flush_interval]

    asyncio.run(scenario())


def test_an_input_offered_to_an_idle_member_is_taken_at_once_and_its_frame_goes_first() -> None:
    """A ring message that finds its member between inputs is taken in the reader's own turn of the event
    loop (it used to wait a turn in the inbox for the member's task, and a mirror then gave the link's
    writer one more turn before delivering): the frame reaches the link before `offer` returns, the
    writer still gets its turn before the application sees the publications, and the next input waits."""

    async def scenario() -> None:
        seen: list[str] = []
        activity = Activity([PublisherActivity("node2.b", 5, [b"m5", b"m6"], 0)])
        shell = _running_shell(seen)
        await asyncio.sleep(0)  # the run loop waits on the empty inbox
        shell.offer(lambda core: _passed_on(activity))
        assert seen == ["send Activity"]
        assert shell._inbox.empty()  # what it delivers waits for a callback, not for the member's task
        shell.offer(lambda core: seen.append("the next input") or [])  # type: ignore[func-returns-value]
        assert seen == ["send Activity"]  # queued behind the deliveries
        await _settled_in_order(shell, seen)

    asyncio.run(scenario())


def test_an_input_offered_while_another_is_in_progress_waits_its_turn() -> None:
    """An input offered while the member's run loop is in the middle of one (waiting for the group table,
    say) must not overtake it: the ring's inputs are taken one at a time, in arrival order."""

    async def scenario() -> None:
        seen: list[str] = []
        release: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        shell = MemberShell(RecordingHost(seen), RingMember("g", "node1.a", "node1"), lambda e: None)  # type: ignore[arg-type]

        async def slow_execute(actions: list[Action]) -> None:
            seen.append("actions start")
            await release
            seen.append("actions end")

        shell._execute = slow_execute  # type: ignore[method-assign]
        shell._task = asyncio.ensure_future(shell._run())
        shell.post(lambda core: [])
        for _ in range(3):
            await asyncio.sleep(0)
        assert seen == ["actions start"]
        shell.offer(lambda core: seen.append("second input") or [])  # type: ignore[func-returns-value]
        assert seen == ["actions start"]
        release.set_result(None)
        for _ in range(5):
            await asyncio.sleep(0)
        assert seen == ["actions start", "actions end", "second input", "actions start", "actions end"]
        shell._task.cancel()

    asyncio.run(scenario())


def test_a_failure_in_an_input_taken_at_once_stops_the_member_not_the_link() -> None:
    """An input taken at once runs in the link reader's task: what it raises must stop the member, as it
    would in the member's own loop, and never reach the reader (whose link every group on it shares)."""

    async def scenario() -> None:
        events: list[Any] = []
        shell = MemberShell(RecordingHost([]), RingMember("g", "node1.a", "node1"), events.append)  # type: ignore[arg-type]
        shell._task = asyncio.ensure_future(shell._run())
        await asyncio.sleep(0)

        def failing(core: RingMember) -> list[Action]:
            raise RuntimeError("a bug")

        shell.offer(failing)  # raises nothing
        assert shell.stopped is not None and "a bug" in shell.stopped.reason
        assert isinstance(events[-1], Stopped)
        await asyncio.wait_for(shell._task, 1)  # the run loop ends too

    asyncio.run(scenario())


class NumberingCore:
    """A core that numbers broadcasts from 1 and returns no actions (the shell's side of a broadcast)."""

    id = "node1.a"
    group_name = "g"

    def __init__(self) -> None:
        self.next_seq = 1

    def broadcast(self, bodies: list[bytes]) -> tuple[int, list[Action]]:
        first, self.next_seq = self.next_seq, self.next_seq + len(bodies)
        return first, []


def test_a_confirmed_broadcasts_caller_is_called_from_the_input_that_confirmed_it() -> None:
    """A queue's step completed a turn after its ring round ended: the task awaiting the broadcast woke
    only then. `broadcast_then` calls back from the confirming input itself, in order, and never once
    the member stopped."""

    async def scenario() -> None:
        calls: list[tuple[int, int]] = []
        shell = MemberShell(RecordingHost([]), NumberingCore(), lambda e: None)  # type: ignore[arg-type]
        shell._task = asyncio.ensure_future(shell._run())
        shell.broadcast_then([b"a", b"b"], True, lambda first, last: calls.append((first, last)))
        shell.broadcast_then([b"c"], True, lambda first, last: calls.append((first, last)))
        shell.broadcast_then([b"d"], True, lambda first, last: calls.append((first, last)))
        for _ in range(3):
            await asyncio.sleep(0)
        assert calls == []  # taken, not confirmed
        shell.offer(lambda core: [Confirmed(3)])
        assert calls == [(1, 2), (3, 3)]  # before offer returned
        shell._finish(Stopped("recorded dead"))
        shell._confirm(4)
        assert calls == [(1, 2), (3, 3)]
        shell._task.cancel()

    asyncio.run(scenario())


def test_an_unconfirmed_broadcasts_caller_is_told_its_numbers_once_taken() -> None:
    async def scenario() -> None:
        calls: list[tuple[int, int]] = []
        shell = MemberShell(RecordingHost([]), NumberingCore(), lambda e: None)  # type: ignore[arg-type]
        shell._task = asyncio.ensure_future(shell._run())
        shell.broadcast_then([b"a", b"b", b"c"], False, lambda first, last: calls.append((first, last)))
        for _ in range(3):
            await asyncio.sleep(0)
        assert calls == [(1, 3)]
        shell._task.cancel()

    asyncio.run(scenario())
