"""What a queue's master reports to its mirrors over the GM ring, and what mirrors say back.

Responsible for: the vocabulary of mirrored queues. The master decides
(which message goes to which consumer, what expires, what is dropped) and
*reports* each decision by message id; mirrors apply the reports in order and
never decide anything themselves (Qpid's "report, do not predict"). Because
the GM ring delivers one sender's messages in order to every member, every
mirror sees the master's reports in the order the master made them.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

# The headers of a message that has none: one shared, read-only empty mapping (an empty dict per queued
# message cost 64 bytes).
NO_HEADERS: Mapping[str, str] = MappingProxyType({})


# Message.flags: PERSISTENT_FLAG, and the delivery count above it (a small int, shared by Python, for any
# message delivered fewer than 128 times: nothing allocated).
PERSISTENT_FLAG = 1
_COUNT_SHIFT = 1


def _gc_untracker() -> Callable[[object], None]:
    """CPython's PyObject_GC_UnTrack (elsewhere: nothing to do)."""
    if platform.python_implementation() != "CPython":
        return lambda _: None
    untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    untrack.argtypes = [ctypes.py_object]
    untrack.restype = None
    return untrack


_untrack = _gc_untracker()


class Message:
    """A message as a queue holds it. Every queued message is one of these on every replica, so it is
    kept small (issue 13: memory per queued message): whether it is persistent and its delivery count
    share one slot, and the rarely set headers, expiry and priority another (None when none is set),
    for 7 slots (88 bytes) where 10 fields took 112.

    Not tracked by the cyclic garbage collector: a message refers only to bytes, str, ints and its extras
    (a tuple of its headers mapping and two ints), none of which can refer back to it, so it is never part
    of a reference cycle and reference counting alone frees it. A deep queue's messages are most of a
    node's objects, and every full collection walked them all, the event loop stopped meanwhile: 56, 98
    and 132 ms on the master as a W1 queue grew past 100,000, 200,000 and 250,000 messages (issue 13).
    Untracking costs about what the young collections no longer spend walking messages (valgrind,
    50,000 messages published: +0.5 % instructions). Keep it so: a field that could hold a reference to
    a message, or to a container that may, would make such a cycle a leak."""

    __slots__ = ("body", "enqueued_at_ms", "extras", "flags", "id", "publisher", "publisher_seq")

    id: int
    body: bytes
    publisher: str
    publisher_seq: int
    enqueued_at_ms: int
    flags: int  # PERSISTENT_FLAG | delivery count << 1: read `persistent` and `delivery_count` (hot loops test the bit)
    extras: tuple[Mapping[str, str], int, int] | None  # (headers, expires_at_ms, priority); None: none set

    def __init__(
        self,
        id: int,
        body: bytes,
        publisher: str = "",
        publisher_seq: int = 0,
        persistent: bool = False,
        headers: Mapping[str, str] = NO_HEADERS,  # shared, not a copy
        priority: int = 0,
        enqueued_at_ms: int = 0,
        # Absolute expiry on the master's clock (0: never), from the queue's
        # message-ttl and the message's own expiration, whichever is sooner.
        expires_at_ms: int = 0,
        # How many times it has been handed to a consumer.
        delivery_count: int = 0,
    ) -> None:
        self.id = id
        self.body = body
        self.publisher = publisher
        self.publisher_seq = publisher_seq
        self.enqueued_at_ms = enqueued_at_ms
        self.flags = (delivery_count << _COUNT_SHIFT) | (PERSISTENT_FLAG if persistent else 0)
        self.extras = (headers, expires_at_ms, priority) if headers or expires_at_ms or priority else None
        _untrack(self)

    @property
    def persistent(self) -> bool:
        return bool(self.flags & PERSISTENT_FLAG)

    @property
    def priority(self) -> int:
        extras = self.extras
        return 0 if extras is None else extras[2]

    @property
    def delivery_count(self) -> int:
        return self.flags >> _COUNT_SHIFT

    @delivery_count.setter
    def delivery_count(self, count: int) -> None:
        self.flags = (count << _COUNT_SHIFT) | (self.flags & PERSISTENT_FLAG)

    def count_delivery(self) -> None:
        """One more delivery to a consumer (the hot path's `delivery_count += 1`)."""
        self.flags += 1 << _COUNT_SHIFT

    @property
    def headers(self) -> Mapping[str, str]:
        extras = self.extras
        return NO_HEADERS if extras is None else extras[0]

    @property
    def expires_at_ms(self) -> int:
        extras = self.extras
        return 0 if extras is None else extras[1]

    @property
    def redelivered(self) -> bool:
        return self.delivery_count > 1

    @property
    def size(self) -> int:
        return len(self.body)

    def _fields(self) -> tuple[object, ...]:
        return (
            self.id,
            self.body,
            self.publisher,
            self.publisher_seq,
            self.persistent,
            dict(self.headers),
            self.priority,
            self.enqueued_at_ms,
            self.expires_at_ms,
            self.delivery_count,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable (its delivery count), as the dataclass it was

    def __repr__(self) -> str:
        return (
            f"Message(id={self.id!r}, body={self.body!r}, publisher={self.publisher!r}, "
            f"publisher_seq={self.publisher_seq!r}, persistent={self.persistent!r}, headers={dict(self.headers)!r}, "
            f"priority={self.priority!r}, enqueued_at_ms={self.enqueued_at_ms!r}, "
            f"expires_at_ms={self.expires_at_ms!r}, delivery_count={self.delivery_count!r})"
        )


# ---------------------------------------------------------- master -> mirrors


@dataclass(frozen=True, slots=True)
class Enqueue:
    """A message joined the tail of the queue."""

    message: Message


@dataclass(frozen=True, slots=True)
class Deliver:
    """Messages went from ready to a consumer (now pending acknowledgement)."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Settle:
    """Messages were acknowledged: gone."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Requeue:
    """Messages pending acknowledgement went back to ready, in their original place."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Discard:
    """Messages left the queue without acknowledgement: expired, dropped by
    max-length, rejected without requeue, over the delivery limit, purged."""

    ids: tuple[int, ...]
    reason: str


PlainChange = Enqueue | Deliver | Settle | Requeue | Discard
PLAIN_CHANGE_TYPES = (Enqueue, Deliver, Settle, Requeue, Discard)


@dataclass(frozen=True, slots=True)
class Transaction:
    """Changes applied together: a committed transaction's, or those of one step of the master (a publish
    request's enqueues and the deliveries they made; services/queue/replica_core.py `_pack`). It travels
    as one ring message, so every replica applies all of them or none (a master that dies
    mid-broadcast leaves a prefix of its *messages*, never of one message)."""

    changes: tuple[PlainChange, ...]


@dataclass(frozen=True, slots=True)
class Depth:
    """The master's depth (ready + pending acknowledgement) at this point of the stream,
    the epoch of its term (see services/queue/durability.py), and, for a durable queue, the
    GM sequence number its log's mark names: its last report that changed its log (0: none
    this term, or a master that does not say)."""

    depth: int
    epoch: int = 0
    log_mark_seq: int = 0


@dataclass(frozen=True, slots=True)
class SyncBatch:
    """Messages a syncing mirror lacks, as the master holds them now: `ready`
    ones and ones pending acknowledgement (`unacked`).

    The batch covers the ids from `covers_from_id` up to (not including)
    `covers_below_id`: once applied, the target holds exactly the batch's
    messages in that range (it drops any other it held there), in the state
    the master holds them in. `kept_ready` / `kept_unacked` name, without their
    bodies, the ids the target said it already holds (SyncRequest.have)."""

    target: str
    ready: tuple[Message, ...]
    unacked: tuple[Message, ...]
    covers_from_id: int = 0
    covers_below_id: int = 0
    kept_ready: tuple[int, ...] = ()
    kept_unacked: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SyncDone:
    """The master sent every message older than the target's first one."""

    target: str


