"""Message (services/queue/ops.py) packs its rarely set fields: what it is built with is what it reads back,
through delivery counts, over the wire, and in equality."""

from __future__ import annotations

import sys

import pytest

from services.queue import wire
from services.queue.ops import NO_HEADERS, Enqueue, Message, SyncBatch

EVERYTHING = {
    "id": (3 << 40) + 9,
    "body": b"body",
    "publisher": "orders",
    "publisher_seq": 41,
    "persistent": True,
    "headers": {"kind": "refund"},
    "priority": -3,  # int32 on the wire: nothing refuses a negative one
    "enqueued_at_ms": 1_700_000_000_000,
    "expires_at_ms": 1_700_000_060_000,
    "delivery_count": 300,
}


def _read(message: Message) -> dict[str, object]:
    return {name: getattr(message, name) for name in EVERYTHING}


def test_every_field_reads_back_as_given() -> None:
    assert _read(Message(**EVERYTHING)) == EVERYTHING  # type: ignore[arg-type]


def test_the_defaults_cost_no_extras_and_no_allocated_flags() -> None:
    message = Message(7, b"x", "p", 1, enqueued_at_ms=5)
    assert (message.persistent, message.headers, message.priority, message.expires_at_ms) == (False, NO_HEADERS, 0, 0)
    assert message.delivery_count == 0 and not message.redelivered
    assert message.extras is None
    assert sys.getsizeof(message) <= 88, "7 slots and the headers of an object the collector tracks (was 112)"


@pytest.mark.parametrize("persistent", [False, True])
def test_counting_deliveries_keeps_the_persistent_flag(persistent: bool) -> None:
    message = Message(1, b"x", persistent=persistent)
    for _ in range(200):
        message.count_delivery()
    assert (message.delivery_count, message.persistent, message.redelivered) == (200, persistent, True)
    message.delivery_count = 1
    assert (message.delivery_count, message.persistent, message.redelivered) == (1, persistent, False)


def test_it_crosses_the_wire_whole() -> None:
    """Whole in a sync batch; in an Enqueue, whole but for its delivery count (an enqueued message travels
    undelivered: services/queue/wire.py)."""
    for fields in (EVERYTHING, {"id": 1, "body": b""}, {**EVERYTHING, "headers": {}, "priority": 0}):
        message = Message(**fields)  # type: ignore[arg-type]
        synced = wire.decode(wire.encode(SyncBatch("node2.b", (message,), ())))
        assert isinstance(synced, SyncBatch) and synced.ready == (message,)
        assert _read(synced.ready[0]) == _read(message)
        undelivered = Message(**{**fields, "delivery_count": 0})  # type: ignore[arg-type]
        decoded = wire.decode(wire.encode(Enqueue(message)))
        assert isinstance(decoded, Enqueue) and decoded.message == undelivered
        assert _read(decoded.message) == _read(undelivered)


def test_equality_compares_every_field() -> None:
    assert Message(**EVERYTHING) == Message(**EVERYTHING)  # type: ignore[arg-type]
    for name, other in (("priority", 4), ("delivery_count", 1), ("persistent", False), ("headers", {})):
        assert Message(**{**EVERYTHING, name: other}) != Message(**EVERYTHING)  # type: ignore[arg-type]
    assert Message(1, b"x") != (1, b"x")
    assert "priority=-3" in repr(Message(**EVERYTHING))  # type: ignore[arg-type]


def test_a_message_is_left_to_reference_counting_not_to_the_cycle_collector() -> None:
    """A deep queue's messages are most of a node's objects; every full collection walked them all, the
    event loop stopped meanwhile (services/queue/ops.py). A message is never part of a cycle, so it is not
    tracked, and it is freed as soon as the last reference goes."""
    import gc
    import weakref

    message = Message(1, b"body", "publisher", 1, True, {"k": "v"}, 3, 5, 9)
    assert not gc.is_tracked(message)

    class Headers(dict[str, str]):  # can be referred to weakly: tells when the message let go of it
        pass

    headers = Headers(k="kept by the message only")
    held = Message(2, b"body", headers=headers)
    gone = weakref.ref(headers)
    del headers, held
    assert gone() is None
