"""The mirrored queue's pure core: master decisions, replicated contents, mirrors,
sync and promotion (services/queue/{contents,master,mirror}.py)."""

from __future__ import annotations

import random

import pytest

from services.queue.contents import QueueContents
from services.queue.master import (
    EPOCH_ID_SHIFT,
    GET_CONSUMER,
    Publish,
    PublishOutcome,
    QueueError,
    QueueLimits,
    QueueMaster,
    Step,
)
from services.queue.mirror import QueueMirror
from services.queue.ops import (
    Deliver,
    Depth,
    Desynchronised,
    Enqueue,
    Message,
    Report,
    Requeue,
    Settle,
    Synchronised,
    SyncRequest,
    Transaction,
)


def bodies(step: Step) -> list[bytes]:
    return [d.message.body for d in step.deliveries]


def publish(master: QueueMaster, *items: bytes, now: int = 0, publisher: str = "", first_seq: int = 0) -> Step:
    step, outcomes = master.publish(
        [Publish(b, publisher, first_seq + i if first_seq else 0) for i, b in enumerate(items)], now
    )
    assert all(o is PublishOutcome.ACCEPTED for o in outcomes), outcomes
    return step


class Replicated:
    """A master and mirrors fed every report, as the GM ring would."""

    def __init__(self, limits: QueueLimits | None = None, mirrors: int = 2) -> None:
        self.master = QueueMaster("q", limits=limits)
        self.mirrors = [QueueMirror("q", f"m{i}") for i in range(mirrors)]
        self.said: list[Synchronised] = []

    def feed(self, step: Step) -> Step:
        for report in step.reports:
            self.to_mirrors(report)
        return step

    def to_mirrors(self, report: Report) -> None:
        for mirror in self.mirrors:
            self.said += [s for s in mirror.apply(report) if isinstance(s, Synchronised)]


def same(master: QueueMaster, mirror: QueueMirror) -> bool:
    a, b = master.contents, mirror.contents
    return (
        list(a.ready_ids()) == list(b.ready_ids()) and a.unacked == b.unacked and a.messages.keys() == b.messages.keys()
    )


def test_messages_go_to_a_consumer_in_order_and_acks_remove_them() -> None:
    q = Replicated()
    q.feed(publish(q.master, b"1", b"2", b"3"))
    step = q.feed(q.master.consume("c", prefetch=2))
    assert bodies(step) == [b"1", b"2"], "prefetch 2"
    assert [d.delivery_tag for d in step.deliveries] == [1, 2]
    step = q.feed(q.master.ack("c", 2, multiple=True))
    assert bodies(step) == [b"3"]
    q.feed(q.master.ack("c", 3))
    assert q.master.contents.depth == 0
    assert all(same(q.master, m) for m in q.mirrors)


def test_a_multiple_ack_takes_the_unacknowledged_up_to_its_tag_and_no_further() -> None:
    q = Replicated()
    q.feed(publish(q.master, *(bytes([b]) for b in b"1234567")))
    q.feed(q.master.consume("c", prefetch=7))
    q.feed(q.master.ack("c", 3))  # alone, ahead of the others
    q.feed(q.master.ack("c", 5, multiple=True))  # 1, 2, 4 and 5
    assert sorted(q.master.contents.messages) == [6, 7]
    step = q.feed(q.master.nack("c", 7, multiple=True))  # 6 and 7 requeued: delivered again, in order
    assert bodies(step) == [b"6", b"7"] and all(d.redelivered for d in step.deliveries)
    assert all(same(q.master, m) for m in q.mirrors)


def test_equal_consumers_take_turns_and_higher_priority_goes_first() -> None:
    master = QueueMaster("q")
    master.consume("a", prefetch=0)
    master.consume("b", prefetch=0)
    step = publish(master, b"1", b"2", b"3", b"4")
    assert [d.consumer for d in step.deliveries] == ["a", "b", "a", "b"]
    master.consume("vip", prefetch=1, priority=10)
    step = publish(master, b"5", b"6")
    assert [d.consumer for d in step.deliveries] == ["vip", "a"], "vip first, then the others once it is full"