# ---------------------------------------------------------- mirrors -> master


@dataclass(frozen=True, slots=True)
class SyncRequest:
    """A mirror lacks every message older than `below_id` (0: every message) and asks
    for them; `have` lists, as inclusive ranges flattened into pairs, the ids below
    `below_id` it already holds (a log kept from before a restart), which the master
    then names without their bodies."""

    member: str
    below_id: int
    have: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Synchronised:
    """A mirror holds exactly what the master holds."""

    member: str


Report = Enqueue | Deliver | Settle | Requeue | Discard | Transaction | Depth | SyncBatch | SyncDone


@dataclass(frozen=True, slots=True)
class Desynchronised:
    """A mirror that was synchronised found it differs from the master (an
    operation failed on it, e.g. its disk): it starts over and re-syncs."""

    member: str


@dataclass(frozen=True, slots=True)
class Persisted:
    """A mirror of a durable queue flushed every persistent change `master`
    reported up to its report `through_seq` (a GM sequence number)."""

    member: str
    master: str
    through_seq: int


@dataclass(frozen=True, slots=True)
class Noticed:
    """A mirror tells the master of something noteworthy (its log damaged, its disk
    failed or came back), for the queue's events; `kind` is a QueueEvent kind."""

    member: str
    kind: str
    detail: str


MirrorSays = SyncRequest | Synchronised | Desynchronised | Persisted | Noticed


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A ring message in which this node found no report it can read (damaged, or an encoding newer than
    it knows). The shell hands this on in its place, so that the core knows a change may be missing
    (a mirror starts over) and the sequence numbers of the reports after it stay right."""

    detail: str


def unpacked(report: Report) -> tuple[Report, ...]:
    """A transaction's changes in order; any other report alone."""
    return report.changes if isinstance(report, Transaction) else (report,)
