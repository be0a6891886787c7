"""Queue reports survive their protobuf form unchanged (services/queue/wire.py)."""

from __future__ import annotations

import pytest

from ringq.internal.v1 import queue_replication_pb2
from services.queue import wire
from services.queue.ops import (
    Deliver,
    Depth,
    Desynchronised,
    Discard,
    Enqueue,
    Message,
    Persisted,
    Requeue,
    Settle,
    SyncBatch,
    SyncDone,
    Synchronised,
    SyncRequest,
    Transaction,
    Undecodable,
)

PLAIN = Message(7, b"body", "orders", 3, False, {}, 0, 1_700_000_000_000, 0, 0)
FULL = Message(8, b"\x00" * 300, "orders", 4, True, {"x-death-reason": "expired", "k": ""}, 9, 1, 2, 3)
FRESH_FULL = Message(8, b"\x00" * 300, "orders", 4, True, {"x-death-reason": "expired", "k": ""}, 9, 1, 2, 0)


@pytest.mark.parametrize(
    "report",
    [
        Enqueue(PLAIN),
        Enqueue(FRESH_FULL),
        Deliver((1, 2)),
        Settle((3,)),
        Requeue((4, 5)),
        Discard((6,), "maxlen"),
        Depth(12, epoch=4),
        Depth(12, epoch=4, log_mark_seq=9),
        SyncBatch("node2.a", (PLAIN,), (FULL,)),
        SyncDone("node2.a"),
        SyncRequest("node2.a", 40),
        Synchronised("node2.a"),
        Desynchronised("node2.a"),
        Persisted("node2.a", "node1.b", 99),
    ],
    ids=lambda report: type(report).__name__,
)
def test_a_report_survives_encoding(report: wire.AnyReport) -> None:
    assert wire.decode(wire.encode(report)) == report


def test_malformed_bytes_are_refused() -> None:
    with pytest.raises(ValueError):
        wire.decode(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="without a kind"):
        wire.decode(b"")


def test_each_body_decodes_in_its_place_and_an_unreadable_one_becomes_undecodable() -> None:
    """A ring message's bodies are numbered in order: one that cannot be read keeps its place (what it costs
    is the replica's decision), and one of a kind this node does not know is unreadable too."""
    unknown_kind = queue_replication_pb2.QueueReport()
    unknown_kind.epoch = 1  # a report whose kind (a newer node's) this node's schema lacks parses kindless
    bodies = [wire.encode(Depth(1, 1)), b"\xff\xff\xff", unknown_kind.SerializeToString(), wire.encode(SyncDone("m"))]
    decoded = wire.decode_all(bodies)
    assert decoded[0] == Depth(1, 1) and decoded[3] == SyncDone("m")
    assert [type(d) for d in decoded[1:3]] == [Undecodable, Undecodable]
    assert isinstance(decoded[2], Undecodable) and decoded[2].detail == "queue report without a kind"


def test_an_enqueue_survives_encoding_with_every_field_at_its_default_or_set() -> None:
    """The enqueue encoder sets only what differs from the defaults (services/queue/wire.py)."""
    from services.queue.ops import Enqueue, Message

    plain = Message(1, b"")
    full = Message(
        2**40,
        b"body",
        "publisher",
        7,
        persistent=True,
        headers={"k": "v"},
        priority=9,
        enqueued_at_ms=1_700_000_000_000,
        expires_at_ms=1_700_000_060_000,
    )
    seq_only = Message(3, b"x", publisher_seq=5)
    for message in (plain, full, seq_only):
        assert wire.decode(wire.encode(Enqueue(message))) == Enqueue(message)


def test_an_enqueued_message_travels_undelivered_even_if_the_same_decision_delivered_it() -> None:
    """Found reading a W2 profile: the master hands a message to a waiting consumer in the decision that
    enqueued it, before the shell encodes the broadcast, so the Enqueue went out with a delivery count of 1
    and the mirror's Deliver made it 2 (a redelivery flag and a delivery limit off by one after a failover);
    and a delivered message could not join an EnqueueRun, so W2's publishes were never packed."""
    from services.queue.master import Publish
    from services.queue.mirror import QueueMirror
    from services.queue.replica_core import Broadcast
    from tests.replica_cores import fresh_master

    driven = fresh_master(durable=False)
    driven.core.consume("c1", 10, 0, 0)
    _, _, effects = driven.core.publish([Publish(b"a", "p", 1), Publish(b"b", "p", 2, headers={"k": "v"})], 5)
    [report] = [report for effect in effects if isinstance(effect, Broadcast) for report in effect.reports]
    assert isinstance(report, Transaction)
    changes = queue_replication_pb2.QueueReport.FromString(wire.encode(report)).transaction.changes
    assert [change.WhichOneof("kind") for change in changes] == ["enqueue_run", "enqueue", "deliver"]
    mirror = QueueMirror("q", "node2.b")
    for decoded in wire.decode_all([wire.encode(report)]):
        assert isinstance(decoded, Transaction)
        mirror.apply(decoded)
    master = driven.core.master
    assert master is not None
    counts = {m.id: m.delivery_count for m in master.core.contents.messages.values()}
    assert counts == {m.id: m.delivery_count for m in mirror.contents.messages.values()}
    assert set(counts.values()) == {1}
    older = queue_replication_pb2.QueueReport()  # as a master from before this fix encoded it
    older.enqueue.id, older.enqueue.body, older.enqueue.delivery_count = 7, b"a", 1
    decoded = wire.decode(older.SerializeToString())
    assert isinstance(decoded, Enqueue) and decoded.message.delivery_count == 0


