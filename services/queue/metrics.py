"""A node's metrics through the OpenTelemetry metrics API (docs/observability.md has the table).

Responsible for: publish / deliver / ack counters, the ring round trip of
queue steps, observable gauges for the depth (ready, unacknowledged), consumers
and sync progress of the queues whose master runs on this node, and the node's
identity and health. The same instruments go over OTLP and to a Prometheus
scrape (`ringq node --prometheus`), which names them as OpenTelemetry's
Prometheus translation does: dots become underscores, a unit other than an
annotation such as {message} is appended (seconds), counters end in _total.

Guarantees: created only when metrics are on (`ringq.tracing.metrics_enabled()`);
otherwise the runtime holds None and records nothing. Queue series carry
`ringq.vhost`, `ringq.queue` and `ringq.node`; a queue's gauges come from the
node of its master only, so summing over nodes counts each queue once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import metrics

from services.queue.master import QueueMaster, Step
from services.queue.ops import Deliver, Enqueue, Settle, unpacked

# Instrument names (OpenTelemetry) and, in docs/observability.md, the Prometheus names they become.
MESSAGES = "ringq.queue.messages"
MESSAGES_READY = "ringq.queue.messages.ready"
MESSAGES_UNACKED = "ringq.queue.messages.unacked"
CONSUMERS = "ringq.queue.consumers"
PUBLISHED = "ringq.queue.messages.published"
DELIVERED = "ringq.queue.messages.delivered"
ACKED = "ringq.queue.messages.acked"
SYNC_REMAINING = "ringq.queue.sync_remaining"
ROUND_TRIP = "ringq.ring.round_trip.duration"
IDENTITY = "ringq.identity.info"
SERVING = "ringq.node.serving"
# The ring round trip of a queue step, in seconds: from half a millisecond (loopback) to ten seconds.
ROUND_TRIP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MESSAGE = "{message}"

# (vhost, queue name, master) of every queue mastered on this node.
Masters = Callable[[], Iterable[tuple[str, str, QueueMaster]]]


class QueueMetrics:
    """The queue instruments of one node: `masters` lists the queues mastered here, `vhost_of` names the
    vhost of a queue's GM group ("" if unknown)."""

    def __init__(self, node: str, masters: Masters, vhost_of: Callable[[str], str] = lambda group: "") -> None:
        meter = metrics.get_meter("ringq")
        self.node = node
        self._masters = masters
        self._vhost_of = vhost_of
        self.published = meter.create_counter(PUBLISHED, unit=MESSAGE, description="messages confirmed into queues")
        self.delivered = meter.create_counter(
            DELIVERED, unit=MESSAGE, description="messages delivered to consumers (and basic.get)"
        )
        self.acked = meter.create_counter(ACKED, unit=MESSAGE, description="deliveries acknowledged by consumers")
        self.round_trip = meter.create_histogram(
            ROUND_TRIP,
            unit="s",
            description="from a master deciding a queue step to the step having gone round its ring",
            explicit_bucket_boundaries_advisory=ROUND_TRIP_BUCKETS,
        )
        meter.create_observable_gauge(
            MESSAGES, [self._gauge(lambda m: m.contents.depth)], MESSAGE, "messages ready and unacknowledged"
        )
        meter.create_observable_gauge(
            MESSAGES_READY, [self._gauge(lambda m: len(m.contents))], MESSAGE, "messages ready for delivery"
        )
        meter.create_observable_gauge(
            MESSAGES_UNACKED,
            [self._gauge(lambda m: len(m.contents.unacked))],
            MESSAGE,
            "messages delivered and not yet acknowledged",
        )
        meter.create_observable_gauge(
            CONSUMERS, [self._gauge(lambda m: len(m.consumer_tags))], "{consumer}", "consumers of the queue"
        )
        meter.create_observable_gauge(
            SYNC_REMAINING, [self._sync], MESSAGE, "messages still to send to a mirror being synchronised"
        )

    def step_completed(self, queue: str, group: str, step: Step, ring_ms: float) -> None:
        """A master's step completed `ring_ms` after it was decided: count what it published, delivered (to
        consumers and to basic.get alike: the Deliver reports), acked (a committed transaction's too)."""
        if step.reports:
            published = delivered = acked = 0
            for report in (change for packed in step.reports for change in unpacked(packed)):
                if isinstance(report, Enqueue):
                    published += 1
                elif isinstance(report, Deliver):
                    delivered += len(report.ids)
                elif isinstance(report, Settle):
                    acked += len(report.ids)
            self.step_done(queue, group, published, delivered, acked, ring_ms)

    def step_done(self, queue: str, group: str, published: int, delivered: int, acked: int, ring_ms: float) -> None:
        attributes = {"ringq.vhost": self._vhost_of(group), "ringq.queue": queue, "ringq.node": self.node}
        if published:
            self.published.add(published, attributes)
        if delivered:
            self.delivered.add(delivered, attributes)
        if acked:
            self.acked.add(acked, attributes)
        self.round_trip.record(ring_ms / 1000.0, {"ringq.group": group, "ringq.node": self.node})

    def _gauge(
        self, read: Callable[[QueueMaster], int]
    ) -> Callable[[metrics.CallbackOptions], Iterable[metrics.Observation]]:
        def observe(_options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
            for vhost, name, master in list(self._masters()):
                attributes = {"ringq.vhost": vhost, "ringq.queue": name, "ringq.node": self.node}
                yield metrics.Observation(read(master), attributes)

        return observe

    def _sync(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for vhost, name, master in list(self._masters()):
            for target, remaining in master.sync_remaining().items():
                attributes = {
                    "ringq.vhost": vhost,
                    "ringq.queue": name,
                    "ringq.node": self.node,
                    "ringq.mirror": target,
                }
                yield metrics.Observation(remaining, attributes)


def node_gauges(node: str, version: str, serving: Callable[[], bool]) -> None:
    """The node's own gauges: its identity (always 1, its id and version as attributes, like RabbitMQ's
    rabbitmq_identity_info) and whether its health service says SERVING (1) or not (0)."""
    meter = metrics.get_meter("ringq")
    identity = {"ringq.node": node, "ringq.version": version}
    meter.create_observable_gauge(
        IDENTITY, [lambda _options: [metrics.Observation(1, identity)]], "1", "this node's id and ringq version"
    )
    meter.create_observable_gauge(
        SERVING,
        [lambda _options: [metrics.Observation(int(serving()), {"ringq.node": node})]],
        "1",
        "1 while the node's health service says SERVING (registered, joined, not draining), else 0",
    )