def test_single_active_consumer_gets_everything_until_it_goes() -> None:
    master = QueueMaster("q", limits=QueueLimits(single_active_consumer=True))
    assert publish(master, b"0").deliveries == [], "no consumer yet: nothing delivered"
    master.consume("first", prefetch=10)
    master.consume("second", prefetch=10)
    step = publish(master, b"1", b"2")
    assert {d.consumer for d in step.deliveries} == {"first"}
    step = master.cancel("first")
    assert [(d.consumer, d.message.body, d.redelivered) for d in step.deliveries] == [
        ("second", b"0", True),
        ("second", b"1", True),
        ("second", b"2", True),
    ]


def test_a_lone_consumer_takes_what_its_prefetch_allows_and_equals_take_turns() -> None:
    master = QueueMaster("q")
    master.consume("lone", prefetch=3)
    master.consume("low", prefetch=0, priority=-1)
    step = publish(master, *(str(i).encode() for i in range(5)))
    assert [d.consumer for d in step.deliveries] == ["lone"] * 3 + ["low"] * 2, "the lower priority takes the rest"
    master = QueueMaster("q")
    for tag in ("a", "b", "c"):
        master.consume(tag, prefetch=3)
    step = publish(master, *(str(i).encode() for i in range(10)))
    assert [d.consumer for d in step.deliveries] == ["a", "b", "c"] * 3, "equals in turn, up to their prefetch"
    assert len(master.contents) == 1


def test_a_requeued_message_keeps_its_place_and_is_marked_redelivered() -> None:
    master = QueueMaster("q")
    publish(master, b"1", b"2")
    master.consume("c", prefetch=1)
    step = master.nack("c", 1, requeue=True)
    assert [(d.message.body, d.redelivered) for d in step.deliveries] == [(b"1", True)], "back at the head"
    step = master.nack("c", 2, requeue=False)  # reject: gone
    assert bodies(step) == [b"2"]
    assert master.contents.depth == 1


def test_an_unknown_delivery_tag_is_refused_and_changes_nothing() -> None:
    master = QueueMaster("q")
    publish(master, b"1")
    master.consume("c", prefetch=1)
    with pytest.raises(QueueError) as refused:
        master.ack("c", 99)
    assert refused.value.code == "FAILED_PRECONDITION" and "99" in str(refused.value)
    assert master.contents.unacked == {1}
    with pytest.raises(QueueError):
        master.ack("nobody", 1)


def test_a_retried_publish_is_dropped_even_after_promotion() -> None:
    q = Replicated()
    q.feed(publish(q.master, b"a", b"b", publisher="p1", first_seq=1))
    step, outcomes = q.master.publish([Publish(b"a", "p1", 1), Publish(b"c", "p1", 3)], 0)
    q.feed(step)
    assert outcomes == [PublishOutcome.DUPLICATE, PublishOutcome.ACCEPTED]
    new_master, _ = q.mirrors[0].promote(QueueLimits(), 1)
    _, outcomes = new_master.publish([Publish(b"c", "p1", 3), Publish(b"d", "p1", 4)], 0)
    assert outcomes == [PublishOutcome.DUPLICATE, PublishOutcome.ACCEPTED]
    newest = max(new_master.contents.messages)
    assert newest == 1 << EPOCH_ID_SHIFT, "a new term numbers its messages from its epoch up"
    assert all(message_id < newest for message_id in q.master.contents.messages), "ids keep growing"


def test_max_length_drops_the_head_to_the_dead_letter_queue() -> None:
    master = QueueMaster("q", limits=QueueLimits(max_length=2, dead_letter_queue="dlq"))
    step = publish(master, b"1", b"2", b"3")
    assert [(d.message.body, d.reason, d.target) for d in step.dead_letters] == [(b"1", "maxlen", "dlq")]
    assert [master.contents.messages[i].body for i in master.contents.ready_ids()] == [b"2", b"3"]


def test_max_length_with_reject_publish_refuses_the_newcomer() -> None:
    master = QueueMaster("q", limits=QueueLimits(max_length=2, overflow="reject-publish"))
    _, outcomes = master.publish([Publish(b"1"), Publish(b"2"), Publish(b"3")], 0)
    assert outcomes == [PublishOutcome.ACCEPTED, PublishOutcome.ACCEPTED, PublishOutcome.REJECTED]
    master.consume("c", prefetch=1)
    _, outcomes = master.publish([Publish(b"4")], 0)
    assert outcomes == [PublishOutcome.ACCEPTED], "room again once one is delivered"


