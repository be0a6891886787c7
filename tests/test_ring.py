"""Unit tests of the ring state machine (services/gm/ring.py), stepped by hand.

Each test names the part of the ring's header it checks.
"""

from __future__ import annotations

import pytest

from services.coordinator import group_table
from services.coordinator.group_table import Group, GroupMember, MarkMemberDead
from services.gm.messages import (
    Action,
    Activity,
    Catchup,
    ChooseLeft,
    PublisherActivity,
    ReadGroup,
    RequestAddOnRight,
    RingMessage,
    StartFlushTimer,
    WriteGroup,
)
from services.gm.ring import NotJoined, ProtocolViolation, RingMember
from tests.ring_harness import Harness


def test_a_lone_member_delivers_and_confirms_at_once() -> None:
    h = Harness()
    h.start("a")
    assert h.seen["a"].joined is not None and h.seen["a"].joined.members == ("a",)
    assert h.broadcast("a", b"1", b"2") == 1
    assert h.seen["a"].delivered == {"a": [b"1", b"2"]}
    assert h.seen["a"].confirmed == 2


def test_broadcast_goes_round_once_and_confirms_when_back() -> None:
    """Protocol: Broadcast, Activity from the left, pubs turn into acks at the publisher."""
    h = Harness()
    h.ring("a", "b", "c")
    h.broadcast("a", b"x")
    assert h.seen["a"].confirmed == 0  # not yet round the ring
    h.pump()
    for member in "abc":
        assert h.seen[member].delivered["a"] == [b"x"]
    assert h.seen["a"].confirmed == 1
    for member in "abc":
        publishers = h.cores[member].publishers
        assert publishers is not None and not len(publishers["a"].pending), "ack round retires pending"


def test_births_are_reported_before_messages_and_joiners_get_state() -> None:
    h = Harness()
    h.ring("a", "b")
    h.broadcast("a", b"before")
    h.pump()
    h.start("c", via="b")
    h.pump()
    assert h.seen["a"].births == ["b", "c"] and h.seen["b"].births == ["c"]
    assert h.seen["c"].joined is not None and dict(h.seen["c"].joined.start_after)["a"] == 1
    h.broadcast("a", b"after")
    h.pump()
    assert h.seen["c"].delivered == {"a": [b"after"]}, "a joiner delivers only what follows its join point"


def test_a_message_from_someone_not_my_left_is_dropped() -> None:
    """Hard case 3."""
    h = Harness()
    h.ring("a", "b", "c")  # ring order a -> b -> c -> a
    core = h.cores["c"]
    view = core.view
    assert view is not None
    stray = RingMessage("g", "a", "c", view.version, Activity([PublisherActivity("a", 1, [b"stray"])]))
    assert core.on_message(stray) == []
    assert "a" not in h.seen["c"].delivered


def test_a_newer_view_is_read_before_the_message_is_interpreted() -> None:
    """Lemma: a message sent under view N is interpreted under a view >= N."""
    core = RingMember("g", "a", "n")
    actions = core.start()
    assert actions == [ReadGroup(0)]
    h = Harness()
    h.ring("a", "b")
    b = h.cores["b"]
    assert b.view is not None
    future = RingMessage("g", "a", "b", b.view.version + 5, Activity())
    assert b.on_message(future) == [ReadGroup(b.view.version + 5)]


def test_duplicates_from_a_catchup_are_not_delivered_twice() -> None:
    h = Harness()
    h.ring("a", "b", "c")
    h.broadcast("a", b"x")
    h.pump()
    b = h.cores["b"]
    assert b.view is not None
    replay = RingMessage("g", "a", "b", b.view.version, Activity([PublisherActivity("a", 1, [b"x"])]))
    h.run("b", b.on_message(replay))
    assert h.seen["b"].delivered["a"] == [b"x"]


def test_a_dead_members_messages_reach_everyone_through_catchup() -> None:
    """Death: the new left's Catchup supplies what the dead member swallowed (no hole)."""
    h = Harness()
    h.ring("a", "b", "c")  # a -> b -> c -> a
    h.broadcast("a", b"m1")
    h.deliver_one("a", "b")  # b has m1; b dies before forwarding it to c
    h.crash("b")
    h.notice_death("a", "b")
    h.notice_death("c", "b")
    h.pump()
    assert h.seen["c"].delivered["a"] == [b"m1"]
    assert h.seen["a"].confirmed == 1
    assert h.seen["a"].deaths == ["b"] and h.seen["c"].deaths == ["b"], "death reported once erased"
    assert [m.id for m in h.group.members] == ["a", "c"], "the dead member was erased"


