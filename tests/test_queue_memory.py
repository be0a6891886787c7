"""What a queued message costs and what a drained queue keeps (issue 13): the contents hold no set of ready
ids, rebuild their tables once mostly empty, keep no stale heap after a drain; decoded messages share what
they can (services/queue/contents.py, services/queue/wire.py)."""

from __future__ import annotations

import sys

from services.queue import wire
from services.queue.contents import COMPACT_FROM, QueueContents
from services.queue.ops import NO_HEADERS, Deliver, Enqueue, Message, Requeue, Settle

N = 4 * COMPACT_FROM


def filled(count: int) -> QueueContents:
    contents = QueueContents()
    for message_id in range(1, count + 1):
        contents.apply(Enqueue(Message(message_id, b"body", publisher="p", publisher_seq=message_id)))
    return contents


def test_ready_and_pending_acknowledgement_are_told_apart_without_a_ready_set() -> None:
    contents = filled(10)
    contents.apply(Deliver((1, 2, 3)))
    contents.apply(Requeue((2,)))
    contents.apply(Settle((3,)))
    assert (len(contents), contents.depth, sorted(contents.unacked)) == (8, 9, [1])
    assert list(contents.ready_ids()) == [2, 4, 5, 6, 7, 8, 9, 10]
    assert contents.head() is not None and contents.head().id == 2  # type: ignore[union-attr]
    assert not hasattr(contents, "_ready")


def test_a_drained_contents_keeps_no_heap_and_gives_its_tables_back() -> None:
    contents = filled(N)
    full_size = sys.getsizeof(contents.messages)
    ids = tuple(range(1, N + 1))
    contents.apply(Deliver(ids))  # as a mirror applies them: it never asks for its head
    contents.apply(Settle(ids))
    assert contents.depth == 0
    assert len(contents._ready_heap) == 0
    assert sys.getsizeof(contents.messages) < full_size / 8
    assert sys.getsizeof(contents.unacked) < 4096


def test_a_mirror_passing_messages_through_keeps_its_heap_small() -> None:
    contents = QueueContents()
    for message_id in range(1, 50_001):
        contents.apply(Enqueue(Message(message_id, b"x")))
        if message_id > 100:  # a steady depth of 100, the oldest settled as a mirror hears it
            contents.apply(Deliver((message_id - 100,)))
            contents.apply(Settle((message_id - 100,)))
    assert contents.depth == 100
    assert len(contents._ready_heap) < 2 * 100 + 2048


def test_decoded_messages_share_their_publisher_empty_headers_and_enqueue_time() -> None:
    def decoded(seq: int) -> Message:
        publisher = "".join(["pub", "lisher-1"])  # a string of its own, as a decoded one is
        sent = Message(seq, b"b", publisher=publisher, publisher_seq=seq, enqueued_at_ms=1_700_000_000_000)
        return wire.message_from_proto(wire.message_to_proto(sent))

    one, two = decoded(1), decoded(2)
    assert one.publisher == "publisher-1" and one.publisher is two.publisher
    assert one.headers is NO_HEADERS and two.headers is NO_HEADERS
    assert one.enqueued_at_ms == 1_700_000_000_000 and one.enqueued_at_ms is two.enqueued_at_ms
    with_headers = Message(3, b"b", headers={"k": "v"})
    assert wire.message_from_proto(wire.message_to_proto(with_headers)).headers == {"k": "v"}
