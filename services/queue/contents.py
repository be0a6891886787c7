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
- A sync batch covers a range of ids: once the target applied it, it holds in
  that range exactly what the master held there at that point of its report
  stream (what it restored from its own log and the master no longer holds is
  dropped), so a mirror that kept its log catches up without starting over.
- Publisher sequence numbers are remembered per publisher (every one seen:
  all up to a contiguous watermark, and the few above it), so whichever
  replica becomes master drops a retried publish as a duplicate, and never
  mistakes for a duplicate a message it has not seen because a later one
  arrived first.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Iterator, Sequence

from services.queue.message_table import MessageTable
from services.queue.ops import (
    PERSISTENT_FLAG,
    Deliver,
    Depth,
    Discard,
    Enqueue,
    Message,
    PlainChange,
    Report,
    Requeue,
    Settle,
    SyncBatch,
    SyncDone,
    Transaction,
)

# How many stale ids the ready heap may hold beyond twice the live ones before it is rebuilt.
HEAP_SLACK = 1024
# Python's dicts and sets never shrink as items leave: below a quarter of their peak size (and above this
# many at the peak) they are rebuilt, so a drained queue gives its memory back.
COMPACT_FROM = 4096


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
        self.messages = MessageTable()  # by id, ascending (a dict cost 42 to 52 bytes a message)
        # Ready ids are the messages not pending acknowledgement (no set of their own: it cost about 60
        # bytes per queued message); the heap orders them and may hold stale ids (see `_prune_stale_heap`).
        self._ready_heap: list[int] = []
        self._heap_checked_at = HEAP_SLACK  # the heap's length up to which it needs no pruning (`_make_ready`)
        self.unacked: set[int] = set()
        self._peak = 0  # len(messages) at its highest since the tables were last rebuilt (`_remove`)
        self.publishers: dict[str, PublisherSeqs] = {}
        self.max_id = 0
        # The id of the first message this replica received by Enqueue: older
        # ones it can only have from a sync.
        self.first_enqueued_id = 0
        self.bytes = 0
        self.master_depth: int | None = None
        # Ids restored from a log (`restore`), ascending: the only ones a sync batch may have to drop.
        self.restored: list[int] = []
        # Counts every persistent message added or removed: a replica compares it before and after
        # applying reports to know, without looking at each message, whether its log must change.
        self.persistent_changes = 0

    # ----------------------------------------------------------------- views

    def __len__(self) -> int:
        """Ready messages."""
        return len(self.messages) - len(self.unacked)

    @property
    def depth(self) -> int:
        """Ready plus pending acknowledgement (RabbitMQ's depth)."""
        return len(self.messages)

    def is_ready(self, message_id: int) -> bool:
        return message_id in self.messages and message_id not in self.unacked

    def head(self) -> Message | None:
        """The next ready message, without taking it."""
        heap = self._ready_heap
        while heap and not self.is_ready(heap[0]):
            heapq.heappop(heap)
        return self.messages[heap[0]] if heap else None

    def take_ready(self, most: int) -> list[Message]:
        """Up to `most` (-1: every) ready messages in delivery order, each now pending acknowledgement and
        counted as delivered: what applying a Deliver of their ids does, in one pass (the master's
        dispatch, once per message it delivers)."""
        heap, messages, unacked = self._ready_heap, self.messages, self.unacked
        taken: list[Message] = []
        while most and heap:
            message_id = heapq.heappop(heap)
            message = messages.get(message_id)
            if message is None or message_id in unacked:
                continue  # a stale id (`head`)
            unacked.add(message_id)
            message.count_delivery()
            taken.append(message)
            most -= 1
        return taken

    def enqueue(self, message: Message) -> None:
        """Apply Enqueue(message) (the master's publish, once per message)."""
        self._add(message, ready=True)
        if not self.first_enqueued_id:
            self.first_enqueued_id = message.id

    def enqueue_many(self, messages: Sequence[Message]) -> list[Message]:
        """Apply Enqueue(m) for each of `messages`, in order, in one pass: what `enqueue` does to each (a
        publish request's run of messages on a mirror, once per request instead of once per message).
        Returns the persistent ones added (what a log must keep)."""
        if not messages:
            return []
        if not self.first_enqueued_id:
            self.first_enqueued_id = messages[0].id
        table_add = self.messages.add
        heap, publishers = self._ready_heap, self.publishers
        top = self.max_id  # every id in the ready heap is at most this
        added_bytes = 0
        persistent: list[Message] = []
        last_publisher, seqs = "", None
        for message in messages:
            if not table_add(message):
                continue
            added_bytes += len(message.body)
            if message.flags & PERSISTENT_FLAG:
                persistent.append(message)
            publisher = message.publisher
            if publisher and message.publisher_seq > 0:
                if publisher != last_publisher or seqs is None:
                    seqs = publishers.get(publisher)
                    if seqs is None:
                        seqs = publishers[publisher] = PublisherSeqs()
                    last_publisher = publisher
                seqs.add(message.publisher_seq)
            message_id = message.id
            if message_id > top:  # above every id in the heap: appended, it keeps the heap's order
                top = message_id
                heap.append(message_id)
            else:
                heapq.heappush(heap, message_id)
        self.bytes += added_bytes
        self.persistent_changes += len(persistent)
        self.max_id = top
        if len(heap) > self._heap_checked_at:
            self._prune_stale_heap()
        return persistent

    def ready_ids(self) -> Iterator[int]:
        """Ready ids, in delivery order."""
        return iter(sorted(self._live_ready()))

    def _live_ready(self) -> list[int]:
        unacked = self.unacked
        return [message_id for message_id in self.messages if message_id not in unacked]

    def held_ranges(self, below_id: int, max_ranges: int) -> tuple[int, ...]:
        """The ids below `below_id` (0: every id) held here, as inclusive ranges flattened
        into pairs; () if there are more than `max_ranges` ranges (the master then sends
        every body, which costs the network, not correctness)."""
        ids = sorted(i for i in self.messages if below_id == 0 or i < below_id)
        flat: list[int] = []
        for message_id in ids:
            if flat and flat[-1] == message_id - 1:
                flat[-1] = message_id
            else:
                if len(flat) // 2 == max_ranges:
                    return ()
                flat += (message_id, message_id)
        return tuple(flat)

    def is_duplicate(self, publisher: str, seq: int) -> bool:
        seen = self.publishers.get(publisher)
        return seen is not None and seq > 0 and seen.has(seq)

    # --------------------------------------------------------------- applying

    def apply(self, report: Report) -> None:
        """Apply one report of the master (identically on master and mirrors)."""
        if isinstance(report, Enqueue):
            self.enqueue(report.message)
        elif isinstance(report, Deliver):
            messages, unacked = self.messages, self.unacked
            for message_id in report.ids:
                message = messages.get(message_id)
                if message is not None and message_id not in unacked:
                    unacked.add(message_id)
                    message.count_delivery()
        elif isinstance(report, Settle | Discard):
            self._remove(report.ids)
        elif isinstance(report, Requeue):
            for message_id in report.ids:
                if message_id in self.unacked:
                    self.unacked.discard(message_id)
                    self._make_ready(message_id)
        elif isinstance(report, Transaction):
            self.apply_changes(report.changes)
        elif isinstance(report, Depth):
            self.master_depth = report.depth
        elif isinstance(report, SyncBatch):
            self._apply_sync_batch(report)
        elif isinstance(report, SyncDone):
            pass  # the mirror's business (services/queue/mirror.py)

    def apply_changes(
        self, changes: Iterable[PlainChange], enqueued: list[Message] | None = None, removed: list[int] | None = None
    ) -> bool:
        """Apply `changes` in order (a transaction's), each run of enqueues in one pass (`enqueue_many`).
        Gathers what a log must keep into `enqueued` (the persistent messages added) and `removed` (the ids
        of each change that removed a persistent message); True if there was any."""
        logged = False
        run: list[Message] = []
        for change in changes:
            if isinstance(change, Enqueue):
                run.append(change.message)
                continue
            if run:
                logged |= self._enqueue_run(run, enqueued)
                run = []
            before = self.persistent_changes
            self.apply(change)
            if self.persistent_changes != before:
                logged = True
                if removed is not None:
                    removed.extend(change.ids)
        return self._enqueue_run(run, enqueued) or logged

    def _enqueue_run(self, run: list[Message], enqueued: list[Message] | None) -> bool:
        persistent = self.enqueue_many(run)
        if persistent and enqueued is not None:
            enqueued += persistent
        return bool(persistent)

    def restore(self, messages: Iterable[Message]) -> None:
        """Load messages kept in a log before a restart, in id order (ready). They are
        not "received live": `first_enqueued_id` stays as it was."""
        for message in messages:
            self._add(message, ready=True)
            self.restored.append(message.id)
        self.restored.sort()

    def unverify(self) -> None:
        """Everything held here is to be checked against a new master's (a master that recovered from
        a log, not one promoted from this replica's peers): a full sync may drop any of it."""
        self.restored = sorted(self.messages)
        self.first_enqueued_id = 0

    def _apply_sync_batch(self, batch: SyncBatch) -> None:
        """The target of a sync batch: hold exactly the batch's messages in its range,
        in the batch's states."""
        ready_ids = [m.id for m in batch.ready]
        ready_ids.extend(batch.kept_ready)
        unacked_ids = [m.id for m in batch.unacked]
        unacked_ids.extend(batch.kept_unacked)
        if batch.covers_below_id:
            named = {*ready_ids, *unacked_ids}
            restored = self.restored
            low = bisect.bisect_left(restored, batch.covers_from_id)
            high = bisect.bisect_left(restored, batch.covers_below_id)
            self._remove([i for i in restored[low:high] if i not in named])
            del restored[low:high]
        for message in batch.ready:
            self._add(message, ready=True)
        for message in batch.unacked:
            self._add(message, ready=False)
        for message_id in ready_ids:
            if message_id in self.unacked:
                self.unacked.discard(message_id)
                self._make_ready(message_id)
        for message_id in unacked_ids:
            if self.is_ready(message_id):
                self.unacked.add(message_id)

    def _add(self, message: Message, ready: bool) -> None:
        messages = self.messages
        if not messages.add(message):
            return
        self.bytes += len(message.body)
        if message.flags & PERSISTENT_FLAG:
            self.persistent_changes += 1
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
        heap = self._ready_heap
        heapq.heappush(heap, message_id)
        if len(heap) > self._heap_checked_at:  # else the heap is no longer than when last found fit
            self._prune_stale_heap()

    def _prune_stale_heap(self) -> None:
        """Ids stop being ready without leaving the heap (it is pruned lazily, from its top, by `head`); a
        mirror never asks for its head, so its heap kept every id it ever made ready (32 bytes each: 20
        MiB per 625,000 messages passed through). Rebuilt once stale ids outnumber live ones.

        Looked at again only once the heap grew past its length when last looked at (`_make_ready`, once
        per enqueue, skips the count of live ids in between), or when messages leave: stale ids then
        stay at most twice the most ready ids there were since, plus HEAP_SLACK."""
        if len(self._ready_heap) > 2 * len(self) + HEAP_SLACK:
            self._ready_heap = sorted(self._live_ready())  # a sorted list is a heap
        self._heap_checked_at = 2 * len(self) + HEAP_SLACK

    def _remove(self, ids: Iterable[int]) -> None:
        held = len(self.messages)
        if held > self._peak:  # only removals lower the count: its highest was here or at an earlier removal
            self._peak = held
        removed = self.messages.pop_many(ids)
        if not removed:
            return
        unacked = self.unacked
        for message in removed:
            self.bytes -= len(message.body)
            if message.flags & PERSISTENT_FLAG:
                self.persistent_changes += 1
            unacked.discard(message.id)
        self._prune_stale_heap()
        self._compact_if_sparse()

    def _compact_if_sparse(self) -> None:
        """Rebuild the tables once they hold under a quarter of their peak: the memory of a drained queue
        goes back to the allocator (and most of it to the OS) instead of staying sized for its peak."""
        if self._peak >= COMPACT_FROM and len(self.messages) * 4 < self._peak:
            self.messages.compact()
            self.unacked = set(self.unacked)
            self._peak = len(self.messages)
