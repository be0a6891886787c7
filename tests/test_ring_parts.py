"""Unit tests of the ring's pure parts: views, pending runs, fragments, wire form, link coalescing."""

from __future__ import annotations

import asyncio

import pytest

from ringq.internal.v1 import peer_pb2
from services.coordinator.group_table import Group, GroupMember
from services.gm import wire
from services.gm.fragments import FragmentError, Reassembler, ReassemblyBudget, split
from services.gm.links import _coalesce, frame
from services.gm.messages import Activity, Catchup, PublisherActivity, PublisherState, RingMessage
from services.gm.pending import PendingRun
from services.gm.view import view_of


def _group(*entries: tuple[str, bool]) -> Group:
    return Group("g", 7, tuple(GroupMember(m, f"n-{m}", alive) for m, alive in entries))


def test_view_links_live_members_in_ring_order() -> None:
    view = view_of(_group(("a", True), ("b", True), ("c", True)))
    assert (view.live["a"].left, view.live["a"].right) == ("c", "b")
    assert (view.live["c"].left, view.live["c"].right) == ("b", "a")


def test_dead_members_are_inherited_by_the_nearest_live_member_downstream() -> None:
    view = view_of(_group(("a", True), ("b", False), ("c", False), ("d", True), ("e", False)))
    assert view.live["d"].aliases == {"b", "c"}
    assert view.live["a"].aliases == {"e"}, "wraps round: e's downstream is a"
    assert (view.live["a"].right, view.live["d"].right) == ("d", "a")
    assert view.owner_of("e") == "a" and view.owner_of("d") == "d" and view.owner_of("zz") is None


def test_a_group_without_live_members_has_an_empty_view() -> None:
    view = view_of(_group(("a", False)))
    assert view.live == {} and view.known == {"a"}


def test_pending_run_appends_and_trims_by_sequence_number() -> None:
    run = PendingRun()
    run.append(1, [b"1", b"2", b"3"])
    run.append(4, [b"4", b"5"])
    assert (run.first_seq, run.end_seq, len(run)) == (1, 6, 5)
    assert run.drop_through(2) == 2
    assert run.bodies() == [b"3", b"4", b"5"] and run.body(4) == b"4"
    assert run.drop_through(4) == 2 and run.bodies() == [b"5"]
    assert run.drop_through(9) == 1 and len(run) == 0 and run.first_seq == 10
    run.append(10, [b"10"])
    with pytest.raises(ValueError, match="cannot append 12"):
        run.append(12, [b"12"])  # a gap