def _enqueues(*messages: Message) -> tuple[Enqueue, ...]:
    return tuple(Enqueue(message) for message in messages)


def _run_sizes(report: Transaction) -> list[int | str]:
    """What each change of `report`'s protobuf form is: a run's message count, or the kind's name."""
    parsed = queue_replication_pb2.QueueReport.FromString(wire.encode(report))
    kinds: list[int | str] = []
    for change in parsed.transaction.changes:
        kind = change.WhichOneof("kind")
        kinds.append(len(change.enqueue_run.bodies) if kind == "enqueue_run" else str(kind))
    return kinds


def test_a_publish_requests_enqueues_travel_as_one_run_and_come_back_as_they_were() -> None:
    """A step's plain enqueues with consecutive ids and the same publisher, persistence and enqueue time
    travel packed as one EnqueueRun; they decode into the same Enqueue reports, in order."""
    run = [Message(100 + i, bytes([i]) * 256, "orders", 10 + i, False, enqueued_at_ms=5) for i in range(50)]
    report = Transaction((*_enqueues(*run), Deliver((100, 101))))
    assert wire.decode(wire.encode(report)) == report
    assert _run_sizes(report) == [50, "deliver"]


def test_a_run_breaks_where_a_message_differs_and_every_message_survives() -> None:
    """A gap in the ids, another publisher, persistence or enqueue time, or a message with headers, a
    priority or an expiry of its own starts a new run or travels alone; a delivery count does not (an
    enqueued message travels undelivered)."""
    messages = [
        Message(1, b"a", "p", 1, enqueued_at_ms=5),
        Message(2, b"b", "p", 2, enqueued_at_ms=5),
        Message(4, b"gap", "p", 3, enqueued_at_ms=5),
        Message(5, b"other publisher", "q", 1, enqueued_at_ms=5),
        Message(6, b"persistent", "q", 2, persistent=True, enqueued_at_ms=5),
        Message(7, b"later", "q", 3, persistent=True, enqueued_at_ms=6),
        Message(8, b"headers", "q", 4, persistent=True, headers={"k": "v"}, enqueued_at_ms=6),
        Message(9, b"priority", "q", 5, persistent=True, priority=3, enqueued_at_ms=6),
        Message(10, b"expiry", "q", 6, persistent=True, enqueued_at_ms=6, expires_at_ms=60),
        Message(11, b"delivered", "q", 7, persistent=True, enqueued_at_ms=6, delivery_count=1),
        Message(12, b"joins", "q", 8, persistent=True, enqueued_at_ms=6),
        Message(13, b"no publisher", enqueued_at_ms=6),
        Message(14, b"no publisher either", enqueued_at_ms=6),
    ]
    report = Transaction((Settle((1,)), *_enqueues(*messages), Discard((1,), "maxlen")))
    undelivered = [*messages[:9], Message(11, b"delivered", "q", 7, persistent=True, enqueued_at_ms=6), *messages[10:]]
    expected = Transaction((Settle((1,)), *_enqueues(*undelivered), Discard((1,), "maxlen")))
    assert wire.decode(wire.encode(report)) == expected
    assert _run_sizes(report) == ["settle", 2, 1, 1, 1, 1, "enqueue", "enqueue", "enqueue", 2, 2, "discard"]


def test_malformed_runs_are_refused() -> None:
    alone = queue_replication_pb2.QueueReport()
    alone.enqueue_run.first_id = 1
    alone.enqueue_run.bodies.append(b"x")
    with pytest.raises(ValueError, match="outside a transaction"):
        wire.decode(alone.SerializeToString())
    uneven = queue_replication_pb2.QueueReport()
    run = uneven.transaction.changes.add().enqueue_run
    run.bodies.extend([b"x", b"y"])
    run.publisher_seqs.extend([1, 2, 3])
    with pytest.raises(ValueError, match="2 bodies and 3 publisher sequence numbers"):
        wire.decode(uneven.SerializeToString())
