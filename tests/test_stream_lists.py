"""The ordered stream's send and consume lists (services/coordinator/stream_lists.py): each rule, then the
simulator (tests/sim/stream_sim.py) over 2,000 seeded random schedules."""

from __future__ import annotations

import dataclasses

import pytest

from services.coordinator.metadata import QueueRecord
from services.coordinator.stream_groups import group_whole
from services.coordinator.stream_lists import StreamLists, invariant_problems
from tests.sim.parallel import run_seeds
from tests.sim.stream_sim import stream_counts

SEEDS = 2000


def test_a_pick_puts_the_group_in_the_consume_list_before_anyone_hears_of_it() -> None:
    lists = StreamLists.new(["a", "b", "c"])
    assert lists.send_group == "a" and lists.consume == ()
    picked, group = lists.pick()
    assert group == "a" and picked.consume == ("a",) and picked.generation("a") == 1
    again, same = picked.pick()
    assert same == "a" and again is picked, "picking the taking group again changes nothing"


def test_a_group_that_lost_a_replica_takes_no_sends_but_is_read_until_drained() -> None:
    lists, _ = StreamLists.new(["a", "b", "c"]).pick()
    lists = lists.replica_lost("a")
    assert lists.send == ("b", "c") and lists.consume == ("a",)
    lists, group = lists.pick()
    assert group == "b" and lists.consume == ("a", "b"), "b's messages are read after a's"
    assert lists.consume_head == "a"
    lists = lists.drained("a", generation=1)
    assert lists.consume == ("b",) and "a" not in lists.send, "a is drained but still missing a replica"
    lists = lists.replicas_back("a")
    assert lists.send == ("b", "c", "a"), "back at the tail, drained and whole"
    assert not invariant_problems(lists)


def test_a_group_with_backlog_may_not_rejoin_the_send_list_until_drained_and_removed() -> None:
    lists, _ = StreamLists.new(["a", "b"]).pick()
    lists = lists.replica_lost("a")
    lists, _ = lists.pick()
    lists = lists.replicas_back("a")
    assert lists.send == ("b",) and not lists.eligible("a")
    assert "consume list" in lists.why_not_eligible("a")
    lists = lists.drained("a", generation=1)
    assert lists.send == ("b", "a")


def test_the_head_taking_sends_stays_and_late_or_stale_reports_change_nothing() -> None:
    lists, _ = StreamLists.new(["a", "b"]).pick()
    assert lists.drained("a", generation=1) is lists, "a still takes sends"
    lists = lists.replica_lost("a")
    lists, _ = lists.pick()
    assert lists.drained("b", generation=1) is lists, "b is not the head"
    assert lists.drained("a", generation=0) is lists, "a report of an older generation"
    lists = lists.drained("a", generation=1)
    assert lists.consume == ("b",)


def test_with_every_group_down_producers_wait() -> None:
    lists = StreamLists.new(["a", "b"]).replica_lost("a").replica_lost("b")
    assert lists.pick() == (lists, None)


def test_bad_streams_are_refused() -> None:
    with pytest.raises(ValueError, match="two or more distinct groups"):
        StreamLists.new(["a"])
    with pytest.raises(ValueError):
        StreamLists.new(["a", "a"])
    with pytest.raises(KeyError, match="no group 'z'"):
        StreamLists.new(["a", "b"]).replica_lost("z")


def test_the_lists_keep_order_under_random_schedules() -> None:
    # (The SDK's own dropping of copies, sim.duplicates, is a second line: the broker drops them first.)
    totals = {"broker_dropped": 0, "producer_failovers": 0, "consumer_failovers": 0, "fenced": 0, "redelivered": 0}
    for counts in run_seeds(stream_counts, range(SEEDS)):
        for name in totals:
            totals[name] += counts[name]
    # Every path the schedules are meant to take was taken.
    assert all(totals.values()), totals  # redelivered: a consumer failover left something unacknowledged


def test_what_the_coordinator_sees_of_groups_moves_them_in_and_out_of_the_send_list() -> None:
    lists, _ = StreamLists.new(["a", "b"]).pick()
    lists = lists.observe({"a": False, "b": True})
    assert lists.send == ("b",) and lists.down == frozenset({"a"})
    lists = lists.observe({"a": True, "b": True})
    assert lists.send == ("b",), "a is whole again but still in the consume list"


def test_a_group_is_whole_with_its_master_and_one_synchronised_mirror_live() -> None:
    group = QueueRecord("/", "stream/s/1", master="n1", mirrors=("n2",), synchronised_mirrors=("n2",))
    assert group_whole(group, {"n1", "n2"})
    assert not group_whole(group, {"n1"}), "the mirror's node is down"
    assert not group_whole(dataclasses.replace(group, synchronised_mirrors=()), {"n1", "n2"})
    assert not group_whole(dataclasses.replace(group, mirrors=()), {"n1", "n2"})
