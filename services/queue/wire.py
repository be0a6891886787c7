"""Conversion between queue reports (ops.py) and their protobuf form (queue_replication.proto).

Responsible for: the only place that knows both shapes of a report. Reports
travel as serialized QueueReport bytes in GM broadcasts. Guarantees: a report
survives encode/decode unchanged; decoding malformed bytes raises ValueError.
"""

from __future__ import annotations

import sys

from google.protobuf.message import DecodeError

from ringq.internal.v1 import queue_replication_pb2 as pb
from services.queue.ops import (
    NO_HEADERS,
    PERSISTENT_FLAG,
    Deliver,
    Depth,
    Desynchronised,
    Discard,
    Enqueue,
    Message,
    MirrorSays,
    Noticed,
    Persisted,
    PlainChange,
    Report,
    Requeue,
    Settle,
    SyncBatch,
    SyncDone,
    Synchronised,
    SyncRequest,
    Transaction,
)

AnyReport = Report | MirrorSays


def message_to_proto(message: Message) -> pb.ReplicatedMessage:
    out = pb.ReplicatedMessage()
    _fill(out, message)
    return out


def _fill(out: pb.ReplicatedMessage, message: Message) -> None:
    """Set `out`'s fields from `message` in place, only those that differ from their defaults: on the hot
    paths (one per published message, one per logged one) building a ReplicatedMessage from keyword
    arguments and copying it into a report took three times as long."""
    out.id = message.id
    out.body = message.body
    if message.publisher:
        out.publisher = message.publisher
    if message.publisher_seq:
        out.publisher_seq = message.publisher_seq
    flags = message.flags
    if flags & PERSISTENT_FLAG:
        out.persistent = True
    if flags > PERSISTENT_FLAG:
        out.delivery_count = message.delivery_count
    out.enqueued_at_ms = message.enqueued_at_ms
    if message.extras is not None:
        headers, expires_at_ms, priority = message.extras
        if headers:
            out.headers.update(headers)
        if priority:
            out.priority = priority
        if expires_at_ms:
            out.expires_at_ms = expires_at_ms


class _Shared:
    """What decoded messages can share instead of holding a copy each (a mirror keeps every message it
    decodes): a publisher's name (interned, so one string per publisher), and the enqueue time of the
    previous message (a batch's messages share one: an int object is 28 bytes)."""

    last_enqueued_at_ms = 0

    @classmethod
    def enqueued_at(cls, value: int) -> int:
        if value == cls.last_enqueued_at_ms:
            return cls.last_enqueued_at_ms
        cls.last_enqueued_at_ms = value
        return value


def message_from_proto(m: pb.ReplicatedMessage) -> Message:
    return Message(
        id=m.id,
        body=m.body,
        publisher=sys.intern(m.publisher),
        publisher_seq=m.publisher_seq,
        persistent=m.persistent,
        headers=dict(m.headers) if m.headers else NO_HEADERS,
        priority=m.priority,
        enqueued_at_ms=_Shared.enqueued_at(m.enqueued_at_ms),
        expires_at_ms=m.expires_at_ms,
        delivery_count=m.delivery_count,
    )


def encode(report: AnyReport) -> bytes:
    out = pb.QueueReport()
    if isinstance(report, Enqueue):  # the hot path: one per published message
        _fill(out.enqueue, report.message)
        return out.SerializeToString()
    if isinstance(report, Deliver):
        out.deliver.ids.extend(report.ids)
    elif isinstance(report, Settle):
        out.settle.ids.extend(report.ids)
    elif isinstance(report, Requeue):
        out.requeue.ids.extend(report.ids)
    elif isinstance(report, Discard):
        out.discard.ids.extend(report.ids)
        out.discard.reason = report.reason
    elif isinstance(report, Transaction):
        for change in report.changes:
            out.transaction.changes.add().ParseFromString(encode(change))
    elif isinstance(report, Depth):
        out.depth = report.depth
        out.epoch = report.epoch
    elif isinstance(report, SyncBatch):
        out.sync_batch.target = report.target
        for m in report.ready:
            _fill(out.sync_batch.ready.add(), m)
        for m in report.unacked:
            _fill(out.sync_batch.unacked.add(), m)
        out.sync_batch.covers_from_id = report.covers_from_id
        out.sync_batch.covers_below_id = report.covers_below_id
        out.sync_batch.kept_ready.extend(report.kept_ready)
        out.sync_batch.kept_unacked.extend(report.kept_unacked)
    elif isinstance(report, SyncDone):
        out.sync_done = report.target
    elif isinstance(report, SyncRequest):
        out.sync_request.member = report.member
        out.sync_request.below_id = report.below_id
        out.sync_request.have.extend(report.have)
    elif isinstance(report, Desynchronised):
        out.desynchronised = report.member
    elif isinstance(report, Persisted):
        out.persisted.member = report.member
        out.persisted.master = report.master
        out.persisted.through_seq = report.through_seq
    elif isinstance(report, Noticed):
        out.noticed.member = report.member
        out.noticed.kind = report.kind
        out.noticed.detail = report.detail
    else:
        out.synchronised = report.member
    return out.SerializeToString()


def decode(data: bytes) -> AnyReport:
    report = pb.QueueReport()
    try:
        report.ParseFromString(data)
    except DecodeError as error:
        raise ValueError(f"not a queue report: {error}") from None
    kind = report.WhichOneof("kind")
    if kind == "enqueue":
        return Enqueue(message_from_proto(report.enqueue))
    if kind == "deliver":
        return Deliver(tuple(report.deliver.ids))
    if kind == "settle":
        return Settle(tuple(report.settle.ids))
    if kind == "requeue":
        return Requeue(tuple(report.requeue.ids))
    if kind == "discard":
        return Discard(tuple(report.discard.ids), report.discard.reason)
    if kind == "transaction":
        return Transaction(tuple(_plain_change(change) for change in report.transaction.changes))
    if kind == "depth":
        return Depth(report.depth, report.epoch)
    if kind == "sync_batch":
        batch = report.sync_batch
        return SyncBatch(
            batch.target,
            tuple(message_from_proto(m) for m in batch.ready),
            tuple(message_from_proto(m) for m in batch.unacked),
            batch.covers_from_id,
            batch.covers_below_id,
            tuple(batch.kept_ready),
            tuple(batch.kept_unacked),
        )
    if kind == "sync_done":
        return SyncDone(report.sync_done)
    if kind == "sync_request":
        request = report.sync_request
        if len(request.have) % 2:
            raise ValueError("sync_request.have must hold pairs of ids")
        return SyncRequest(request.member, request.below_id, tuple(request.have))
    if kind == "synchronised":
        return Synchronised(report.synchronised)
    if kind == "desynchronised":
        return Desynchronised(report.desynchronised)
    if kind == "persisted":
        said = report.persisted
        return Persisted(said.member, said.master, said.through_seq)
    if kind == "noticed":
        return Noticed(report.noticed.member, report.noticed.kind, report.noticed.detail)
    raise ValueError("queue report without a kind")


def _plain_change(report: pb.QueueReport) -> PlainChange:
    """One change of a transaction: only enqueue, deliver, settle, requeue or discard (ValueError else)."""
    change = decode(report.SerializeToString())
    if not isinstance(change, Enqueue | Deliver | Settle | Requeue | Discard):
        raise ValueError(f"a transaction may not hold a {type(change).__name__} report")
    return change
