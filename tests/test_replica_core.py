"""The queue replica's decisions (services/queue/replica_core.py), one rule at a time, on the pure core:
what a confirm waits for, the floor under confirms, what a failing disk does, promotion, recovery and
the mirror's announcements. tests/sim drives the same core under random faults."""

from __future__ import annotations

import dataclasses

import pytest

from services.queue.durability import Claim, Position, elect
from services.queue.master import EPOCH_ID_SHIFT, Publish, PublishOutcome, QueueError, Settlement
from services.queue.ops import (
    Depth,
    Desynchronised,
    Enqueue,
    Message,
    Noticed,
    Persisted,
    Settle,
    SyncBatch,
    SyncDone,
    Synchronised,
    SyncRequest,
    Transaction,
    Undecodable,
)
from services.queue.replica_core import (
    PUBLISH_WINDOW_BEHIND,
    PUBLISH_WINDOW_MIN,
    AbandonSteps,
    AppendToLog,
    Broadcast,
    CompleteStep,
    DeleteRecord,
    DiscardLog,
    EndConsumers,
    FlushLog,
    LogRecovery,
    ReleaseConfirms,
    Role,
    Stop,
    UpdateRecord,
    WatchDisk,
    WriteLog,
)
from tests.replica_cores import HA, Driven, fresh_master, mirror_of, persistent, record

# ------------------------------------------------------------------ what a confirm waits for


def publish(driven: Driven, *bodies: bytes, persistent: bool = True) -> int:
    step_id, outcomes, effects = driven.core.publish([Publish(b, persistent=persistent) for b in bodies], driven.now)
    assert outcomes == [PublishOutcome.ACCEPTED] * len(bodies)
    driven.run(effects)
    return step_id


def role(driven: Driven) -> Role:
    return driven.core.role


def marked(driven: Driven) -> tuple[str, ...]:
    return driven.record.synchronised_mirrors


def confirmed_steps(driven: Driven) -> list[int]:
    steps = [c.step_id for c in driven.take(CompleteStep) if c.confirmed]
    return steps + [s for r in driven.take(ReleaseConfirms) for s in r.step_ids]


def test_a_persistent_message_waits_for_the_ring_the_masters_disk_and_every_synchronised_mirrors_disk() -> None:
    driven = fresh_master(synchronised=("node2",))
    step = publish(driven, b"keep me")
    driven.confirm_ring()
    driven.flush_all()
    assert confirmed_steps(driven) == [], "confirmed before the mirror's disk held it"
    driven.reports("node2.b", 1, Persisted("node2.b", "node1.old", 99))
    assert confirmed_steps(driven) == [], "a report about another master's sequence numbers counted"
    driven.reports("node2.b", 2, Persisted("node2.b", "node1.a", driven.core.next_seq - 1))
    assert confirmed_steps(driven) == [step]


def test_a_transient_message_waits_for_no_disk() -> None:
    driven = fresh_master(synchronised=("node2",))
    step = publish(driven, b"passing", persistent=False)
    assert not driven.take(FlushLog)
    driven.confirm_ring()
    assert confirmed_steps(driven) == [step]


def test_acknowledgements_are_logged_but_wait_for_no_disk() -> None:
    """Found by the failover test: every acknowledgement on a durable queue counted as a disk change,
    so each ack step waited for the mirrors' disks."""
    driven = fresh_master(synchronised=("node2",))
    publish(driven, b"a")
    driven.run(driven.core.consume("c", 0, 0, driven.now))
    driven.confirm_ring()
    driven.flush_all()
    driven.reports("node2.b", 2, Persisted("node2.b", "node1.a", driven.core.next_seq - 1))
    delivered = [d for c in driven.completed() for d in c.step.deliveries]
    assert len(delivered) == 1
    step_id, error, effects = driven.core.settle("c", [Settlement(delivered[0].delivery_tag, False, "ack")], 0)
    driven.run(effects)
    assert error is None
    assert any(isinstance(e, AppendToLog) and e.removed for e in driven.effects)
    driven.confirm_ring()  # no flush, no mirror disk
    assert [c.step_id for c in driven.completed()] == [step_id]


def test_a_mirror_struck_from_the_record_no_longer_holds_confirms_back() -> None:
    driven = fresh_master(synchronised=("node2",))
    step = publish(driven, b"keep me")
    driven.confirm_ring()
    driven.flush_all()
    assert confirmed_steps(driven) == []
    driven.set_record(mirrors=(), synchronised_mirrors=(), policy_definition={"ha-min-synchronised": 0, **HA})
    assert confirmed_steps(driven)[0] == step


def test_a_mirror_that_says_it_is_synchronised_is_required_at_once_and_marked_once_its_disk_holds_the_past() -> None:
    driven = fresh_master(definition={"ha-min-synchronised": 0, **HA})
    first = publish(driven, b"before")
    driven.confirm_ring()
    driven.flush_all()
    assert confirmed_steps(driven) == [first]  # nobody else's disk was required then
    driven.reports("node2.b", 1, Synchronised("node2.b"))
    assert marked(driven) == (), "marked before its disk held the confirmed message"
    second = publish(driven, b"after")
    driven.confirm_ring()
    driven.flush_all()
    assert confirmed_steps(driven) == [], "the announced mirror's disk is required already"
    driven.reports("node2.b", 2, Persisted("node2.b", "node1.a", driven.core.next_seq - 1))
    assert confirmed_steps(driven) == [second]
    assert marked(driven) == ("node2",)