def test_fragments_reassemble_to_the_original() -> None:
    data = bytes(range(256)) * 1000
    fragments = split(data, message_id=3, max_fragment_bytes=4096)
    assert len(fragments) == -(-len(data) // 4096)
    reassembler = Reassembler()
    results = [reassembler.add(f) for f in fragments]
    assert results[:-1] == [None] * (len(fragments) - 1) and results[-1] == data


@pytest.mark.parametrize(
    "bad",
    [
        [peer_pb2.Fragment(message_id=1, index=1, count=2, chunk=b"x")],
        [peer_pb2.Fragment(message_id=1, index=2, count=2, chunk=b"x")],
        [peer_pb2.Fragment(message_id=1, index=0, count=0, chunk=b"x")],
        [peer_pb2.Fragment(message_id=1, index=0, count=3), peer_pb2.Fragment(message_id=1, index=0, count=3)],
        [peer_pb2.Fragment(message_id=1, index=0, count=3), peer_pb2.Fragment(message_id=2, index=1, count=3)],
    ],
)
def test_malformed_fragments_are_refused(bad: list[peer_pb2.Fragment]) -> None:
    reassembler = Reassembler()
    with pytest.raises(FragmentError):
        for fragment in bad:
            reassembler.add(fragment)


def test_an_oversized_message_is_refused() -> None:
    reassembler = Reassembler(max_message_bytes=10)
    reassembler.add(peer_pb2.Fragment(message_id=1, index=0, count=3, chunk=b"123456"))
    with pytest.raises(FragmentError, match="larger"):
        reassembler.add(peer_pb2.Fragment(message_id=1, index=1, count=3, chunk=b"123456"))


def test_partial_messages_of_all_links_share_one_budget() -> None:
    """Found by review: each link could hold a partial message of up to 1 GiB, so unfinished fragment
    sequences on a few links took a node from 48 MiB to 1.8 GiB."""
    budget = ReassemblyBudget(limit_bytes=10)
    first, second = Reassembler(budget=budget), Reassembler(budget=budget)
    first.add(peer_pb2.Fragment(message_id=1, index=0, count=3, chunk=b"123456"))
    with pytest.raises(FragmentError, match="reassembly budget is 10"):
        second.add(peer_pb2.Fragment(message_id=1, index=0, count=3, chunk=b"123456"))
    assert budget.held_bytes == 6
    first.release()  # its link ended
    assert budget.held_bytes == 0
    second.add(peer_pb2.Fragment(message_id=2, index=0, count=2, chunk=b"123456"))
    assert second.add(peer_pb2.Fragment(message_id=2, index=1, count=2, chunk=b"7")) == b"1234567"
    assert budget.held_bytes == 0, "a completed message gives its bytes back"


def test_ring_messages_survive_the_wire() -> None:
    for body in (
        Activity([PublisherActivity("a", 3, [b"x", b"y"], 2), PublisherActivity("b", 1, [], 7)]),
        Activity(),
        Catchup([PublisherState("a", 5, 2, 3, [b"3", b"4", b"5"])], joining=True),
    ):
        message = RingMessage("g", "a", "b", 9, body)
        assert wire.from_proto(wire.to_proto(message)) == message


@pytest.mark.parametrize(
    "mangle",
    [
        lambda m: m.ClearField("group"),
        lambda m: m.ClearField("body"),
        lambda m: m.activity.publishers.add(publisher="p", first_seq=0, pubs=[b"x"]),
        lambda m: m.activity.publishers.add(publisher="", first_seq=1),
    ],
)
def test_malformed_ring_messages_are_refused(mangle: object) -> None:
    message = wire.to_proto(RingMessage("g", "a", "b", 1, Activity()))
    mangle(message)  # type: ignore[operator]
    with pytest.raises(ValueError):
        wire.from_proto(message)


def test_a_busy_link_coalesces_consecutive_activities_of_one_ring() -> None:
    def activity(publisher: str, seq: int, group: str = "g") -> peer_pb2.PeerFrame:
        body = Activity([PublisherActivity(publisher, seq, [b"x"])])
        return frame(ring_message=wire.to_proto(RingMessage(group, "a", "b", 1, body)))

    async def scenario() -> None:
        outbox: asyncio.Queue[peer_pb2.PeerFrame] = asyncio.Queue()
        for item in (activity("a", 2), activity("a", 3), activity("a", 1, group="other"), activity("a", 4)):
            outbox.put_nowait(item)
        head = activity("a", 1)
        carried = _coalesce(head, outbox)
        seqs = [e.first_seq for e in head.ring_message.activity.publishers]
        assert seqs == [1, 2, 3], "merged in order, up to the first frame of another ring"
        assert carried is not None and carried.ring_message.group == "other"
        assert outbox.qsize() == 1

    asyncio.run(scenario())


def test_large_deliveries_are_split_into_bounded_events() -> None:
    from services.gm.messages import Deliver
    from services.node import MAX_DELIVERY_EVENT_BYTES, _events_to_proto

    big = b"x" * (MAX_DELIVERY_EVENT_BYTES // 2 + 1)
    events = _events_to_proto(Deliver("p", 7, [big, big, big, b"small"]))
    assert [e.delivery.first_seq for e in events] == [7, 8, 9]
    assert [len(e.delivery.payloads) for e in events] == [1, 1, 2]
    huge = b"y" * (MAX_DELIVERY_EVENT_BYTES + 1)
    assert len(_events_to_proto(Deliver("p", 1, [huge]))) == 1, "a payload larger than the bound travels alone"