def test_the_dead_publishers_in_flight_messages_are_delivered_before_its_death() -> None:
    """members_changed(deaths) only after the dead member's in-flight messages."""
    h = Harness()
    h.ring("a", "b", "c")
    h.broadcast("b", b"last words")
    h.deliver_one("b", "c")
    h.crash("b")
    h.notice_death("a", "b")
    h.notice_death("c", "b")
    h.pump()
    for member in "ac":
        assert h.seen[member].delivered["b"] == [b"last words"]
        assert h.seen[member].deaths == ["b"]


def test_a_newcomer_holds_messages_that_overtake_its_joining_catchup() -> None:
    """Hard case 2 (found by simulation seed 4730): b and then c join right of a;
    c's catchup reaches b before a's joining catchup does."""
    h = Harness()
    h.start("a")
    h.start("b", via="a")
    h.broadcast("a", b"one")  # a sends to b, behind b's joining catchup
    h.start("c", via="a")  # now a -> c -> b
    h.deliver_one("a", "c")  # c adopts a's state
    while h.links.get(("c", "b")):
        h.deliver_one("c", "b")  # c's messages reach b first
    h.pump()
    assert h.seen["b"].delivered == {"a": [b"one"]}
    h.broadcast("a", b"two")
    h.pump()
    assert h.seen["b"].delivered == {"a": [b"one", b"two"]}


def test_a_newcomer_whose_adder_dies_first_rejoins_under_a_new_id() -> None:
    """Hard case 2: state may come only from the member that added us."""
    h = Harness()
    h.ring("a", "b")
    h.start("c", via="b")  # a -> b -> c -> a
    h.drop("b", "c")  # b's joining catchup is lost...
    h.crash("b")  # ...with b
    h.notice_death("c", "b")
    assert h.seen["c"].stopped is not None and h.seen["c"].stopped.rejoin
    assert not h.group.is_alive("c")


def test_an_acknowledgement_lost_in_flight_is_reissued() -> None:
    """Hard case 6 (found by simulation, seeds 5541, 8794, 12752): the owner of a
    dead publisher took its retired-ack mark from its left's Catchup, while the
    acknowledgement that would have retired it was lost in flight and nothing
    else would ever carry it. Without the re-issue, b is never erased."""
    h = Harness()
    h.ring("a", "b", "c")  # a -> b -> c -> a
    h.broadcast("b", b"p")
    for link in [("b", "c"), ("c", "a"), ("a", "b")]:
        h.deliver_one(*link)  # p went round; b's ack(1) waits for a frame to ride on
    h.flush("b")  # none came: b's flush timer sends it to c
    h.deliver_one("b", "c")  # c saw ack(1) and, on its flush timer, passes it to a...
    h.flush("c")
    assert h.drop("c", "a") == 1  # ...but that frame is lost
    h.crash("b")
    h.notice_death("a", "b")  # a's new right is c: a sends c a Catchup
    h.notice_death("c", "b")  # c inherits b; c's right (a) does not change
    h.pump()
    assert [m.id for m in h.group.members] == ["a", "c"], "b erased once the re-issued ack came back"
    for member in "ac":
        assert h.seen[member].deaths == ["b"]
        publishers = h.cores[member].publishers
        assert publishers is not None and "b" not in publishers


def test_a_graceful_leave_hands_over_to_the_ring() -> None:
    h = Harness()
    h.ring("a", "b", "c")
    h.run("b", h.cores["b"].leave())
    h.pump()
    assert h.seen["b"].stopped is not None and h.seen["b"].stopped.reason == "left"
    h.broadcast("a", b"after")
    h.pump()
    assert h.seen["c"].delivered["a"] == [b"after"] and h.seen["a"].confirmed == 1
    assert h.seen["a"].deaths == ["b"]