def test_a_mirror_is_marked_again_when_the_unmark_of_its_earlier_word_lands_after_the_mark() -> None:
    """Found by the simulator (seed 20000569): the master heard a mirror's Desynchronised (its disk filled)
    and then its Synchronised (the disk came back) in one delivery, and asked for an unmark and a mark. Record
    updates run concurrently (replica.py spawns each), and the unmark landed last: the mirror, synchronised,
    stayed unmarked for good (with ha-min-synchronised 1 and no other mirror, confirms would have been held)."""
    driven = fresh_master(definition={"ha-min-synchronised": 0, **HA})  # node2 listed, not marked yet
    before = driven.record
    effects = driven.core.on_reports("node2.b", 2, [Desynchronised("node2.b"), Synchronised("node2.b")], driven.now)
    unmark, mark = [e for e in effects if isinstance(e, UpdateRecord)]
    assert "unmark" in unmark.purpose and "mark node2" in mark.purpose
    marked_first = mark.change(before) or before
    driven.record = dataclasses.replace(marked_first, version=before.version + 1)
    driven.run(driven.core.on_record(driven.record, 0))
    unmarked_last = unmark.change(driven.record)
    assert unmarked_last is not None and unmarked_last.synchronised_mirrors == ()
    driven.record = dataclasses.replace(unmarked_last, version=driven.record.version + 1)
    driven.run(driven.core.on_record(driven.record, 0))
    assert marked(driven) == ("node2",), "its last word was Synchronised: marked again"


def test_the_word_of_a_dead_member_does_not_mark_a_replica_restarted_on_its_node() -> None:
    driven = fresh_master(definition={"ha-min-synchronised": 0, **HA})
    driven.reports("node2.b", 1, Synchronised("node2.b"))
    assert marked(driven) == ("node2",)
    driven.run(driven.core.on_members_changed(["node2.c"], ["node2.b"], 0))  # restarted; node2 not struck
    driven.set_record(synchronised_mirrors=())  # unmarked (say, by an unmark of node2.b's, landing late)
    assert marked(driven) == (), "node2.c has said nothing: it is not synchronised"


def test_a_mirror_whose_last_word_was_desynchronised_stays_unmarked() -> None:
    driven = fresh_master(synchronised=("node2",))
    driven.reports("node2.b", 1, Synchronised("node2.b"), Desynchronised("node2.b"))
    assert marked(driven) == ()


def test_steps_complete_in_the_order_they_were_decided_whatever_they_wait_for() -> None:
    """Found by the failover test: a step with acks waited for the disk and a later publish step did not,
    so the later step's deliveries (higher tags) overtook the earlier one's."""
    driven = fresh_master(definition={"ha-min-synchronised": 0, **HA}, mirrors=(), live=())
    slow = publish(driven, b"persistent", persistent=True)  # waits for the disk
    fast = publish(driven, b"transient", persistent=False)  # waits for nothing
    driven.confirm_ring()
    assert [c.step_id for c in driven.completed()] == []
    driven.flush_all()
    assert [c.step_id for c in driven.completed()] == [slow, fast]


def test_broadcasts_are_numbered_in_decision_order() -> None:
    """Found by the benchmark: steps decided in order but broadcast later from tasks let a depth report
    overtake a publish, so mirrors saw a depth that disagreed with theirs."""
    driven = fresh_master(durable=False)
    publish(driven, b"one", persistent=False)
    driven.tick(5_000)  # a depth report is due
    broadcasts = driven.take(Broadcast)
    assert [type(b.reports[0]) for b in broadcasts] == [Enqueue, Depth]
    assert broadcasts[1].first_seq == broadcasts[0].first_seq + len(broadcasts[0].reports)


def test_a_new_term_never_reuses_a_message_id() -> None:
    driven = fresh_master(durable=False)
    publish(driven, b"x", persistent=False)
    master = driven.core.master
    assert master is not None
    assert next(iter(master.core.contents.messages)) == 1 << EPOCH_ID_SHIFT  # epoch 1


# ------------------------------------------------------------------ the floor


def test_below_ha_min_synchronised_steps_complete_but_confirms_are_held_until_a_mirror_is_marked() -> None:
    driven = fresh_master(durable=False)  # ha-mode all: the floor is 1 synchronised mirror
    assert "below ha-min-synchronised" in driven.core.status()
    step = publish(driven, b"one copy only", persistent=False)
    driven.confirm_ring()
    completes = driven.completed()
    assert [(c.step_id, c.confirmed) for c in completes] == [(step, False)]
    driven.reports("node2.b", 1, Synchronised("node2.b"))
    assert driven.record.synchronised_mirrors == ("node2",)
    assert confirmed_steps(driven) == [step]


def test_losing_the_last_synchronised_mirror_holds_confirms_with_an_event() -> None:
    driven = fresh_master(durable=False, synchronised=("node2",))
    driven.run(driven.core.on_members_changed([], ["node2.b"], 0))
    assert any(e.kind == "below_min_synchronised" for e in driven.core.events)
    step = publish(driven, b"alone", persistent=False)
    driven.confirm_ring()
    assert [(c.step_id, c.confirmed) for c in driven.completed()] == [(step, False)]


def test_ha_min_synchronised_zero_confirms_alone() -> None:
    driven = fresh_master(durable=False, definition={"ha-min-synchronised": 0, **HA})
    step = publish(driven, b"alone", persistent=False)
    driven.confirm_ring()
    assert confirmed_steps(driven) == [step]


# ------------------------------------------------------------------ disks that fail


def test_a_mirror_whose_disk_fails_leaves_the_synchronised_mirrors_once_and_comes_back_when_it_writes() -> None:
    driven = mirror_of()
    driven.take(WriteLog)
    driven.flush_all()
    assert Synchronised("node2.b") in driven.said()
    driven.reports("node1.a", 2, persistent(5))
    assert [m.id for a in driven.take(AppendToLog) for m in a.enqueued] == [5]
    driven.take(FlushLog)  # this flush fails:
    failed = driven.run(driven.core.on_disk_failed("No space left on device", 0))
    assert WatchDisk() in failed
    said = driven.said()
    assert Desynchronised("node2.b") in said and any(isinstance(s, Noticed) and s.kind == "disk_failed" for s in said)
    # It keeps mirroring in memory, failing no more and saying nothing more about its disk.
    driven.reports("node1.a", 3, persistent(6), persistent(7), Depth(3, 1))
    assert driven.run(driven.core.on_disk_failed("again", 0)) == []
    assert not driven.take(WriteLog) and not [s for s in driven.said() if isinstance(s, Synchronised)]
    assert [e.kind for e in driven.core.events].count("disk_failed") == 1
    assert "its disk failed" in driven.core.status()
    # Its disk writes again: it writes what it holds into a fresh log, then says it is synchronised.
    driven.run(driven.core.on_disk_writable(0))
    [write] = driven.take(WriteLog)
    assert write.fresh and [m.id for m in write.messages] == [5, 6, 7]
    driven.flush_all()
    assert Synchronised("node2.b") in driven.said()
    assert "disk_recovered" in [e.kind for e in driven.core.events]


