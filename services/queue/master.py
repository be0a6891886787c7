"""The master of a mirrored queue: every decision about its messages, as a pure state machine.

Responsible for: publishing (dropping a retried publish by publisher id and
sequence number, enforcing max-length / max-length-bytes with drop-head or
reject-publish), consumers (prefetch, priorities, round robin, single active
consumer), delivery tags, ack / nack / reject with `multiple` and requeue,
basic get, message TTL (decided by the master's clock only, passed in as
`now_ms`), dead-lettering, the delivery limit for poison messages, purge,
and feeding a syncing mirror. Each input returns a `Step`: the reports to
broadcast to the mirrors, in order (already applied to the master's own
contents), the deliveries to hand to consumers, and the messages to
dead-letter. No I/O, no clock, no randomness.

Guarantees: the master's contents change only through the reports it emits,
so a mirror applying them holds the same (ops.py); a requeued message keeps
its place at the head side of the queue and is delivered with redelivered
set; a message over the delivery limit is dead-lettered (or dropped), never
delivered again; a consumer never holds more than its prefetch; an unknown
delivery tag is refused without changing anything.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.queue.contents import QueueContents
from services.queue.ops import (
    NO_HEADERS,
    PLAIN_CHANGE_TYPES,
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
    Transaction,
)

SYNC_BATCH_MESSAGES = 1000
# A master numbers its messages from `epoch << EPOCH_ID_SHIFT` up (or past the highest id it holds), so
# a new term never reuses the id of a message an earlier term acknowledged: a mirror that kept its log
# from an earlier term can then tell every message apart by id. 2**40 ids per term, 2**23 terms.
EPOCH_ID_SHIFT = 40
# The top of the range a full sync covers: every id a mirror restored from its log.
ALL_IDS = (1 << 64) - 1


class QueueError(Exception):
    """A request the queue refuses; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)  # built per message: not frozen (see Publish)
class Settlement:
    """One settlement of a consumer's delivery: kind is "ack", "requeue" or "reject"."""

    delivery_tag: int
    multiple: bool
    kind: str


@dataclass(frozen=True)
class QueueLimits:
    """What a queue's policy and arguments ask of it (None: no limit)."""

    message_ttl_ms: int | None = None
    max_length: int | None = None
    max_length_bytes: int | None = None
    overflow: str = "drop-head"
    dead_letter_queue: str | None = None
    delivery_limit: int | None = None
    single_active_consumer: bool = False

    @classmethod
    def from_definition(cls, definition: Mapping[str, Any], single_active_consumer: bool = False) -> QueueLimits:
        """From a policy definition (validated by services/coordinator/policies.py)."""
        return cls(
            message_ttl_ms=definition.get("message-ttl"),
            max_length=definition.get("max-length"),
            max_length_bytes=definition.get("max-length-bytes"),
            overflow=definition.get("overflow", "drop-head"),
            dead_letter_queue=definition.get("dead-letter-queue"),
            delivery_limit=definition.get("delivery-limit"),
            single_active_consumer=single_active_consumer,
        )


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~1 us more to build, once per message
class Publish:
    """A message as a publisher sends it."""

    body: bytes
    publisher: str = ""
    seq: int = 0
    persistent: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    priority: int = 0
    expiration_ms: int | None = None