def test_the_last_member_confirms_what_nobody_else_can_deliver() -> None:
    """Hard case 5."""
    h = Harness()
    h.ring("a", "b")
    h.broadcast("a", b"x")
    h.crash("b")
    h.notice_death("a", "b")
    assert h.seen["a"].confirmed == 1
    assert [m.id for m in h.group.members] == ["a"]


def test_buffered_broadcasts_wait_for_the_flush() -> None:
    core = RingMember("g", "a", "n", max_buffer_bytes=1000)
    h = Harness()
    h.ring("a", "b")
    core = h.cores["a"]
    core.max_buffer_bytes = 1000
    _, actions = core.broadcast([b"small"])
    assert StartFlushTimer(buffered_bytes=len(b"small")) in actions  # the shell decides when it goes
    assert not any(type(a).__name__ == "SendRight" for a in actions)
    flushed = core.flush()
    assert len(flushed) == 1 and isinstance(flushed[0].message.body, Activity)  # type: ignore[union-attr]


def test_a_gap_from_the_left_is_lost_frames_the_next_catchup_recovers() -> None:
    """Hard case 7, found by tests/sim/queue_sim.py: a broken link loses frames in flight, and frames
    queued meanwhile reach the right neighbour before the Catchup its left re-sends on reconnecting.
    That used to stop the member on a "hole" protocol violation."""
    h = Harness()
    h.ring("a", "b", "c")
    h.broadcast("a", b"1")
    h.deliver_one("a", "b")  # b has #1 and forwards it
    h.broadcast("a", b"2")
    assert h.drop("a", "b") == 1  # the link from a to b breaks: #2 is lost
    h.broadcast("a", b"3")  # queued for the new connection: arrives with a gap
    h.deliver_one("a", "b")
    assert h.seen["b"].stopped is None and h.seen["b"].delivered["a"] == [b"1"]
    h.broadcast("a", b"4")
    h.deliver_one("a", "b")  # dropped too: b waits for a's Catchup
    assert h.seen["b"].delivered["a"] == [b"1"]
    h.run("a", h.cores["a"].resend_catchup())  # the link layer's on_reconnect
    h.pump()
    for member in ("b", "c"):
        assert h.seen[member].delivered["a"] == [b"1", b"2", b"3", b"4"], member
    assert h.seen["a"].confirmed == 4


def test_protocol_violations_are_raised_not_absorbed() -> None:
    h = Harness()
    h.ring("a", "b")
    b = h.cores["b"]
    assert b.view is not None
    # An acknowledgement past what the publisher ever sent cannot be lost frames.
    forged = RingMessage("g", "a", "b", b.view.version, Activity([PublisherActivity("a", 1, [], acked_through=9)]))
    with pytest.raises(ProtocolViolation, match="past"):
        b.on_message(forged)


def test_broadcast_before_joining_is_refused() -> None:
    core = RingMember("g", "a", "n")
    with pytest.raises(NotJoined):
        core.broadcast([b"x"])


def test_input_while_the_group_table_is_being_read_is_a_contract_breach() -> None:
    core = RingMember("g", "a", "n")
    core.start()
    with pytest.raises(ProtocolViolation, match="outstanding"):
        core.on_message(RingMessage("g", "b", "a", 1, Catchup([])))


def test_a_message_claiming_a_view_the_table_never_had_is_dropped() -> None:
    """Found by the bad-input tests: one forged frame made a member re-read the
    group table forever, delivering nothing more."""
    h = Harness()
    h.ring("a", "b")
    b = h.cores["b"]
    assert b.view is not None
    forged = RingMessage("g", "intruder", "b", 2**62, Activity([PublisherActivity("a", 99, [b"forged"])]))
    actions = b.on_message(forged)
    assert actions == [ReadGroup(2**62)]
    after_read = b.on_group(h.group)
    assert not any(isinstance(a, ReadGroup) for a in after_read), "one read, then the forged message is gone"
    h.broadcast("a", b"still works")
    h.pump()
    assert h.seen["b"].delivered["a"] == [b"still works"]