def test_a_master_whose_disk_fails_refuses_persistent_publishes_and_holds_what_waited_until_it_writes_again() -> None:
    driven = fresh_master(definition={"ha-min-synchronised": 0, **HA})
    waiting = publish(driven, b"in flight")
    driven.confirm_ring()
    driven.take(FlushLog)
    driven.run(driven.core.on_disk_failed("No space left on device", 0))
    with pytest.raises(QueueError) as refused:
        driven.core.publish([Publish(b"more", persistent=True)], 0)
    assert refused.value.code == "RESOURCE_EXHAUSTED" and "disk" in str(refused.value)
    transient = publish(driven, b"fine", persistent=False)
    driven.confirm_ring()
    assert confirmed_steps(driven) == [], "nothing is confirmed past a step that waits for the failed disk"
    driven.run(driven.core.on_disk_writable(0))
    [write] = driven.take(WriteLog)
    assert write.fresh and [m.body for m in write.messages] == [b"in flight"]
    driven.flush_all()
    assert confirmed_steps(driven) == [waiting, transient]


# ------------------------------------------------------------------ mirrors and masters


def test_a_wiring_mirror_that_joined_before_its_master_announces_itself_when_it_hears_it() -> None:
    """Found by a failing test under load: a wiring mirror said it was synchronised before the master's
    member joined; the master never heard it and the mirror was never marked."""
    wiring = {"ha-mode": "all", "replication": "wiring"}
    driven = Driven("node2", record(replication="wiring", policy_definition=wiring, master_epoch=1))
    driven.run(driven.core.on_joined("node2.b", ["node2.b"], 0))
    assert driven.said() == []
    driven.reports("node1.a", 1, Depth(0, 1))
    assert driven.said() == [Synchronised("node2.b")]


def test_a_mirror_tells_a_promoted_master_how_far_its_disk_goes_in_that_masters_numbers() -> None:
    """Found by the failover test: a promoted master numbers its reports afresh; a mirror that only said
    Persisted above the last number it had said left the new master's confirms waiting for ever."""
    driven = mirror_of(members=("node3.c",), synchronised_mirrors=("node2", "node3"), mirrors=("node3", "node2"))
    driven.reports("node1.a", 2, Depth(0, 1))
    driven.flush_all()
    driven.take(Broadcast)
    driven.reports("node1.a", 100, persistent(1))
    driven.flush_all()
    driven.run(driven.core.on_members_changed([], ["node1.a"], 0))  # node3, the eldest, promotes itself
    driven.set_record(master="node3", master_epoch=2, mirrors=("node2",), synchronised_mirrors=("node2",))
    driven.reports("node3.c", 3, persistent((2 << EPOCH_ID_SHIFT) + 1), Depth(2, 2))
    driven.flush_all()
    said = [s for s in driven.said() if isinstance(s, Persisted)]
    assert said[0] == Persisted("node2.b", "node1.a", 100)
    assert said[-1].master == "node3.c" and said[-1].through_seq == 4


def promoted_mirror_with(message: Message) -> tuple[Driven, int]:
    """node2, the eldest of two synchronised mirrors (node3 the other), holds `message` from node1 and
    promotes itself when node1 dies; with the first sequence number of its broadcasts as master."""
    driven = mirror_of(members=("node3.c",), synchronised_mirrors=("node2", "node3"), mirrors=("node2", "node3"))
    driven.reports("node1.a", 2, Enqueue(message))
    driven.flush_all()
    driven.take(Broadcast)
    driven.run(driven.core.on_members_changed([], ["node1.a"], 0))
    assert role(driven) is Role.MASTER and driven.record.synchronised_mirrors == ("node3",)
    first_seq = driven.take(Broadcast)[0].first_seq
    driven.flush_all()
    driven.confirm_ring()
    driven.completed()
    return driven, first_seq


def test_a_promoted_master_confirms_a_duplicate_only_once_every_listed_mirrors_disk_holds_what_it_inherited() -> None:
    """Found by the simulator (seed 7011531): the old master held a message's confirm for a mirror whose
    disk was full and which the record still listed (the master was cut off from the coordinator), then
    died. The promoted master answered the publisher's resend DUPLICATE at once: a confirm of a message
    that a replica the record listed did not hold on disk."""
    driven, first_seq = promoted_mirror_with(Message(1, b"kept", "p", 1, True))
    step_id, outcomes, effects = driven.core.publish([Publish(b"kept", "p", 1, persistent=True)], 0)
    assert outcomes == [PublishOutcome.DUPLICATE]
    driven.run(effects)
    driven.confirm_ring()
    driven.flush_all()
    assert confirmed_steps(driven) == [], "node3's log has not said it holds what node2 inherited"
    driven.reports("node3.c", 1, Persisted("node3.c", "node2.b", first_seq - 1))
    assert confirmed_steps(driven) == []
    driven.reports("node3.c", 2, Persisted("node3.c", "node2.b", first_seq))
    assert confirmed_steps(driven) == [step_id]


