"""Transactions in the queue's pure core (services/queue/master.py `commit`, ops.Transaction): one report,
applied whole by every replica; refused whole with nothing changed; retried without duplicates."""

from __future__ import annotations

import pytest

from ringq.internal.v1 import queue_replication_pb2
from services.queue import wire
from services.queue.master import Publish, PublishOutcome, QueueError, QueueLimits, QueueMaster, Settlement
from services.queue.ops import Deliver, Depth, Enqueue, Message, Settle, Transaction
from tests.test_queue_core import Replicated, publish, same


def _items(*bodies: bytes, first_seq: int = 1) -> list[Publish]:
    return [Publish(body, "tx", first_seq + index, persistent=True) for index, body in enumerate(bodies)]


def test_a_commit_is_one_report_that_every_mirror_applies_whole() -> None:
    q = Replicated()
    q.feed(publish(q.master, b"in-1", b"in-2"))
    delivered = q.feed(q.master.consume("worker", prefetch=10)).deliveries
    step, outcomes = q.master.commit(
        "worker", [Settlement(delivered[1].delivery_tag, True, "ack")], _items(b"out-1", b"out-2"), 0
    )
    assert outcomes == [PublishOutcome.ACCEPTED] * 2
    [transaction, *rest] = step.reports
    assert isinstance(transaction, Transaction) and not any(isinstance(r, Transaction) for r in rest)
    assert [type(change) for change in transaction.changes] == [Settle, Enqueue, Enqueue]
    assert step.last_log_change == 0, "the log's mark names the transaction's report"
    q.feed(step)
    assert [m.body for m in q.master.contents.messages.values()] == [b"out-1", b"out-2"]
    assert all(same(q.master, mirror) for mirror in q.mirrors)


def test_a_commit_with_an_unknown_delivery_tag_is_refused_whole() -> None:
    q = Replicated()
    q.feed(publish(q.master, b"in-1"))
    tag = q.feed(q.master.consume("worker", prefetch=10)).deliveries[0].delivery_tag
    before = dict(q.master.contents.messages)
    with pytest.raises(QueueError) as refused:
        q.master.commit("worker", [Settlement(tag, False, "ack"), Settlement(tag, False, "ack")], _items(b"x"), 0)
    assert refused.value.code == "FAILED_PRECONDITION" and "refused whole" in str(refused.value)
    assert q.master.contents.messages == before and q.master.contents.unacked == {tag}, "nothing applied"
    # A tag acknowledged by an earlier `multiple` of the same transaction counts as gone too.
    with pytest.raises(QueueError):
        q.master.commit("worker", [Settlement(tag, True, "ack"), Settlement(tag, False, "requeue")], [], 0)


def test_a_commit_that_would_not_fit_under_reject_publish_adds_nothing() -> None:
    master = QueueMaster("q", limits=QueueLimits(max_length=3, overflow="reject-publish"))
    publish(master, b"1", b"2")
    with pytest.raises(QueueError) as refused:
        master.commit("", [], _items(b"a", b"b"), 0)
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert master.contents.depth == 2
    _, outcomes = master.commit("", [], _items(b"a"), 0)
    assert outcomes == [PublishOutcome.ACCEPTED] and master.contents.depth == 3


def test_a_retried_commit_adds_nothing_twice() -> None:
    master = QueueMaster("q")
    master.commit("", [], _items(b"a", b"b"), 0)
    step, outcomes = master.commit("", [], _items(b"a", b"b"), 0)
    assert outcomes == [PublishOutcome.DUPLICATE] * 2 and master.contents.depth == 2 and not step.reports


def test_a_transaction_survives_encoding_and_holds_plain_changes_only() -> None:
    message = Message(7, b"body", "tx", 1, True)
    report = Transaction((Settle((1, 2)), Enqueue(message), Deliver((7,))))
    assert wire.decode(wire.encode(report)) == report
    nested = queue_replication_pb2.QueueReport()
    nested.transaction.changes.add().ParseFromString(wire.encode(Depth(3)))
    with pytest.raises(ValueError, match="may not hold a depth report"):
        wire.decode(nested.SerializeToString())