def test_a_member_recorded_dead_behind_its_back_stops_when_it_checks() -> None:
    """A member paused past the failure timeout is sent nothing more; the
    shell's periodic membership check is how it learns it must stop."""
    h = Harness()
    h.ring("a", "b", "c")
    h.notice_death("a", "b")  # b is alive but silent: a records it dead
    h.pump()
    assert h.seen["b"].stopped is None
    h.run("b", h.cores["b"].check_membership())
    stopped = h.seen["b"].stopped
    assert stopped is not None and stopped.reason in ("recorded dead", "erased from the group")


def test_a_neighbour_is_recorded_dead_with_its_node_and_the_evidence() -> None:
    """Who is recorded dead: the write names the neighbour, its node and the detector's evidence."""
    h = Harness()
    h.ring("a", "b", "c")
    h.crash("c")
    b = h.cores["b"]
    assert b.view is not None
    actions = b.on_neighbour_down("c", "silent 2.1 s")
    assert actions == [
        WriteGroup(MarkMemberDead(b.view.version, "c", "b"), "neighbour c on node-c down (silent 2.1 s)")
    ]
    h.run("b", actions)
    assert not h.group.is_alive("c")


def test_a_join_target_that_refused_is_chosen_again_and_only_evidence_records_it_dead() -> None:
    """Who is recorded dead: "not ready" re-reads the table; only the shell's finding that the
    target is gone writes its death, with the evidence as the reason."""
    table = Group("g", 1, (GroupMember("a", "node-a"),))
    joiner = RingMember("g", "b", "node-b")
    assert joiner.start() == [ReadGroup(0)]
    assert joiner.on_group(table) == [ChooseLeft(("a",))]
    assert joiner.join_via("a") == [RequestAddOnRight("a", "node-a")]
    assert joiner.on_join_failed("a", down_evidence=None) == [ReadGroup(0)], "a refusal is no death"
    assert joiner.on_group(table) == [ChooseLeft(("a",))]
    joiner.join_via("a")
    assert joiner.on_join_failed("a", down_evidence="silent 2.1 s") == [
        WriteGroup(MarkMemberDead(1, "a", "b", joining=True), "join target a on node-a down (silent 2.1 s)")
    ]


def test_a_member_leaving_records_itself_dead_for_that_reason() -> None:
    h = Harness()
    h.ring("a", "b")
    a = h.cores["a"]
    assert a.view is not None
    assert a.leave() == [WriteGroup(MarkMemberDead(a.view.version, "a", "a"), "left the group")]


def test_a_newcomer_whose_joining_catchup_was_lost_joins_with_the_one_re_sent_on_reconnecting() -> None:
    """Hard case 8, found by the partition test: after a heal, a member added the returning node's
    newcomer and sent its joining Catchup on a link that was dead but not yet noticed; the Catchup it
    re-sent on reconnecting was not marked joining, so the newcomer never started."""
    h = Harness()
    h.ring("a")
    h.broadcast("a", b"1")
    h.start("b", via="a")
    assert h.drop("a", "b") >= 1  # the joining Catchup is lost
    assert h.seen["b"].joined is None
    h.run("a", h.cores["a"].resend_catchup())  # the link layer's on_reconnect
    h.pump()
    assert h.seen["b"].joined is not None
    h.broadcast("a", b"2")
    h.pump()
    assert h.seen["b"].delivered["a"] == [b"2"] and h.seen["a"].confirmed == 2


def test_a_view_from_the_group_watch_reaches_a_newcomer_waiting_for_its_adder() -> None:
    """Found by tests/sim/queue_sim.py (seed 730): views from the watch went only to joined members, so a
    newcomer whose adder stopped before its Catchup never learned it and waited for ever."""
    h = Harness()
    h.ring("a")
    h.start("b", via="a")
    h.drop("a", "b")  # the joining Catchup is lost; then a leaves for good
    h.run("a", h.cores["a"].leave())
    b = h.cores["b"]
    assert b.publishers is None and b.view is not None and b.view.version < h.group.version  # waiting
    h.run("b", b.on_group_watched(h.group))
    assert b.view.version == h.group.version and (b.publishers is not None or b.stopped is not None)
    choosing = RingMember("g", "c", "node-c")
    choosing.start()
    choosing.on_group(h.group)  # it reads the table itself while it chooses whom to join through
    assert choosing.on_group_watched(h.group) == []


