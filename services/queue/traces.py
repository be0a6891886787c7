"""Spans of a traced message's life inside a node (docs/observability.md): enqueue, each ring hop,
each mirror's apply, confirm and delivery.

Responsible for: turning what the queue runtime does into spans in the trace
a message carries in its `traceparent` header. Only messages that carry one
produce spans; callers check `tracing.enabled()` first, so with tracing off
none of this runs. Every span is a moment (start = end) whose parent is the
client's publish span, so a trace shows each stage's time since the publish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ringq import tracing
from services.gm.messages import Activity, RingMessage
from services.queue import wire
from services.queue.master import Delivery
from services.queue.ops import Enqueue, Message, Report, Transaction, unpacked


def _traced(reports: Iterable[Report]) -> list[Message]:
    """The messages of enqueue reports that carry a trace context."""
    messages: list[Message] = []
    for report in reports:
        for change in unpacked(report):
            if isinstance(change, Enqueue) and tracing.TRACEPARENT in change.message.headers:
                messages.append(change.message)
    return messages


def _attributes(queue: str, node: str, message: Message) -> dict[str, str | int]:
    return {
        "ringq.queue": queue,
        "ringq.node": node,
        "ringq.message_id": message.id,
        "ringq.publisher": message.publisher,
        "ringq.seq": message.publisher_seq,
    }


def enqueued(queue: str, node: str, group: str, reports: Iterable[Report]) -> None:
    """The master decided these enqueues and handed them to the ring."""
    for message in _traced(reports):
        tracing.event_span("ringq.enqueue", message.headers, _attributes(queue, node, message) | {"ringq.group": group})


def confirmed(queue: str, node: str, reports: Iterable[Report]) -> None:
    """The ring confirmed the step: every member holds these messages; confirms go out."""
    for message in _traced(reports):
        tracing.event_span("ringq.confirm", message.headers, _attributes(queue, node, message))


def delivered(queue: str, node: str, deliveries: Iterable[Delivery]) -> None:
    for delivery in deliveries:
        message = delivery.message
        if tracing.TRACEPARENT in message.headers:
            attributes = _attributes(queue, node, message) | {
                "ringq.consumer": delivery.consumer,
                "ringq.redelivered": delivery.redelivered,
                "ringq.delivery_count": message.delivery_count,
            }
            tracing.event_span("ringq.deliver", message.headers, attributes)


def mirror_applied(queue: str, node: str, group: str, report: Report) -> None:
    for message in _traced([report]):
        tracing.event_span(
            "ringq.mirror.apply", message.headers, _attributes(queue, node, message) | {"ringq.group": group}
        )


def ring_hop_observer(queue: str, node: str) -> Callable[[RingMessage, str], None]:
    """What a member calls for each ring message it receives: a `ringq.ring.hop` span for each traced
    enqueue it carries (found without decoding reports that carry no trace context)."""

    def observe(message: RingMessage, from_node: str) -> None:
        body = message.body
        if not isinstance(body, Activity):
            return
        for activity in body.entries:
            for payload in activity.pubs:
                if tracing.TRACEPARENT_BYTES not in payload:
                    continue
                try:
                    report = wire.decode(payload)
                except ValueError:
                    continue
                if not isinstance(report, Enqueue | Transaction):
                    continue
                for traced in _traced([report]):
                    attributes = _attributes(queue, node, traced) | {
                        "ringq.group": message.group,
                        "ringq.view_version": message.view_version,
                        "ringq.hop_from": from_node,
                    }
                    tracing.event_span("ringq.ring.hop", traced.headers, attributes)

    return observe
