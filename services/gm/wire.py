"""Conversion between the ring's messages and their protobuf form (peer.proto).

Responsible for: the only place that knows both shapes. Guarantees: a message
survives a round trip unchanged; bodies are passed through as lists of bytes
(one copy at the protobuf boundary, none per message in Python code).
"""

from __future__ import annotations

from ringq.internal.v1 import peer_pb2
from services.gm.messages import Activity, Catchup, PublisherActivity, PublisherState, RingMessage


def to_proto(message: RingMessage) -> peer_pb2.RingMessage:
    """The protobuf form of `message`."""
    out = peer_pb2.RingMessage(
        group=message.group, sender=message.sender, receiver=message.receiver, view_version=message.view_version
    )
    body = message.body
    if isinstance(body, Activity):
        if not body.entries:
            out.activity.SetInParent()  # a view notice: an Activity with no entries
        add = out.activity.publishers.add  # built in place: a third faster than built, then copied in
        for e in body.entries:
            add(publisher=e.publisher, first_seq=e.first_seq, pubs=e.pubs, acked_through=e.acked_through)
    else:
        out.catchup.joining = body.joining
        out.catchup.publishers.extend(
            peer_pb2.PublisherState(
                publisher=s.publisher,
                last_pub=s.last_pub,
                last_ack=s.last_ack,
                pending_first_seq=s.pending_first_seq,
                pending=s.pending,
            )
            for s in body.publishers
        )
    return out


def from_proto(message: peer_pb2.RingMessage) -> RingMessage:
    """The ring's form of `message`; raises ValueError if it is malformed."""
    if not message.group or not message.sender or not message.receiver:
        raise ValueError("ring message without group, sender or receiver")
    kind = message.WhichOneof("body")
    body: Activity | Catchup
    if kind == "activity":
        entries = []  # checked and converted in one pass (every ring hop converts one)
        for e in message.activity.publishers:
            publisher, first_seq, pubs = e.publisher, e.first_seq, e.pubs
            if not publisher or (pubs and first_seq < 1):
                raise ValueError(f"malformed activity entry for {publisher!r}")
            entries.append(PublisherActivity(publisher, first_seq, list(pubs), e.acked_through))
        body = Activity(entries)
    elif kind == "catchup":
        for s in message.catchup.publishers:
            if not s.publisher or s.last_ack > s.last_pub or (s.pending and s.pending_first_seq < 1):
                raise ValueError(f"malformed catchup entry for {s.publisher!r}")
        body = Catchup(
            [
                PublisherState(s.publisher, s.last_pub, s.last_ack, s.pending_first_seq, list(s.pending))
                for s in message.catchup.publishers
            ],
            message.catchup.joining,
        )
    else:
        raise ValueError("ring message without a body")
    return RingMessage(message.group, message.sender, message.receiver, message.view_version, body)