def test_a_newcomer_whose_joining_catchup_is_lost_behind_a_later_newcomer_rejoins() -> None:
    """Hard case 9 (found by tests/test_partition_integrity.py): b's joining Catchup is lost with a stale
    link; c joins right of a too, so the Catchup a re-sends on reconnecting goes to c. b would wait for
    ever, and the ring with it; the shell's join timer makes it give up its id and join again."""
    h = Harness()
    h.ring("a")
    h.start("b", via="a")
    assert h.drop("a", "b") == 1, "the joining Catchup, lost"
    h.start("c", via="a")  # ring a -> c -> b -> a
    h.run("a", h.cores["a"].resend_catchup())  # the link to b's node came back: a's right is c now
    h.pump()
    assert h.seen["c"].joined is not None and h.seen["b"].joined is None, "b is stuck without its state"
    h.broadcast("a", b"x")
    h.pump()
    assert h.seen["a"].confirmed == 0, "nothing passes b: the ring is stuck"

    h.run("b", h.cores["b"].join_catchup_overdue())
    stopped = h.seen["b"].stopped
    assert stopped is not None and stopped.rejoin and "no joining Catchup from a" in stopped.reason
    assert not next(m for m in h.group.members if m.id == "b").alive
    for member in "ca":  # the group watch tells them of the new view
        h.run(member, h.cores[member].check_membership())
    h.pump()
    assert h.seen["a"].confirmed == 1, "the ring healed round b"
    assert h.seen["c"].delivered["a"] == [b"x"]


def test_the_join_timer_does_nothing_to_a_member_that_joined_or_is_not_listed_yet() -> None:
    h = Harness()
    h.ring("a", "b")
    assert h.cores["b"].join_catchup_overdue() == [], "joined: it has its state"
    lone = RingMember("g", "z", "node-z")
    assert lone.join_catchup_overdue() == [], "not started"


def _frames(h: Harness, sender: str, receiver: str) -> list[list[PublisherActivity]]:
    return [m.body.entries for m in h.links.get((sender, receiver), []) if isinstance(m.body, Activity)]


def test_an_acknowledgement_rides_on_the_next_frame_going_right() -> None:
    """Protocol: acknowledgements ride along. Under steady traffic the ack round costs no frame of its own."""
    h = Harness()
    h.ring("a", "b", "c")  # a -> b -> c -> a
    h.broadcast("a", b"x")
    for link in [("a", "b"), ("b", "c"), ("c", "a")]:
        h.deliver_one(*link)
    assert h.seen["a"].confirmed == 1, "the confirm does not wait for the acknowledgement"
    assert _frames(h, "a", "b") == [] and "a" in h.flush_due, "ack(1) waits, a flush timer armed"
    h.broadcast("a", b"y")  # the next publication carries it
    assert _frames(h, "a", "b") == [[PublisherActivity("a", 2, [b"y"], 1)]]
    h.deliver_one("a", "b")
    assert _frames(h, "b", "c") == [[PublisherActivity("a", 2, [b"y"], 1)]], "b forwards both in one entry"
    publishers = h.cores["b"].publishers
    assert publishers is not None and publishers["a"].pending.first_seq == 2, "b forgot x"
    h.pump()
    for member in "abc":
        publishers = h.cores[member].publishers
        assert publishers is not None and not len(publishers["a"].pending), "the flush timers retire the rest"


def test_with_no_frame_to_ride_on_an_acknowledgement_waits_for_the_whole_interval() -> None:
    h = Harness()
    h.ring("a", "b")
    actions = h.cores["a"].broadcast([b"x"])[1]
    h.run("a", actions)
    h.deliver_one("a", "b")
    returned = h.cores["a"].on_message(h.links[("b", "a")].popleft())
    assert [type(a).__name__ for a in returned] == ["Confirmed", "StartFlushTimer"]
    assert returned[-1] == StartFlushTimer(acks_only=True), "the shell must not flush it at once"
    h.run("a", returned)
    h.flush("a")
    assert _frames(h, "a", "b") == [[PublisherActivity("a", 2, [], 1)]]
    assert h.cores["a"].flush() == [], "nothing left to send"