def test_a_promoted_master_confirms_new_messages_and_transient_duplicates_as_before() -> None:
    driven, _ = promoted_mirror_with(Message(1, b"passing", "p", 1, False))
    step_id, outcomes, effects = driven.core.publish([Publish(b"passing", "p", 1)], 0)
    assert outcomes == [PublishOutcome.DUPLICATE]
    driven.run(effects)
    driven.confirm_ring()
    assert confirmed_steps(driven) == [step_id], "a transient message's confirm waits for no disk"
    fresh = publish(driven, b"new")
    driven.confirm_ring()
    driven.flush_all()
    driven.reports("node3.c", 1, Persisted("node3.c", "node2.b", driven.core.next_seq - 1))
    assert confirmed_steps(driven) == [fresh]


def test_a_listed_mirror_tells_a_new_master_how_far_its_log_goes_even_if_nothing_new_is_logged() -> None:
    driven = mirror_of(members=("node3.c",), synchronised_mirrors=("node2", "node3"), mirrors=("node3", "node2"))
    driven.flush_all()
    driven.run(driven.core.on_members_changed([], ["node1.a"], 0))  # node3, the eldest, promotes itself
    driven.set_record(master="node3", master_epoch=2, mirrors=("node2",), synchronised_mirrors=("node2",))
    driven.take(Broadcast)
    driven.reports("node3.c", 3, Depth(0, 2))
    assert driven.said() == [Synchronised("node2.b")]
    driven.flush_all()
    assert driven.said() == [Persisted("node2.b", "node3.c", 3)]


def test_a_listed_mirror_whose_disk_failed_says_so_again_to_a_new_master() -> None:
    """Seed 7011531 again: the old master could not strike the mirror from the record before it died, so
    the new master would have held every persistent confirm until that disk wrote again."""
    driven = mirror_of(members=("node3.c",), synchronised_mirrors=("node2", "node3"), mirrors=("node3", "node2"))
    driven.flush_all()
    driven.run(driven.core.on_disk_failed("No space left on device", 0))
    assert Desynchronised("node2.b") in driven.said()
    driven.run(driven.core.on_members_changed([], ["node1.a"], 0))
    driven.set_record(master="node3", master_epoch=2, mirrors=("node2",), synchronised_mirrors=("node2",))
    driven.reports("node3.c", 3, Depth(0, 2))
    said = driven.said()
    assert said[0] == Desynchronised("node2.b") and isinstance(said[1], SyncRequest)


def test_the_eldest_synchronised_mirror_promotes_itself_by_compare_and_set_and_requeues_what_was_pending() -> None:
    driven = mirror_of(durable=False, synchronised_mirrors=("node2",))
    driven.reports("node1.a", 2, Enqueue(Message(1, b"x")), Depth(1, 1))
    driven.run(driven.core.on_members_changed([], ["node1.a"], 0))
    assert driven.core.role is Role.MASTER and driven.record.master == "node2"
    assert driven.record.master_epoch == 2
    assert any(e.kind == "promoted" for e in driven.core.events)


def test_a_mirror_promotes_when_the_eldest_dies_after_the_master() -> None:
    """Found by the simulator (seed 19183): the master died while the eldest synchronised mirror's node
    was down but not yet recorded dead; when its death came, the others did not look again, and the
    queue waited for its old master's node to come back and recover, with two synchronised mirrors live."""
    driven = mirror_of(
        members=("node3.c",), durable=False, mirrors=("node3", "node2"), synchronised_mirrors=("node3", "node2")
    )
    driven.run(driven.core.on_members_changed([], ["node1.a"], 0))
    assert driven.core.role is Role.MIRROR and driven.record.master == "node1", "node3 is the eldest"
    driven.run(driven.core.on_members_changed([], ["node3.c"], 0))
    assert role(driven) is Role.MASTER and driven.record.master == "node2"
    assert driven.record.master_epoch == 2


def test_a_replica_restarted_on_a_listed_node_is_not_counted_as_its_synchronised_mirror() -> None:
    """Found by the simulator (seed 15006834): node3, the eldest synchronised mirror, restarted; node2 saw
    its new member born before it saw the master and node3's old member die. node2 counted node3 as live
    through the new member, which was still looking for a master and held no claim to promote, and deferred
    to it: the queue waited, with a live synchronised mirror, for the old master's node to recover."""
    driven = mirror_of(members=("node3.c",), mirrors=("node3", "node2"), synchronised_mirrors=("node3", "node2"))
    driven.run(driven.core.on_members_changed(["node3.d"], [], 0))
    driven.run(driven.core.on_members_changed([], ["node1.a", "node3.c"], 0))
    assert role(driven) is Role.MASTER and driven.record.master == "node2"
    assert driven.record.mirrors == ("node3",), "the restarted replica stays a mirror"
    assert driven.record.synchronised_mirrors == (), "but not a synchronised one: it has yet to say so"


def test_a_replica_restarted_on_a_listed_node_counts_once_it_says_it_is_synchronised() -> None:
    driven = mirror_of(members=("node3.c",), mirrors=("node3", "node2"), synchronised_mirrors=("node3", "node2"))
    driven.run(driven.core.on_members_changed(["node3.d"], [], 0))
    driven.reports("node3.d", 1, Synchronised("node3.d"))
    effects = driven.core.on_members_changed([], ["node1.a", "node3.c"], 0)
    assert not [e for e in effects if isinstance(e, UpdateRecord)], "node3 is the eldest and promotes"
    assert role(driven) is Role.MIRROR


def test_a_mirror_that_knows_of_a_newer_master_does_not_try_to_promote() -> None:
    driven = mirror_of(
        members=("node3.c",), durable=False, mirrors=("node2", "node3"), synchronised_mirrors=("node2", "node3")
    )
    driven.set_record(master="node3", master_epoch=2, mirrors=("node2",))
    effects = driven.core.on_members_changed([], ["node1.a"], 0)
    assert not [e for e in effects if isinstance(e, UpdateRecord)], "no compare-and-set bound to fail"
    driven.run(effects)
    assert driven.core.role is Role.MIRROR and driven.record.master == "node3"