class PublishOutcome(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # confirm it: the queue already has it (or had it)
    REJECTED = "rejected"  # nack it: the queue is full and its overflow is reject-publish


@dataclass(slots=True)  # built per message: not frozen (see Publish)
class Delivery:
    """A message handed to a consumer under a delivery tag."""

    consumer: str
    delivery_tag: int
    message: Message
    redelivered: bool


@dataclass(frozen=True)
class DeadLetter:
    """A message leaving the queue for its dead-letter queue."""

    message: Message
    reason: str  # "expired" | "maxlen" | "rejected" | "delivery_limit"
    target: str


@dataclass
class Step:
    """What one input produced; carry out in this order: broadcast `reports`,
    then hand out `deliveries`, then publish `dead_letters`."""

    reports: list[Report] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    # The index in `reports` of the last one that added or removed a persistent message (-1: none): a
    # log's mark names that report, so equal logs of master and mirrors carry equal marks.
    last_log_change: int = -1


@dataclass
class _Consumer:
    tag: str
    prefetch: int  # 0: unlimited
    priority: int
    unacked: dict[int, int] = field(default_factory=dict)  # delivery tag -> message id
    next_tag: int = 1

    def has_credit(self) -> bool:
        return self.prefetch == 0 or len(self.unacked) < self.prefetch

    def room(self) -> int:
        """How many more deliveries its prefetch allows (-1: no limit; counting down never reaches 0)."""
        return -1 if self.prefetch == 0 else self.prefetch - len(self.unacked)


GET_CONSUMER = ""  # basic.get deliveries awaiting ack are held under this pseudo consumer


@dataclass
class _SyncPlan:
    """What is left to send one syncing mirror."""

    pending: list[int]  # ids still to send, newest first
    below_id: int  # the top of the next batch's range
    have: tuple[int, ...]  # what the mirror holds already: inclusive ranges, flattened

    def holds(self, message_id: int) -> bool:
        index = bisect.bisect_right(self.have, message_id)
        # Inside a range if it falls after a range's first id (odd index) or on a range's last id.
        return index % 2 == 1 or (index > 0 and self.have[index - 1] == message_id)


class QueueMaster:
    """Decides for one queue; `contents` is shared with nothing else."""

    def __init__(
        self, name: str, contents: QueueContents | None = None, limits: QueueLimits | None = None, epoch: int = 0
    ) -> None:
        self.name = name
        self.epoch = epoch  # this master's term, carried by its depth reports (services/queue/durability.py)
        self.contents = contents if contents is not None else QueueContents()
        self.limits = limits or QueueLimits()
        self.next_id = max(self.contents.max_id + 1, epoch << EPOCH_ID_SHIFT)
        self._consumers: dict[str, _Consumer] = {GET_CONSUMER: _Consumer(GET_CONSUMER, 0, -(2**31))}
        self._sync: dict[str, _SyncPlan] = {}

    # -------------------------------------------------------------- publish

    def publish(self, items: list[Publish], now_ms: int) -> tuple[Step, list[PublishOutcome]]:
        step = Step()
        outcomes = []
        for item in items:
            outcomes.append(self._publish_one(item, now_ms, step))
        self._dispatch(step)
        return step, outcomes

    def _publish_one(self, item: Publish, now_ms: int, step: Step) -> PublishOutcome:
        contents = self.contents
        if item.seq and contents.is_duplicate(item.publisher, item.seq):
            return PublishOutcome.DUPLICATE
        limits = self.limits
        if limits.overflow == "reject-publish" and self._full(extra_bytes=len(item.body)):
            return PublishOutcome.REJECTED
        expires_at_ms = 0
        ttl, expiration = limits.message_ttl_ms, item.expiration_ms
        if ttl is not None or expiration is not None:
            expires_at_ms = now_ms + min(t for t in (ttl, expiration) if t is not None)
        message = Message(
            self.next_id,
            item.body,
            item.publisher,
            item.seq,
            item.persistent,
            dict(item.headers) if item.headers else NO_HEADERS,
            item.priority,
            now_ms,
            expires_at_ms,
        )
        self.next_id += 1
        contents.enqueue(message)  # as `_report` would apply it, without looking up the report's type
        step.reports.append(Enqueue(message))
        if item.persistent:
            step.last_log_change = len(step.reports) - 1
        if limits.max_length is not None or limits.max_length_bytes is not None:
            while self._over_limit():
                head = contents.head()
                if head is None:
                    break
                self._discard([head.id], "maxlen", step)
        return PublishOutcome.ACCEPTED

    def _full(self, extra_bytes: int) -> bool:
        limits, contents = self.limits, self.contents
        if limits.max_length is not None and len(contents) + 1 > limits.max_length:
            return True
        return limits.max_length_bytes is not None and contents.bytes + extra_bytes > limits.max_length_bytes

    def _over_limit(self) -> bool:
        limits, contents = self.limits, self.contents
        if limits.max_length is not None and len(contents) > limits.max_length:
            return True
        return limits.max_length_bytes is not None and contents.bytes > limits.max_length_bytes and len(contents) > 0

    # ------------------------------------------------------------ consumers

    def consume(self, tag: str, prefetch: int = 0, priority: int = 0) -> Step:
        if not tag or tag in self._consumers:
            raise QueueError("ALREADY_EXISTS", f"consumer tag {tag!r} is in use on queue {self.name!r}")
        if prefetch < 0:
            raise QueueError("INVALID_ARGUMENT", f"prefetch must be at least 0, got {prefetch}")
        self._consumers[tag] = _Consumer(tag, prefetch, priority)
        step = Step()
        self._dispatch(step)
        return step

    def cancel(self, tag: str) -> Step:
        """Remove a consumer; what it had not acknowledged goes back to the queue."""
        consumer = self._consumers.pop(tag, None)
        if consumer is None or tag == GET_CONSUMER:
            raise QueueError("NOT_FOUND", f"no consumer {tag!r} on queue {self.name!r}")
        step = Step()
        self._requeue(list(consumer.unacked.values()), step)
        self._dispatch(step)
        return step

    @property
    def consumer_tags(self) -> list[str]:
        return [tag for tag in self._consumers if tag != GET_CONSUMER]

    def combined_prefetch(self) -> int | None:
        """The consumers' prefetch added up (basic.get's waiting deliveries aside); None if there is no
        consumer or one takes without limit."""
        total = 0
        for consumer in self._consumers.values():
            if consumer.tag == GET_CONSUMER:
                continue
            if consumer.prefetch == 0:
                return None
            total += consumer.prefetch
        return total or None

    def active_consumer(self) -> str | None:
        """With single active consumer: the one that receives messages."""
        tags = self.consumer_tags
        return tags[0] if tags else None

    # ---------------------------------------------------------- settlement

    def ack(self, consumer: str, delivery_tag: int, multiple: bool = False) -> Step:
        return self._settle_one(consumer, Settlement(delivery_tag, multiple, "ack"))

    def nack(self, consumer: str, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> Step:
        """Negative acknowledgement (reject is nack without multiple)."""
        return self._settle_one(consumer, Settlement(delivery_tag, multiple, "requeue" if requeue else "reject"))

    def _settle_one(self, consumer: str, settlement: Settlement) -> Step:
        step, error = self.settle(consumer, [settlement])
        if error is not None:
            raise error
        return step

    def settle(self, consumer: str, settlements: Sequence[Settlement]) -> tuple[Step, QueueError | None]:
        """Settle a run of a consumer's deliveries in one step (acks coalesced
        into one report). Stops at the first unknown delivery tag: what came
        before it is settled (and in the step), the error is returned."""
        step = Step()
        acked: list[int] = []
        error: QueueError | None = None
        for settlement in settlements:
            try:
                ids = self._take_tags(consumer, settlement.delivery_tag, settlement.multiple)
            except QueueError as refused:
                error = refused
                break
            if settlement.kind == "ack":
                acked.extend(ids)
                continue
            if acked:  # keep the order of reports as settled
                self._report(Settle(tuple(acked)), step)
                acked = []
            if settlement.kind == "requeue":
                self._requeue(ids, step)
            else:
                self._discard(ids, "rejected", step)
        if acked:
            self._report(Settle(tuple(acked)), step)
        if step.reports:  # something was settled: room for deliveries (an unknown tag alone changes nothing)
            self._dispatch(step)
        return step, error

    def commit(
        self, consumer: str, settlements: Sequence[Settlement], items: Sequence[Publish], now_ms: int
    ) -> tuple[Step, list[PublishOutcome]]:
        """A transaction: the consumer's settlements, then the publishes, all or none. Refused with
        QueueError, nothing changed, if a delivery tag is unknown or (overflow reject-publish) the queue
        has no room for every new message. Otherwise one Transaction report holds every change made
        (drop-head discards included), followed by the deliveries it made room for."""
        self._check_settlements(consumer, settlements)
        self._check_room(items)
        step = Step()
        for settlement in settlements:
            ids = self._take_tags(consumer, settlement.delivery_tag, settlement.multiple)
            if settlement.kind == "ack":
                self._report(Settle(tuple(ids)), step)
            elif settlement.kind == "requeue":
                self._requeue(ids, step)
            else:
                self._discard(ids, "rejected", step)
        outcomes = [self._publish_one(item, now_ms, step) for item in items]
        if step.reports:
            step.last_log_change = 0 if step.last_log_change >= 0 else -1
            changes = [report for report in step.reports if isinstance(report, PLAIN_CHANGE_TYPES)]
            assert len(changes) == len(step.reports), "settling and publishing make plain changes only"
            step.reports = [Transaction(tuple(changes))]
        self._dispatch(step)
        return step, outcomes

    def _check_settlements(self, consumer_tag: str, settlements: Sequence[Settlement]) -> None:
        """QueueError unless every settlement, taken in order, names delivery tags the consumer holds."""
        consumer = self._consumers.get(consumer_tag)
        held = set(consumer.unacked) if consumer is not None else set()
        for settlement in settlements:
            if settlement.delivery_tag not in held:
                raise QueueError(
                    "FAILED_PRECONDITION",
                    f"unknown delivery tag {settlement.delivery_tag} for consumer {consumer_tag!r} on {self.name!r}: "
                    "the transaction is refused whole",
                )
            if settlement.multiple:
                held -= {tag for tag in held if tag <= settlement.delivery_tag}
            else:
                held.discard(settlement.delivery_tag)

    def _check_room(self, items: Sequence[Publish]) -> None:
        """QueueError (RESOURCE_EXHAUSTED) if reject-publish would refuse any of the new messages."""
        limits, contents = self.limits, self.contents
        if limits.overflow != "reject-publish":
            return
        fresh = [item for item in items if not contents.is_duplicate(item.publisher, item.seq)]
        too_long = limits.max_length is not None and len(contents) + len(fresh) > limits.max_length
        extra = sum(len(item.body) for item in fresh)
        too_big = limits.max_length_bytes is not None and contents.bytes + extra > limits.max_length_bytes
        if fresh and (too_long or too_big):
            raise QueueError(
                "RESOURCE_EXHAUSTED",
                f"queue {self.name!r} is full (overflow reject-publish): the transaction's {len(fresh)} messages "
                "would not all fit, so none is added",
            )

    def _take_tags(self, consumer_tag: str, delivery_tag: int, multiple: bool) -> list[int]:
        consumer = self._consumers.get(consumer_tag)
        if consumer is None or delivery_tag not in consumer.unacked:
            raise QueueError(
                "FAILED_PRECONDITION",
                f"unknown delivery tag {delivery_tag} for consumer {consumer_tag!r} on {self.name!r}",
            )
        unacked = consumer.unacked
        if not multiple:
            return [unacked.pop(delivery_tag)]
        tags = []
        for tag in unacked:  # in delivery order: a consumer's delivery tags only grow (`_dispatch`)
            if tag > delivery_tag:
                break
            tags.append(tag)
        return [unacked.pop(t) for t in tags]

    def _requeue(self, ids: list[int], step: Step) -> None:
        limit = self.limits.delivery_limit
        poisoned = [i for i in ids if limit is not None and self.contents.messages[i].delivery_count > limit]
        back = [i for i in ids if i not in poisoned]
        if back:
            self._report(Requeue(tuple(back)), step)
        if poisoned:
            self._discard(poisoned, "delivery_limit", step)

    # -------------------------------------------------------------------- get

    def get(self, no_ack: bool) -> tuple[Step, Delivery | None]:
        step = Step()
        head = self.contents.head()
        if head is None:
            return step, None
        delivery = self._deliver_to(self._consumers[GET_CONSUMER], head, step)
        if no_ack:
            self._take_tags(GET_CONSUMER, delivery.delivery_tag, False)
            self._report(Settle((head.id,)), step)
        return step, delivery

    # -------------------------------------------------------------- time etc

    def expire(self, now_ms: int) -> Step:
        """Expire messages at the head whose time has come (the master's clock)."""
        step = Step()
        while (head := self.contents.head()) is not None and head.expires_at_ms and head.expires_at_ms <= now_ms:
            self._discard([head.id], "expired", step)
        self._dispatch(step)
        return step

    def next_expiry_ms(self) -> int | None:
        """When `expire` has something to do next (for the shell's timer)."""
        head = self.contents.head()
        return head.expires_at_ms if head is not None and head.expires_at_ms else None

    def purge(self) -> tuple[Step, int]:
        step = Step()
        ids = tuple(self.contents.ready_ids())
        if ids:
            self._report(Discard(ids, "purged"), step)
        return step, len(ids)

    def depth_report(self) -> Step:
        step = Step()
        self._report(Depth(self.contents.depth, self.epoch), step)
        return step

    def set_limits(self, limits: QueueLimits) -> Step:
        """A policy change: apply the new limits now (max-length may drop heads)."""
        self.limits = limits
        step = Step()
        while self._over_limit() and (head := self.contents.head()) is not None:
            self._discard([head.id], "maxlen", step)
        self._dispatch(step)
        return step

    # ------------------------------------------------------------------ sync

    def start_sync(self, target: str, below_id: int, have: tuple[int, ...] = ()) -> None:
        """A mirror lacks every message older than `below_id` (0: everything), holds
        those in `have` already (inclusive ranges, flattened) and is sent the rest."""
        ids = [i for i in self.contents.messages if below_id == 0 or i < below_id]
        top = below_id or ALL_IDS
        self._sync[target] = _SyncPlan(sorted(ids, reverse=True), top, have)  # from the sync point towards the head

    def cancel_sync(self, target: str) -> bool:
        return self._sync.pop(target, None) is not None

    @property
    def syncing(self) -> list[str]:
        return list(self._sync)

    def sync_remaining(self) -> dict[str, int]:
        """Per syncing mirror, how many messages are still to be sent to it."""
        return {target: len(plan.pending) for target, plan in self._sync.items()}

    def sync_next(self, target: str, batch: int = SYNC_BATCH_MESSAGES) -> Step:
        """The next batch for `target`, as the master holds those messages now; each covers
        the ids from its lowest up to the previous batch's (the last one down to the first
        id), and the last one is followed by SyncDone and a Depth report."""
        step = Step()
        plan = self._sync.get(target)
        if plan is None:
            return step
        chunk, plan.pending = plan.pending[:batch], plan.pending[batch:]
        covers_from = chunk[-1] if plan.pending else 1
        messages, unacked = self.contents.messages, self.contents.unacked
        ready: list[Message] = []
        held_back: list[Message] = []
        kept_ready: list[int] = []
        kept_unacked: list[int] = []
        for message_id in chunk:
            message = messages.get(message_id)
            if message is None:
                continue
            if plan.holds(message_id):
                (kept_unacked if message_id in unacked else kept_ready).append(message_id)
            else:
                (held_back if message_id in unacked else ready).append(message)
        step.reports.append(
            SyncBatch(
                target,
                tuple(ready),
                tuple(held_back),
                covers_from,
                plan.below_id,
                tuple(kept_ready),
                tuple(kept_unacked),
            )
        )
        plan.below_id = covers_from
        if not plan.pending:
            del self._sync[target]
            self._report(SyncDone(target), step)
            self._report(Depth(self.contents.depth, self.epoch), step)
        return step

    # -------------------------------------------------------------- helpers

    def _report(self, report: Report, step: Step) -> None:
        before = self.contents.persistent_changes
        self.contents.apply(report)
        step.reports.append(report)
        if self.contents.persistent_changes != before:
            step.last_log_change = len(step.reports) - 1

    def _discard(self, ids: list[int], reason: str, step: Step) -> None:
        target = self.limits.dead_letter_queue
        if target and reason != "purged":
            for message_id in ids:
                step.dead_letters.append(DeadLetter(self.contents.messages[message_id], reason, target))
        self._report(Discard(tuple(ids), reason), step)

    def _dispatch(self, step: Step) -> None:
        contents = self.contents
        round_robin = not self.limits.single_active_consumer
        delivered: list[int] = []
        deliveries = step.deliveries
        while (picked := self._pick()) is not None:
            consumer, rivals = picked
            # Equals take turns, one message each; a consumer with no rival takes what its credit allows at
            # once (the same deliveries, without choosing again for every message).
            taken = contents.take_ready(1 if rivals else consumer.room())
            if not taken:
                break
            unacked, consumer_tag, tag = consumer.unacked, consumer.tag, consumer.next_tag
            for message in taken:
                message_id = message.id
                delivered.append(message_id)
                unacked[tag] = message_id
                deliveries.append(Delivery(consumer_tag, tag, message, message.redelivered))
                tag += 1
            consumer.next_tag = tag
            if round_robin:  # the one just served goes to the back
                self._consumers[consumer_tag] = self._consumers.pop(consumer_tag)
        if delivered:
            step.reports.append(Deliver(tuple(delivered)))

    def _deliver_to(self, consumer: _Consumer, message: Message, step: Step) -> Delivery:
        self._report(Deliver((message.id,)), step)
        tag = consumer.next_tag
        consumer.next_tag += 1
        consumer.unacked[tag] = message.id
        return Delivery(consumer.tag, tag, message, message.redelivered)

    def _pick(self) -> tuple[_Consumer, bool] | None:
        """The consumer to serve next (with credit, highest priority, first in turn), and whether another
        of its priority has credit too."""
        if self.limits.single_active_consumer:
            tag = self.active_consumer()
            active = None if tag is None else self._consumers[tag]
            return (active, False) if active is not None and active.has_credit() else None
        best: _Consumer | None = None
        rivals = False
        for consumer in self._consumers.values():
            if consumer.tag == GET_CONSUMER or not consumer.has_credit():
                continue
            if best is None or consumer.priority > best.priority:
                best, rivals = consumer, False
            elif consumer.priority == best.priority:
                rivals = True
        return None if best is None else (best, rivals)