def test_max_length_bytes() -> None:
    master = QueueMaster("q", limits=QueueLimits(max_length_bytes=10))
    publish(master, b"12345", b"12345", b"123")
    assert master.contents.bytes <= 10 and len(master.contents) == 2


def test_messages_expire_at_the_head_on_the_masters_clock() -> None:
    master = QueueMaster("q", limits=QueueLimits(message_ttl_ms=1000, dead_letter_queue="dlq"))
    publish(master, b"old", now=0)
    master.publish([Publish(b"short", expiration_ms=100)], 500)
    publish(master, b"new", now=900)
    assert master.next_expiry_ms() == 1000
    step = master.expire(now_ms=1000)
    assert [(d.message.body, d.reason) for d in step.dead_letters] == [(b"old", "expired"), (b"short", "expired")]
    assert [master.contents.messages[i].body for i in master.contents.ready_ids()] == [b"new"]


def test_a_poison_message_is_dead_lettered_after_the_delivery_limit() -> None:
    master = QueueMaster("q", limits=QueueLimits(delivery_limit=2, dead_letter_queue="dlq"))
    publish(master, b"poison")
    master.consume("c", prefetch=1)
    deliveries = 1
    step = master.nack("c", 1)
    while step.deliveries:
        deliveries += 1
        step = master.nack("c", step.deliveries[0].delivery_tag)
    assert deliveries == 3 and [d.reason for d in step.dead_letters] == ["delivery_limit"]
    assert master.contents.depth == 0


def test_get_with_and_without_acknowledgement() -> None:
    master = QueueMaster("q")
    publish(master, b"1", b"2")
    _, first = master.get(no_ack=True)
    assert first is not None and first.message.body == b"1" and master.contents.depth == 1
    _, second = master.get(no_ack=False)
    assert second is not None and second.consumer == GET_CONSUMER
    master.ack(GET_CONSUMER, second.delivery_tag)
    assert master.get(no_ack=True)[1] is None


def test_purge_removes_ready_messages_only() -> None:
    q = Replicated()
    q.feed(publish(q.master, b"1", b"2", b"3"))
    q.feed(q.master.consume("c", prefetch=1))
    step, count = q.master.purge()
    q.feed(step)
    assert count == 2 and q.master.contents.depth == 1 and all(same(q.master, m) for m in q.mirrors)


def test_a_late_mirror_ignores_what_it_never_had_and_syncs_by_depth() -> None:
    q = Replicated(mirrors=0)
    q.feed(publish(q.master, b"1", b"2"))
    late = QueueMirror("q", "late")
    q.mirrors.append(late)
    q.feed(q.master.depth_report())
    assert not late.synchronised
    q.feed(publish(q.master, b"3"))
    q.feed(q.master.consume("c", prefetch=0))
    q.feed(q.master.ack("c", 2, multiple=True))  # 1 and 2, which the mirror never had
    assert late.contents.depth == q.master.contents.depth == 1
    q.feed(q.master.depth_report())
    assert late.synchronised and q.said == [Synchronised("late")]


def test_sync_while_the_queue_keeps_working() -> None:
    q = Replicated(mirrors=0)
    q.feed(publish(q.master, *[str(i).encode() for i in range(2500)]))
    q.feed(q.master.consume("c", prefetch=100))
    late = QueueMirror("q", "late")
    q.mirrors.append(late)
    q.feed(publish(q.master, b"after join"))
    request = late.request_sync()
    q.master.start_sync(request.member, request.below_id)
    batches = 0
    while "late" in q.master.syncing:
        q.feed(q.master.sync_next("late", batch=700))
        batches += 1
        # meanwhile: publishing, acking and consuming go on
        q.feed(publish(q.master, f"during {batches}".encode()))
        consumer_unacked = sorted(q.master._consumers["c"].unacked)
        q.feed(q.master.ack("c", consumer_unacked[0]))
    assert batches == 4
    assert late.synchronised and same(q.master, late)