def test_a_mirror_takes_over_from_a_newer_master_that_died_before_any_of_its_reports_came() -> None:
    """Found by the simulator (seed 11003439): node3 was promoted, a link cut kept its reports from node2, and
    node3 crashed. node2 still followed the old epoch, and the record named a master it would never hear:
    the queue waited, with a live synchronised mirror, until node3's node came back and recovered from its
    log (or for good, had it not come back)."""
    driven = mirror_of(
        members=("node3.c",), durable=False, mirrors=("node3", "node2"), synchronised_mirrors=("node3", "node2")
    )
    driven.run(driven.core.on_members_changed([], ["node1.a"], 0))  # node3, the eldest, promotes itself
    driven.set_record(master="node3", master_epoch=2, mirrors=("node2",), synchronised_mirrors=("node2",))
    assert role(driven) is Role.MIRROR, "node3 serves: node2 waits to hear it"
    driven.run(driven.core.on_members_changed([], ["node3.c"], 0))
    assert role(driven) is Role.MASTER and driven.record.master == "node2"
    assert driven.record.master_epoch == 3


def test_a_mirror_whose_promotion_lost_to_a_master_already_dead_takes_over_from_it() -> None:
    """The same, with the record late: node2 saw node1 and then node3 die, and asked to take over from
    node1's epoch; the compare-and-set answered that node3 had taken the queue meanwhile (and node3 is
    dead)."""
    driven = mirror_of(
        members=("node3.c",), durable=False, mirrors=("node3", "node2"), synchronised_mirrors=("node3", "node2")
    )
    driven.run(driven.core.on_members_changed([], ["node1.a"], 0))  # node3, the eldest, promotes itself
    driven.record = dataclasses.replace(  # the coordinator has it; node2 has not heard yet
        driven.record,
        master="node3",
        master_epoch=2,
        mirrors=("node2",),
        synchronised_mirrors=("node2",),
        version=driven.record.version + 1,
    )
    driven.run(driven.core.on_members_changed([], ["node3.c"], 0))
    assert role(driven) is Role.MASTER and driven.record.master == "node2"
    assert driven.record.master_epoch == 3


def test_a_mirror_does_not_take_over_from_a_newer_master_whose_node_has_a_live_member() -> None:
    """A restarted node's new member serves (it recovered from its log): the death of its old member is no
    reason to take the queue from it."""
    driven = mirror_of(
        members=("node3.c",), durable=False, mirrors=("node3", "node2"), synchronised_mirrors=("node3", "node2")
    )
    driven.run(driven.core.on_members_changed(["node3.d"], ["node3.c"], 0))
    effects = driven.core.on_record(
        dataclasses.replace(
            driven.record, master="node3", master_epoch=2, mirrors=("node2",), version=driven.record.version + 1
        ),
        0,
    )
    assert not [e for e in effects if isinstance(e, UpdateRecord)]
    driven.run(effects)
    assert role(driven) is Role.MIRROR


def test_a_master_that_stops_answers_every_step_that_waited() -> None:
    """Found by the partition test: a persistent publish waiting for the mirrors' disks was never
    answered when the master's member stopped."""
    driven = fresh_master(synchronised=("node2",))
    step = publish(driven, b"keep me")
    stopped = driven.run(driven.core.on_member_stopped("recorded dead", 0))
    assert AbandonSteps((step,), "its group member stopped: recorded dead") in stopped
    assert any(isinstance(e, EndConsumers) for e in stopped) and isinstance(stopped[-1], Stop)


def test_a_master_the_record_no_longer_names_stops() -> None:
    driven = fresh_master(durable=False, synchronised=("node2",))
    effects = driven.set_record(master="node2", master_epoch=2)
    assert isinstance(effects[-1], Stop)


def test_a_mirror_the_record_lists_again_unmarked_says_it_is_synchronised_again() -> None:
    driven = mirror_of(durable=False)
    driven.reports("node1.a", 2, Depth(0, 1))
    assert Synchronised("node2.b") in driven.said()
    driven.set_record(mirrors=(), synchronised_mirrors=())
    driven.set_record(mirrors=("node2",), synchronised_mirrors=())
    assert driven.said() == [Synchronised("node2.b")]


# ------------------------------------------------------------------ recovery


def recovered(node: str, position: Position, *messages: Message, damaged: bool = False) -> Driven:
    recovery = LogRecovery(tuple(messages), Claim(position, damaged), ("a bad record",) if damaged else ())
    queue = record(master="node1", mirrors=("node2", "node3"), synchronised_mirrors=("node2", "node3"), master_epoch=3)
    driven = Driven(node, queue, recovery)
    driven.run(driven.core.on_joined(f"{node}.x", ["node1.x", "node2.x", "node3.x"], 0))
    return driven


def test_a_replica_that_hears_no_master_claims_and_the_one_whose_intact_log_knows_most_recovers() -> None:
    best = recovered("node2", Position(3, 50), Message(7, b"seven", persistent=True))
    best.tick(2_000)  # nobody served: it claims
    assert role(best) is Role.RECOVERING and best.record.recovery_positions == {"node2": "3.50"}
    assert "waiting for node1, node3" in best.core.status()
    # node3's log is damaged, but its intact prefix still goes further than node2's: it wins.
    best.set_record(recovery_positions={"node1": "3.40", "node2": "3.50", "node3": "3.60 damaged"})
    assert best.core.expected_winner == ("node3", Claim(Position(3, 60), damaged=True))
    # Had its damage come earlier, node2 would win.
    best.set_record(recovery_positions={"node1": "3.40", "node2": "3.50", "node3": "3.45 damaged"})
    assert role(best) is Role.MASTER and best.record.master == "node2" and best.record.master_epoch == 4
    master = best.core.master
    assert master is not None and list(master.core.contents.messages) == [7]
    assert master.core.contents.messages[7].delivery_count == 1, "it may have been delivered before"


