"""The replicated contents of a mirrored queue: what the master and every mirror hold.

Responsible for: applying the master's reports (services/queue/ops.py) to
messages ready for delivery and messages pending acknowledgement. Master and
mirrors run this same code, so a mirror that applied the same reports holds
the same contents.

Guarantees:
- Ready messages are delivered in message-id order (ids grow with arrival),
  and a requeued message goes back to its original place, not to the tail.
- A report about a message this replica never had is ignored: a mirror that
  joined late starts empty and catches up as the old head is consumed (or by
  sync), never with a hole in the middle.
- Publisher sequence numbers are remembered per publisher (every one seen:
  all up to a contiguous watermark, and the few above it), so whichever
  replica becomes master drops a retried publish as a duplicate, and never
  mistakes for a duplicate a message it has not seen because a later one
  arrived first.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from services.queue.ops import (
    Deliver,
    Depth,
    Discard,
    Enqueue,
    Message,
    Report,
    Requeue,
    Settle,
    SyncBatch,
    SyncDone,
)


class PublisherSeqs:
    """The sequence numbers seen from one publisher: all up to `through`, and `above` it."""

    __slots__ = ("above", "through")

    def __init__(self) -> None:
        self.through = 0
        self.above: set[int] = set()

    def has(self, seq: int) -> bool:
        return seq <= self.through or seq in self.above

    def add(self, seq: int) -> None:
        if seq <= self.through:
            return
        if seq == self.through + 1 and not self.above:  # the usual case: the next one, in order
            self.through = seq
            return
        self.above.add(seq)
        while self.through + 1 in self.above:
            self.through += 1
            self.above.discard(self.through)


class QueueContents:
    """Messages ready for delivery and pending acknowledgement, by id."""

    def __init__(self) -> None:
        self.messages: dict[int, Message] = {}
        self._ready_heap: list[int] = []
        self._ready: set[int] = set()
        self.unacked: set[int] = set()
        self.publishers: dict[str, PublisherSeqs] = {}
        self.max_id = 0
        # The id of the first message this replica received by Enqueue: older
        # ones it can only have from a sync.
        self.first_enqueued_id = 0
        self.bytes = 0
        self.master_depth: int | None = None

    # ----------------------------------------------------------------- views

    def __len__(self) -> int:
        """Ready messages."""
        return len(self._ready)

    @property
    def depth(self) -> int:
        """Ready plus pending acknowledgement (RabbitMQ's depth)."""
        return len(self._ready) + len(self.unacked)

    def head(self) -> Message | None:
        """The next ready message, without taking it."""
        heap = self._ready_heap
        while heap and heap[0] not in self._ready:
            heapq.heappop(heap)
        return self.messages[heap[0]] if heap else None

    def ready_ids(self) -> Iterator[int]:
        """Ready ids, in delivery order."""
        return iter(sorted(self._ready))

    def is_duplicate(self, publisher: str, seq: int) -> bool:
        seen = self.publishers.get(publisher)
        return seen is not None and seq > 0 and seen.has(seq)

    # --------------------------------------------------------------- applying

    def apply(self, report: Report) -> None:
        """Apply one report of the master (identically on master and mirrors)."""
        if isinstance(report, Enqueue):
            self._add(report.message, ready=True)
            if not self.first_enqueued_id:
                self.first_enqueued_id = report.message.id
        elif isinstance(report, Deliver):
            for message_id in report.ids:
                if message_id in self._ready:
                    self._ready.discard(message_id)
                    self.unacked.add(message_id)
                    self.messages[message_id].delivery_count += 1
        elif isinstance(report, Settle | Discard):
            self._remove(report.ids)
        elif isinstance(report, Requeue):
            for message_id in report.ids:
                if message_id in self.unacked:
                    self.unacked.discard(message_id)
                    self._make_ready(message_id)
        elif isinstance(report, Depth):
            self.master_depth = report.depth
        elif isinstance(report, SyncBatch):
            for message in report.ready:
                if message.id not in self.messages:
                    self._add(message, ready=True)
            for message in report.unacked:
                if message.id not in self.messages:
                    self._add(message, ready=False)
        elif isinstance(report, SyncDone):
            pass  # the mirror's business (services/queue/mirror.py)

    def _add(self, message: Message, ready: bool) -> None:
        if message.id in self.messages:
            return
        self.messages[message.id] = message
        self.bytes += len(message.body)
        if message.id > self.max_id:
            self.max_id = message.id
        if message.publisher and message.publisher_seq > 0:
            seqs = self.publishers.get(message.publisher)
            if seqs is None:
                seqs = self.publishers[message.publisher] = PublisherSeqs()
            seqs.add(message.publisher_seq)
        if ready:
            self._make_ready(message.id)
        else:
            self.unacked.add(message.id)

    def _make_ready(self, message_id: int) -> None:
        self._ready.add(message_id)
        heapq.heappush(self._ready_heap, message_id)

    def _remove(self, ids: Iterable[int]) -> None:
        for message_id in ids:
            message = self.messages.pop(message_id, None)
            if message is None:
                continue
            self.bytes -= message.size
            self._ready.discard(message_id)
            self.unacked.discard(message_id)