def test_promotion_requeues_what_was_pending_acknowledgement() -> None:
    """Also a regression test: contents with no ready message are falsy (len 0),
    and `contents or QueueContents()` once promoted the mirror with empty contents."""
    q = Replicated()
    q.feed(publish(q.master, b"1", b"2", b"3"))
    q.feed(q.master.consume("c", prefetch=2))
    q.feed(q.master.ack("c", 1))
    master, step = q.mirrors[0].promote(QueueLimits(), 1)
    assert master.contents.unacked == set()
    step = master.consume("c2", prefetch=0)
    assert [(d.message.body, d.redelivered) for d in step.deliveries] == [(b"2", True), (b"3", True)]


@pytest.mark.parametrize("seed", range(30))
def test_random_operations_keep_synchronised_mirrors_identical_to_the_master(seed: int) -> None:
    rng = random.Random(seed)
    q = Replicated(
        limits=QueueLimits(max_length=rng.choice([None, 40]), delivery_limit=rng.choice([None, 3])), mirrors=1
    )
    now = 0
    joined_late = False
    for _ in range(400):
        now += rng.randint(0, 30)
        action = rng.random()
        master = q.master
        tags = [t for t in master.consumer_tags]
        if action < 0.35:
            q.feed(master.publish([Publish(bytes([rng.randint(0, 255)]) * rng.randint(1, 8))], now)[0])
        elif action < 0.45 and len(tags) < 3:
            q.feed(master.consume(f"c{now}.{len(tags)}", prefetch=rng.choice([0, 1, 5]), priority=rng.randint(0, 2)))
        elif action < 0.5 and tags:
            q.feed(master.cancel(rng.choice(tags)))
        elif action < 0.8 and tags:
            consumer = rng.choice(tags)
            held = sorted(master._consumers[consumer].unacked)
            if held:
                tag = rng.choice(held)
                kind = rng.random()
                if kind < 0.6:
                    q.feed(master.ack(consumer, tag, multiple=rng.random() < 0.3))
                else:
                    q.feed(master.nack(consumer, tag, requeue=kind < 0.9))
        elif action < 0.85:
            q.feed(master.depth_report())
        elif action < 0.88 and not joined_late:
            joined_late = True
            late = QueueMirror("q", "late")
            q.mirrors.append(late)
            request = late.request_sync()
            master.start_sync(request.member, request.below_id)
        elif "late" in master.syncing:
            q.feed(master.sync_next("late", batch=rng.randint(1, 20)))
    while "late" in q.master.syncing:
        q.feed(q.master.sync_next("late"))
    q.feed(q.master.depth_report())
    for mirror in q.mirrors:
        assert mirror.synchronised, (seed, mirror.member)
        assert same(q.master, mirror), (seed, mirror.member)


def test_a_message_arriving_after_a_later_one_of_its_publisher_is_not_taken_for_a_duplicate() -> None:
    """Found by the failover test: dedup by the highest seq seen dropped seqs 201-400
    when 401-600 arrived first, so confirmed messages were never stored."""
    q = Replicated()
    q.feed(q.master.publish([Publish(b"later", "p", 3)], 0)[0])
    step, outcomes = q.master.publish(
        [Publish(b"first", "p", 1), Publish(b"second", "p", 2), Publish(b"again", "p", 3)], 0
    )
    q.feed(step)
    assert outcomes == [PublishOutcome.ACCEPTED, PublishOutcome.ACCEPTED, PublishOutcome.DUPLICATE]
    seen = q.mirrors[0].contents.publishers["p"]
    assert (seen.through, seen.above) == (3, set()), "mirrors track the same seqs"


def test_a_mirror_that_failed_an_operation_drops_out_and_resyncs() -> None:
    """The inconsistent-error rule (seed 002): an operation that succeeded on the
    master failed on a mirror (here: one report it never applied)."""
    q = Replicated(mirrors=1)
    q.feed(publish(q.master, b"1", b"2"))
    q.feed(q.master.depth_report())
    mirror = q.mirrors[0]
    assert mirror.synchronised
    lost = q.master.publish([Publish(b"3")], 0)[0]  # applied by the master, not by the mirror
    said = mirror.apply(q.master.depth_report().reports[0])
    assert said == [Desynchronised("m0"), SyncRequest("m0", 0)] and not mirror.synchronised
    assert lost.reports, "the master went on"
    q.master.start_sync("m0", 0)
    while "m0" in q.master.syncing:
        q.feed(q.master.sync_next("m0", batch=2))
    assert mirror.synchronised and same(q.master, mirror)