def test_a_transient_queue_whose_replicas_all_restarted_is_deleted_not_recovered_empty() -> None:
    """Non-durable queues came back, empty, after a whole-cluster restart (RabbitMQ deletes them):
    the winner of the election deletes the record, guarded by the epoch it saw."""
    queue = record(durable=False, master="node1", mirrors=("node2",), synchronised_mirrors=("node2",), master_epoch=3)
    driven = Driven("node1", queue)
    driven.run(driven.core.on_joined("node1.x", ["node1.x", "node2.x"], 0))
    driven.tick(2_000)  # no master served: it claims
    driven.set_record(recovery_positions={"node1": "0.0", "node2": "0.0"})  # node1, the old master, wins
    assert driven.core.role is not Role.MASTER and driven.record.master_epoch == 3, "it did not take the queue"
    [delete] = driven.take(DeleteRecord)
    assert any(event.kind == "deleted" for event in driven.core.events)
    assert delete.still(driven.record)
    assert not delete.still(dataclasses.replace(driven.record, master_epoch=4)), "someone took it meanwhile"
    # A new transient queue (never served: epoch 0) is taken as before, not deleted.
    fresh = Driven("node1", record(durable=False, master="node1", mirrors=()))
    fresh.run(fresh.core.on_joined("node1.x", ["node1.x"], 0))
    assert fresh.core.role is Role.MASTER and not fresh.take(DeleteRecord)


def test_an_auto_delete_queue_is_deleted_when_its_last_consumer_goes() -> None:
    """auto_delete was stored and never acted on."""
    driven = fresh_master(durable=False, mirrors=(), live=())
    driven.set_record(auto_delete=True)
    driven.run(driven.core.consume("a", 10, 0, 0))
    driven.run(driven.core.consume("b", 10, 0, 0))
    driven.run(driven.core.cancel("a", 0))
    assert not driven.take(DeleteRecord), "a consumer is left"
    driven.run(driven.core.cancel("b", 0))
    [delete] = driven.take(DeleteRecord)
    assert delete.still(driven.record) and not delete.still(dataclasses.replace(driven.record, master_epoch=9))
    # Without auto_delete, the last consumer going changes nothing.
    plain = fresh_master(durable=False, mirrors=(), live=())
    plain.run(plain.core.consume("a", 10, 0, 0))
    plain.run(plain.core.cancel("a", 0))
    assert not plain.take(DeleteRecord)


def test_an_exclusive_queue_does_not_outlive_its_node_even_if_durable() -> None:
    queue = record(durable=True, exclusive_owner="session-1", mirrors=(), master_epoch=2)
    driven = Driven("node1", queue)
    driven.run(driven.core.on_joined("node1.x", ["node1.x"], 0))
    driven.tick(2_000)
    driven.set_record(recovery_positions={"node1": "0.0"})
    assert driven.take(DeleteRecord), "a restarted exclusive queue is deleted, not recovered"


def test_a_mirror_applies_and_logs_a_transaction_as_one_report() -> None:
    driven = mirror_of()
    driven.reports("node1.a", 2, persistent(7), persistent(8))
    driven.take(AppendToLog)
    driven.reports("node1.a", 4, Transaction((Settle((7,)), persistent(9), persistent(10))))
    mirror = driven.core.mirror
    assert mirror is not None and sorted(mirror.contents.messages) == [8, 9, 10]
    [append, mark] = driven.take(AppendToLog)
    assert [m.id for m in append.enqueued] == [9, 10] and list(append.removed) == [7]
    assert mark.position is not None and mark.position.seq == 4, "the log's mark names the transaction's report"


def test_a_mirror_that_cannot_read_a_report_of_its_master_starts_over_and_resyncs() -> None:
    """A report it cannot read may be a change it lacks, which no depth might ever show (an enqueue and an
    acknowledgement missed together): it leaves the synchronised mirrors at once, drops its log and contents,
    and asks for everything; the reports after the unread one keep their sequence numbers."""
    driven = mirror_of()
    driven.take(WriteLog)
    driven.take(DiscardLog)  # the log it found at start, from no master it follows
    driven.flush_all()
    assert Synchronised("node2.b") in driven.said()
    driven.reports("node1.a", 2, persistent(5), Undecodable("not a queue report: truncated"), persistent(6))
    said = driven.said()
    assert Desynchronised("node2.b") in said and SyncRequest("node2.b", 0) in said
    assert driven.take(DiscardLog) == [DiscardLog()]
    mirror = driven.core.mirror
    assert mirror is not None and not mirror.synchronised and sorted(mirror.contents.messages) == [6]
    assert driven.core.applied_seq == 4
    [event] = [e for e in driven.core.events if e.kind == "mirror_desynchronised"]
    assert "could not read a report of the master (not a queue report: truncated)" in event.detail


def test_a_report_nobody_can_read_decides_nothing_for_a_master_or_a_replica_looking_for_one() -> None:
    """An unread message might be a mirror's: a master ignores it, and a replica looking for its master does
    not take its sender for one."""
    master = fresh_master(synchronised=("node2",))
    assert master.reports("node2.b", 5, Undecodable("no kind")) == []
    looking = Driven("node3", record(mirrors=("node2", "node3")))
    looking.run(looking.core.on_joined("node3.c", ["node2.b", "node3.c"], 0))
    role = looking.core.role
    looking.reports("node2.b", 1, Undecodable("no kind"))
    assert looking.core.role is role is not Role.MIRROR


def test_a_stream_group_takes_no_send_without_a_synchronised_mirror_alive() -> None:
    """Two copies at every moment (ordered streams): a group whose mirror is gone or not synchronised
    refuses sends instead of confirming them from one copy."""
    driven = fresh_master(durable=False)
    driven.set_record(name="stream/orders/1")
    with pytest.raises(QueueError) as refused:
        driven.core.publish([Publish(b"m")], 0)
    assert refused.value.code == "UNAVAILABLE" and "one copy" in str(refused.value)
    driven.set_record(synchronised_mirrors=("node2",))
    driven.core.publish([Publish(b"m")], 0)  # taken
    driven.run(driven.core.on_members_changed([], ["node2.b"], 0))
    with pytest.raises(QueueError):
        driven.core.publish([Publish(b"m")], 0)


