"""When the coordinator re-places queues (services/coordinator/placement_trigger.py, pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.coordinator.placement_trigger import PlacementTrigger, RecordChange

NODES = ("n1", "n2", "n3")
BEATS = {"n1": 1000, "n2": 1000, "n3": 1000}


def change(key: str, version: int, *replicas: str, at_ms: int = 2000) -> RecordChange:
    return RecordChange(key, version, frozenset(replicas), at_ms)


def run_pass(
    trigger: PlacementTrigger,
    queues: Mapping[str, tuple[int, Sequence[str]]],
    nodes: Sequence[str] = NODES,
    beats: Mapping[str, int] = BEATS,
) -> frozenset[str]:
    """One pass as the shell runs it; returns the nodes it was told were unproven."""
    assert trigger.due(nodes, beats)
    unproven = trigger.unproven_nodes(nodes, beats)
    trigger.pass_starting(nodes, beats)
    trigger.pass_finished(nodes, {k: (v, frozenset(r)) for k, (v, r) in queues.items()})
    return unproven


def settled() -> PlacementTrigger:
    """A trigger after its first pass, which found q at version 3 on every node."""
    trigger = PlacementTrigger()
    run_pass(trigger, {"q": (3, NODES)})
    assert not trigger.due(NODES, BEATS)
    return trigger


def test_the_first_pass_is_due_once_a_node_is_placeable() -> None:
    trigger = PlacementTrigger()
    assert not trigger.due([], {}), "no node: nowhere to place anything"
    assert trigger.due(["n1"], {"n1": 1})


def test_nothing_changed_nothing_due() -> None:
    trigger = settled()
    assert not trigger.due(NODES, {node: beat + 5000 for node, beat in BEATS.items()}), "heartbeats alone"


def test_a_change_of_placeable_nodes_is_due() -> None:
    trigger = settled()
    assert trigger.due(NODES[:2], BEATS)
    assert trigger.due((*NODES, "n4"), BEATS)


def test_a_pass_is_not_woken_by_its_own_writes() -> None:
    trigger = settled()
    trigger.record_changed(RecordChange("n", 1, frozenset({"n2"}), 2000))  # someone declared n
    trigger.pass_starting(NODES, BEATS)
    trigger.record_changed(change("q", 4, "n1", "n2"))  # the log shows the pass's writes during the pass ...
    trigger.record_changed(change("n", 2, "n2", "n3"))
    trigger.pass_finished(NODES, {"q": (4, frozenset({"n1", "n2"})), "n": (2, frozenset({"n2", "n3"}))})
    assert not trigger.due(NODES, BEATS), "... and the pass reports what it wrote"
    assert trigger.unproven_nodes(NODES, BEATS) == frozenset(), "a replica the pass removed was not struck"


def test_someone_elses_change_is_due_and_covered_by_the_next_pass() -> None:
    trigger = settled()
    trigger.record_changed(change("q", 4, "n1", "n2", "n3"))  # e.g. a mirror became synchronised
    assert trigger.due(NODES, BEATS)
    run_pass(trigger, {"q": (4, NODES)})
    assert not trigger.due(NODES, BEATS)


def test_a_change_made_while_a_pass_runs_is_due_after_it() -> None:
    trigger = settled()
    trigger.record_changed(change("q", 4, *NODES))
    assert trigger.due(NODES, BEATS)
    trigger.pass_starting(NODES, BEATS)
    trigger.record_changed(change("r", 1, "n2"))  # declared after the pass read the records
    trigger.pass_finished(NODES, {"q": (4, frozenset(NODES))})
    assert trigger.due(NODES, BEATS)


def test_a_change_the_pass_already_read_is_not_due_again() -> None:
    trigger = settled()
    trigger.pass_starting(NODES, BEATS)
    trigger.pass_finished(NODES, {"q": (4, frozenset(NODES))})  # the pass read version 4 ...
    trigger.record_changed(change("q", 4, *NODES))  # ... before the log showed it
    assert not trigger.due(NODES, BEATS)


def test_a_struck_node_gets_no_new_replica_until_it_heartbeats_after_the_strike() -> None:
    trigger = settled()
    trigger.record_changed(change("q", 4, "n1", "n2", at_ms=2000))  # the master struck n3's mirror
    assert trigger.due(NODES, BEATS)
    assert run_pass(trigger, {"q": (4, ("n1", "n2"))}) == {"n3"}
    beat_at_the_strike = {**BEATS, "n3": 2000}
    assert not trigger.due(NODES, beat_at_the_strike), "a heartbeat must be newer than the strike"
    assert trigger.unproven_nodes(NODES, beat_at_the_strike) == {"n3"}
    alive = {**BEATS, "n3": 2001}
    assert trigger.due(NODES, alive), "n3 proved itself alive: give its replica back"
    assert run_pass(trigger, {"q": (5, NODES)}, beats=alive) == frozenset()
    assert not trigger.due(NODES, alive)


def test_a_promotion_strikes_the_old_master() -> None:
    trigger = settled()
    trigger.record_changed(change("q", 4, "n2", "n3"))  # n2 took over from n1
    assert trigger.due(NODES, BEATS) and trigger.unproven_nodes(NODES, BEATS) == {"n1"}


def test_a_struck_node_that_stops_being_placeable_is_forgotten() -> None:
    trigger = settled()
    trigger.record_changed(change("q", 4, "n1", "n2"))
    run_pass(trigger, {"q": (4, ("n1", "n2"))})
    run_pass(trigger, {"q": (4, ("n1", "n2"))}, nodes=NODES[:2])  # n3's heartbeats stopped
    assert trigger.unproven_nodes(NODES, BEATS) == frozenset(), "it comes back through the placeable nodes"
    assert trigger.due(NODES, BEATS)


def test_a_deleted_queue_needs_no_pass() -> None:
    trigger = settled()
    trigger.record_changed(RecordChange("q", 0, None, 2000))
    assert not trigger.due(NODES, BEATS)
    trigger.record_changed(change("q", 1, "n2"))  # declared again: its versions start over
    assert trigger.due(NODES, BEATS) and trigger.unproven_nodes(NODES, BEATS) == frozenset()


def test_missed_changes_and_failed_passes_are_due() -> None:
    trigger = settled()
    trigger.records_missed()
    assert trigger.due(NODES, BEATS)
    run_pass(trigger, {"q": (9, NODES)})
    assert not trigger.due(NODES, BEATS)
    trigger.record_changed(change("q", 10, *NODES))
    trigger.pass_starting(NODES, BEATS)
    trigger.pass_failed()
    assert trigger.due(NODES, BEATS)


def test_a_strike_a_pass_reads_before_the_trigger_sees_it_keeps_the_node_unproven() -> None:
    """Regression: a master struck n3 from q while a pass was reading the records. The pass read the
    struck record before the change log brought it, so nothing told it n3 was struck: it put the
    replica straight back on n3 (dead, but alive by heartbeat for the liveness timeout), and the change
    log's strike came after the pass had reported a newer version, so it was never counted."""
    trigger = settled()  # knows q at version 3 on n1, n2, n3
    trigger.record_changed(change("other", 1, "n1"))  # something makes a pass due
    assert trigger.due(NODES, BEATS)
    start = trigger.pass_starting(NODES, BEATS)
    assert start.unproven == frozenset()
    # the pass reads q at version 4, struck meanwhile: n3 left it
    assert start.unseen_strikes("q", 4, frozenset({"n1", "n2"})) == {"n3"}
    assert start.unseen_strikes("q", 3, frozenset({"n1", "n2"})) == frozenset(), "not newer than known"
    assert start.unseen_strikes("new", 1, frozenset({"n1"})) == frozenset(), "nothing known to compare with"
    trigger.strikes_seen_by_pass({"n3"}, pass_started_unix_ms=3000)
    trigger.pass_finished(NODES, {"q": (5, frozenset({"n1", "n2"})), "other": (1, frozenset({"n1"}))})
    trigger.record_changed(change("q", 4, "n1", "n2", at_ms=3100))  # the log catches up: nothing new
    trigger.record_changed(change("q", 5, "n1", "n2", at_ms=3100))
    assert trigger.unproven_nodes(NODES, BEATS) == {"n3"}, "the strike the pass saw is remembered"
    assert not trigger.due(NODES, BEATS)
    assert trigger.unproven_nodes(NODES, {**BEATS, "n3": 3001}) == frozenset(), "a heartbeat after the pass"
    assert trigger.due(NODES, {**BEATS, "n3": 3001}), "and its proof of life makes a pass due"


def test_the_pass_start_is_a_copy_the_trigger_does_not_change_under_the_pass() -> None:
    trigger = settled()
    trigger.record_changed(change("q", 4, "n1", "n2"))
    start = trigger.pass_starting(NODES, BEATS)
    assert start.unproven == {"n3"} and start.known["q"] == (4, frozenset({"n1", "n2"}))
    trigger.record_changed(change("q", 6, "n1"))
    trigger.pass_finished(NODES, {"q": (5, frozenset({"n1", "n2"}))})
    trigger.due(NODES, BEATS)  # absorbs version 6
    assert start.known["q"] == (4, frozenset({"n1", "n2"}))