def test_a_mirror_announces_itself_synchronised_only_once_it_knows_its_member_id() -> None:
    """Found by the benchmark: a depth report applied before the mirror's GM
    member had joined made it announce Synchronised('') and never again."""
    mirror = QueueMirror("q", "")
    assert mirror.apply(Depth(0)) == [] and not mirror.synchronised
    mirror.member = "m1"
    assert mirror.apply(Depth(0)) == [Synchronised("m1")] and mirror.synchronised


def test_a_mirror_keeps_no_trace_of_messages_that_passed_through() -> None:
    """A mirror applies enqueues, deliveries and acknowledgements but never asks for its head, which is
    what pruned the ready heap: it kept every id it ever made ready (the per-message growth of mirrors
    in issue 13: 32 bytes per message passed through, never given back)."""
    from services.queue.contents import HEAP_SLACK, QueueContents
    from services.queue.ops import Deliver, Enqueue, Message, Settle

    contents = QueueContents()
    depth = 1000
    for message_id in range(1, 200_001):
        contents.apply(Enqueue(Message(message_id, b"x", "p", message_id)))
        if message_id > depth:  # a steady depth: the oldest goes out as each new one comes in
            done = message_id - depth
            contents.apply(Deliver((done,)))
            contents.apply(Settle((done,)))
    assert contents.depth == depth
    assert len(contents._ready_heap) <= 2 * depth + HEAP_SLACK + 1
    assert contents.head() is not None and contents.head().id == 200_001 - depth  # type: ignore[union-attr]


def _contents_state(contents: QueueContents) -> tuple[object, ...]:
    seqs = {p: (s.through, sorted(s.above)) for p, s in contents.publishers.items()}
    return (
        list(contents.messages),
        sorted(contents.unacked),
        contents.bytes,
        contents.persistent_changes,
        contents.max_id,
        contents.first_enqueued_id,
        seqs,
        list(contents.ready_ids()),
    )


@pytest.mark.parametrize("seed", range(40))
def test_a_run_of_enqueues_in_one_pass_leaves_what_one_at_a_time_leaves(seed: int) -> None:
    """`QueueContents.enqueue_many` (and a transaction's runs, `apply_changes`) against `enqueue` one by one:
    duplicates, persistent messages, several publishers, requeued ids below the new ones, removals."""
    rng = random.Random(seed)
    one, many, transaction = QueueContents(), QueueContents(), QueueContents()
    next_id = 1
    for _ in range(60):
        roll = rng.random()
        if roll < 0.5:
            run = []
            for _ in range(rng.randint(0, 12)):
                reuse = rng.random() < 0.1 and next_id > 1
                message_id = rng.randint(1, next_id - 1) if reuse else next_id
                next_id += not reuse
                publisher = rng.choice(["", "a", "b"])
                seq = rng.randint(0, 30) if publisher else 0
                run.append(Message(message_id, b"x" * rng.randint(0, 9), publisher, seq, rng.random() < 0.3))
            for message in run:
                one.enqueue(message)
            many.enqueue_many(run)
            transaction.apply(Transaction(tuple(Enqueue(m) for m in run)))
            continue
        held = sorted(one.messages)
        ids = tuple(rng.sample(held, min(len(held), rng.randint(1, 4))))
        ready = [i for i in ids if one.is_ready(i)]
        unacked = [i for i in ids if i in one.unacked]
        change: Report = (
            Deliver(tuple(ready)) if roll < 0.7 else Requeue(tuple(unacked)) if roll < 0.85 else Settle(ids)
        )
        for contents in (one, many, transaction):
            contents.apply(change)
        assert _contents_state(many) == _contents_state(one)
        assert _contents_state(transaction) == _contents_state(one)
    assert [m.id for m in many.take_ready(-1)] == [m.id for m in one.take_ready(-1)]