def test_a_damaged_log_that_wins_is_rewritten_fresh_and_reported() -> None:
    driven = recovered("node1", Position(3, 50), Message(7, b"seven", persistent=True), damaged=True)
    assert any(e.kind == "log_damaged" for e in driven.core.events)
    driven.tick(2_000)
    driven.set_record(recovery_positions={"node1": "3.50 damaged", "node2": "3.10", "node3": "3.20"})
    assert driven.core.role is Role.MASTER
    [write] = driven.take(WriteLog)
    assert write.fresh and [m.id for m in write.messages] == [7]


def test_a_loser_whose_log_is_a_prefix_of_the_winners_keeps_it_and_asks_only_for_what_it_lacks() -> None:
    driven = recovered(
        "node3", Position(3, 40), Message(7, b"seven", persistent=True), Message(9, b"n", persistent=True)
    )
    driven.tick(2_000)
    driven.set_record(recovery_positions={"node1": "3.50", "node2": "3.45", "node3": "3.40"})
    assert driven.core.expected_winner == ("node1", Claim(Position(3, 50)))
    driven.set_record(master="node1", master_epoch=4, synchronised_mirrors=(), recovery_positions={})
    driven.reports("node1.x", 1, Depth(1, 4))
    [request] = [s for s in driven.said() if isinstance(s, SyncRequest)]
    assert request.have == (7, 7, 9, 9)


def test_a_loser_from_an_older_term_starts_over() -> None:
    driven = recovered("node3", Position(2, 400), Message(7, b"seven", persistent=True))
    driven.tick(2_000)
    driven.set_record(recovery_positions={"node1": "3.50", "node2": "3.45", "node3": "2.400"})
    driven.set_record(master="node1", master_epoch=4, synchronised_mirrors=(), recovery_positions={})
    driven.reports("node1.x", 1, Depth(0, 4))
    [request] = [s for s in driven.said() if isinstance(s, SyncRequest)]
    assert request.have == () and driven.core.mirror is not None and not driven.core.mirror.contents.messages


def test_a_replica_that_hears_a_serving_master_follows_it_without_claiming() -> None:
    driven = recovered("node2", Position(3, 50), Message(7, b"seven", persistent=True))
    driven.reports("node1.x", 70, Depth(1, 3))
    assert driven.core.role is Role.MIRROR and driven.record.recovery_positions == {}


def test_a_damaged_loser_tells_the_master_of_its_damage_in_its_own_name() -> None:
    """Found by the disk fault test: the notice was made before the replica's member existed, so the
    master recorded the damage as its own."""
    driven = recovered("node3", Position(3, 10), Message(7, b"seven", persistent=True), damaged=True)
    driven.reports("node1.x", 70, Depth(1, 3))
    notices = [s for s in driven.said() if isinstance(s, Noticed)]
    assert [(n.member, n.kind) for n in notices] == [("node3.x", "log_damaged")]


def test_a_flush_issued_under_one_master_says_nothing_to_the_next() -> None:
    """Found by tests/sim/queue_sim.py (seed 6860): a mirror's flush issued for the old master's report
    110 completed after it followed a new master, and it told the new master its disk held everything to
    110 in the new master's numbering: the new master confirmed messages that disk did not hold."""
    driven = mirror_of(mirrors=("node3", "node2"), synchronised_mirrors=("node3", "node2"))
    driven.take(WriteLog)
    driven.flush_all()
    driven.reports("node1.a", 110, persistent(5))
    [pending_flush] = driven.take(FlushLog)  # not done yet
    driven.take(Broadcast)
    driven.run(driven.core.on_members_changed(["node3.c"], ["node1.a"], 0))
    driven.set_record(master="node3", master_epoch=2, mirrors=("node2",), synchronised_mirrors=("node2",))
    driven.reports("node3.c", 1, Depth(1, 2))
    driven.run(driven.core.on_log_flushed(pending_flush.flush_id, 0))
    assert not [s for s in driven.said() if isinstance(s, Persisted) and s.master == "node3.c"]


def test_equal_logs_of_master_and_mirror_carry_equal_marks() -> None:
    """Found by the whole-cluster restart test: a mirror marked the last report it applied (a depth report
    after the last persistent change), the master its last change, so after a restart the mirror's equal
    log looked ahead, won the election and moved the master for nothing."""
    master = fresh_master(synchronised=("node2",))
    publish(master, b"kept")
    [appended] = [a for a in master.take(AppendToLog) if a.enqueued]
    reports = [r for b in master.take(Broadcast) for r in b.reports]
    mirror = mirror_of()
    mirror.take(WriteLog)
    mirror.flush_all()
    first = appended.position.seq - len(reports) + 1 if appended.position else 0
    mirror.reports("node1.a", first, *reports, Depth(1, 1))  # a depth report follows in the same batch
    marks = [a.position for a in mirror.take(AppendToLog) if a.position is not None]
    assert marks == [appended.position]


def test_a_mirror_synchronised_by_a_sync_marks_its_log_as_the_master_marks_its_own() -> None:
    """Found by the simulator (seeds 15000525, 17000192): a mirror that joined late held everything after its
    sync, but its log's mark still named the last change it had seen (none: 1.0). Every node crashed, the
    master's log lost its last flush (1.63, without the last two confirmed messages), and the election
    preferred that shorter log to the mirror's, which held them: two confirmed messages were lost. The depth
    report it becomes synchronised at names the master's mark (64), and the mirror's log takes it."""
    driven = Driven("node2", record(durable=True, mirrors=("node2",)))
    driven.run(driven.core.on_joined("node2.b", ["node1.a", "node2.b"], 0))
    driven.reports("node1.a", 70, Depth(1, 1, log_mark_seq=64))  # message 64, enqueued at the master's report 64
    [request] = [s for s in driven.said() if isinstance(s, SyncRequest)]
    kept = Message(64, b"kept", "p", 1, True)
    batch = SyncBatch("node2.b", (kept,), (), 1, request.below_id)
    driven.reports("node1.a", 71, batch, SyncDone("node2.b"), Depth(1, 1, log_mark_seq=64))
    [written] = driven.take(WriteLog)
    assert [m.id for m in written.messages] == [64]
    assert written.position == Position(1, 64), "marked as the master's log, which holds the same"

    def winner(master_claim: Claim) -> str | None:
        claims = {"node1": master_claim, "node2": Claim(written.position)}
        return elect(claims, "node1", ("node2",), ("node2",), {"node1", "node2"}, promote_unsynchronised=False)

    assert winner(Claim(Position(1, 63))) == "node2", "the log that holds message 64 recovers the queue"
    assert winner(Claim(Position(1, 64))) == "node1", "equal logs, equal marks: the master keeps the queue"


