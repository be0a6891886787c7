"""Queue metrics through the OpenTelemetry metrics API (docs/observability.md).

Responsible for: publish / deliver / ack counters, the ring round trip of
queue steps, and observable gauges for depth and sync progress of the
queues whose master runs on this node. Guarantees: created only when
metrics export is on (`ringq.tracing.metrics_enabled()`); otherwise the
runtime holds None and records nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry import metrics

from services.queue.master import QueueMaster, Step
from services.queue.ops import Enqueue, Settle


class QueueMetrics:
    """The instruments of one node; `masters` lists (queue name, master) of the queues mastered here."""

    def __init__(self, node: str, masters: Callable[[], Iterable[tuple[str, QueueMaster]]]) -> None:
        meter = metrics.get_meter("ringq")
        self.node = node
        self._masters = masters
        self.published = meter.create_counter("ringq.queue.published", unit="{message}")
        self.delivered = meter.create_counter("ringq.queue.delivered", unit="{message}")
        self.acked = meter.create_counter("ringq.queue.acked", unit="{message}")
        self.round_trip = meter.create_histogram("ringq.ring.round_trip", unit="ms")
        meter.create_observable_gauge("ringq.queue.depth", callbacks=[self._depths], unit="{message}")
        meter.create_observable_gauge("ringq.queue.sync_remaining", callbacks=[self._sync], unit="{message}")

    def step_completed(self, queue: str, group: str, step: Step, ring_ms: float) -> None:
        """A master's step completed `ring_ms` after it was decided: count what it published, delivered, acked."""
        if step.reports:
            published = sum(1 for report in step.reports if isinstance(report, Enqueue))
            acked = sum(len(report.ids) for report in step.reports if isinstance(report, Settle))
            self.step_done(queue, group, published, len(step.deliveries), acked, ring_ms)

    def step_done(self, queue: str, group: str, published: int, delivered: int, acked: int, ring_ms: float) -> None:
        attributes = {"ringq.queue": queue, "ringq.node": self.node}
        if published:
            self.published.add(published, attributes)
        if delivered:
            self.delivered.add(delivered, attributes)
        if acked:
            self.acked.add(acked, attributes)
        self.round_trip.record(ring_ms, {"ringq.group": group, "ringq.node": self.node})

    def _depths(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for name, master in self._masters():
            yield metrics.Observation(master.contents.depth, {"ringq.queue": name, "ringq.node": self.node})

    def _sync(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for name, master in self._masters():
            for target, remaining in master.sync_remaining().items():
                attributes = {"ringq.queue": name, "ringq.node": self.node, "ringq.mirror": target}
                yield metrics.Observation(remaining, attributes)
