"""Queue reports survive their protobuf form unchanged (services/queue/wire.py)."""

from __future__ import annotations

import pytest

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
)

PLAIN = Message(7, b"body", "orders", 3, False, {}, 0, 1_700_000_000_000, 0, 0)
FULL = Message(8, b"\x00" * 300, "orders", 4, True, {"x-death-reason": "expired", "k": ""}, 9, 1, 2, 3)


@pytest.mark.parametrize(
    "report",
    [
        Enqueue(PLAIN),
        Enqueue(FULL),
        Deliver((1, 2)),
        Settle((3,)),
        Requeue((4, 5)),
        Discard((6,), "maxlen"),
        Depth(12, epoch=4),
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
        delivery_count=3,
    )
    seq_only = Message(3, b"x", publisher_seq=5)
    for message in (plain, full, seq_only):
        assert wire.decode(wire.encode(Enqueue(message))) == Enqueue(message)