def test_a_durable_masters_depth_reports_name_its_logs_mark() -> None:
    master = fresh_master(synchronised=("node2",))
    publish(master, b"kept")
    [appended] = [a for a in master.take(AppendToLog) if a.enqueued]
    master.take(Broadcast)
    master.run(master.core.tick(10_000))
    depths = [r for b in master.take(Broadcast) for r in b.reports if isinstance(r, Depth)]
    assert depths and appended.position is not None
    assert {d.log_mark_seq for d in depths} == {appended.position.seq}


def test_a_publish_request_is_one_ring_message_and_a_mirror_applies_it_whole() -> None:
    """A step of several plain changes (here: three enqueues and the delivery to a waiting consumer) is
    broadcast as one Transaction report, one GM sequence number, marked in both logs at that number."""
    driven = fresh_master(synchronised=("node2",))
    driven.run(driven.core.consume("c1", 1, 0, driven.now))
    driven.take(Broadcast)
    driven.take(AppendToLog)
    first_seq = driven.core.next_seq
    publish(driven, b"a", b"b", b"c")
    [broadcast] = driven.take(Broadcast)
    [report] = broadcast.reports
    assert isinstance(report, Transaction)
    assert [type(change).__name__ for change in report.changes] == ["Enqueue", "Enqueue", "Enqueue", "Deliver"]
    assert (broadcast.first_seq, driven.core.next_seq) == (first_seq, first_seq + 1)
    [appended] = driven.take(AppendToLog)
    assert appended.position == Position(driven.core.epoch, first_seq)

    mirror = mirror_of()
    mirror.run(mirror.core.on_reports("node1.a", 1, [Depth(0, 1)], mirror.now))
    mirror.take(AppendToLog)
    mirror.reports("node1.a", 2, report)
    contents = mirror.core.mirror.contents  # type: ignore[union-attr]
    assert (len(contents), contents.depth) == (2, 3), "two ready and one delivered, as on the master"


def test_the_publish_window_holds_publishes_while_prefetch_bound_consumers_wait_on_their_acks() -> None:
    """While every consumer has a prefetch, the messages of publish steps in flight stay under half their
    combined prefetch (at least PUBLISH_WINDOW_MIN); without consumers, or with one that takes without
    limit, nothing is held. Acks and completions open the window again."""
    driven = fresh_master(synchronised=("node2",))
    batch = [b"m"] * 100
    for _ in range(6):
        publish(driven, *batch, persistent=False)
    assert driven.core.may_publish(), "no consumer: no window"
    driven.run(driven.core.consume("c1", 1000, 0, driven.now))
    assert not driven.core.may_publish(), "600 in flight, the window is 500"
    driven.confirm_ring()
    assert driven.core.may_publish()
    for _ in range(5):
        assert driven.core.may_publish()
        publish(driven, *batch, persistent=False)
    assert not driven.core.may_publish()
    driven.run(driven.core.consume("c2", 0, 0, driven.now))
    assert driven.core.may_publish(), "a consumer without a prefetch: no window"

    small = fresh_master(synchronised=("node2",))
    small.run(small.core.consume("small", 10, 0, small.now))
    publish(small, *([b"m"] * 100), persistent=False)  # 10 delivered, 90 ready
    assert small.core.may_publish(), f"{PUBLISH_WINDOW_MIN} at least (less the 90 ready: 100 < 166)"
    publish(small, *([b"m"] * 70), persistent=False)
    assert not small.core.may_publish(), "170 in flight, 160 ready: the window is 96"


def test_the_publish_window_shrinks_while_consumers_are_behind_and_one_request_always_fits() -> None:
    """Ready messages (every consumer holds its full prefetch) count against the window, down to
    PUBLISH_WINDOW_BEHIND: an acknowledgement then waits behind few publishes, and the backlog drains.
    A backlog never stops publishing, and acknowledgements that let it drain open the window again."""
    driven = fresh_master(synchronised=("node2",))
    driven.run(driven.core.consume("c1", 1000, 0, driven.now))
    publish(driven, *([b"m"] * 1000), persistent=False)  # all delivered: the prefetch is full
    driven.confirm_ring()
    tags = [d.delivery_tag for c in driven.completed() for d in c.step.deliveries]
    assert len(tags) == 1000
    publish(driven, *([b"m"] * 300), persistent=False)
    assert not driven.core.may_publish(), "300 in flight, 300 ready: the window is 500 - 300"
    driven.confirm_ring()
    assert driven.core.may_publish()
    publish(driven, *([b"m"] * 150), persistent=False)
    assert not driven.core.may_publish(), "450 ready: the window is at its least"
    driven.confirm_ring()
    publish(driven, *([b"m"] * (PUBLISH_WINDOW_BEHIND - 1)), persistent=False)
    assert driven.core.may_publish(), f"{PUBLISH_WINDOW_BEHIND} at least, however deep the backlog"
    publish(driven, b"m", persistent=False)
    assert not driven.core.may_publish()
    _, error, effects = driven.core.settle("c1", [Settlement(tags[-1], True, "ack")], driven.now)
    driven.run(effects)
    assert error is None
    assert driven.core.may_publish(), "the acknowledgement delivered the backlog: the full window again"