class _FlushTimers(Harness):
    """A harness noting every flush timer each member asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.timers: dict[str, list[StartFlushTimer]] = {}

    def run(self, member: str, actions: list[Action]) -> None:
        self.timers.setdefault(member, []).extend(a for a in actions if isinstance(a, StartFlushTimer))
        super().run(member, actions)


def test_acknowledgements_of_a_dead_members_publications_are_prompt() -> None:
    """Found by W3 (SIGKILL of a queue's master): with acknowledgements alone waiting 20 ms for a frame to
    ride on (services/gm/member.py), the gap grew from 0.08 to 0.11-0.13 s in 3 runs of 6. The inheritor
    of the dead master's publications sends them round, and the dead member is erased, and its death
    reported to the queue (which then promotes), only when their acknowledgements are back: each hop
    waited the 20 ms. Those acknowledgements now ask for a prompt flush."""
    h = _FlushTimers()
    h.ring("a", "b", "c")  # a -> b -> c -> a
    h.broadcast("a", b"x")
    h.deliver_one("a", "b")  # b has a#1, c has not
    h.crash("a")
    h.notice_death("b", "a")
    h.pump()
    assert h.seen["b"].deaths == ["a"] and h.seen["c"].deaths == ["a"], "a erased once its acks went round"
    assert h.seen["c"].delivered["a"] == [b"x"]
    prompt = [t for member in "bc" for t in h.timers.get(member, []) if t.acks_only and t.prompt]
    assert prompt, "the acknowledgements of a's publications went round without a prompt flush"
    live = [t for t in h.timers.get("b", []) if t.acks_only and not t.prompt]
    assert live == [], "b acknowledged nothing of a live member"


def test_a_prompt_acknowledgement_asks_again_behind_one_that_waits() -> None:
    """An acknowledgement of a live member waits (its flush timer long); one of a dead member's publications
    deferred behind it must not wait as long: a second flush timer, prompt, is asked for."""
    h = _FlushTimers()
    h.ring("a", "b", "c")  # a -> b -> c -> a
    h.broadcast("b", b"y")
    h.pump()  # b#1 went round and is retired everywhere
    h.broadcast("a", b"x")
    h.deliver_one("a", "b")  # b has a#1, c has not
    h.crash("a")
    h.notice_death("b", "a")

    def acking_a(message: RingMessage) -> bool:
        body = message.body
        return isinstance(body, Activity) and any(e.publisher == "a" and e.acked_through for e in body.entries)

    for _ in range(100):  # until b, a's inheritor, passes on the acknowledgement of a#1
        if h.links.get(("b", "c")) and acking_a(h.links[("b", "c")][0]):
            break
        busy = [link for link, queue in h.links.items() if queue]
        assert busy, "b never acknowledged a#1"
        h.deliver_one(*busy[0])
    core = h.cores["c"]
    core._acks_out["b"] = 1  # an acknowledgement of b#1 waiting at c: re-issued ones are passed on harmlessly
    actions = core.on_message(h.links[("b", "c")].popleft())
    assert StartFlushTimer(acks_only=True, prompt=True) in actions
    h.run("c", actions)
    h.pump()
    assert h.seen["b"].deaths == ["a"] and h.seen["c"].deaths == ["a"]


def test_acknowledgements_waiting_for_a_member_that_dies_become_prompt() -> None:
    """An acknowledgement of a live member's publication waits on the long timer; if that member dies
    meanwhile, the acknowledgement holds back its erasure: the view change asks for a prompt flush."""
    h = _FlushTimers()
    h.ring("a", "b", "c")  # a -> b -> c -> a
    h.broadcast("a", b"x")
    for link in [("a", "b"), ("b", "c"), ("c", "a")]:
        h.deliver_one(*link)
    h.flush("a")  # a sends ack(a#1) alone
    h.deliver_one("a", "b")
    assert h.cores["b"]._acks_out == {"a": 1}, "b holds the acknowledgement, waiting for a frame"
    h.crash("a")
    core = h.cores["b"]
    (write,) = [a for a in core.on_neighbour_down("a", "crashed") if isinstance(a, WriteGroup)]
    outcome, h.group = group_table.apply(h.group, write.change)
    actions = core.on_group_written(outcome, h.group)
    assert StartFlushTimer(acks_only=True, prompt=True) in actions
    h.run("b", actions)
    h.pump()
    assert h.seen["b"].deaths == ["a"] and h.seen["c"].deaths == ["a"]
