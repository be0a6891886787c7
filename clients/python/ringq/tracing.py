"""OpenTelemetry in ringq, through the OpenTelemetry API only: the SDK's spans and metrics, named by the
OpenTelemetry messaging semantic conventions, the node's tracing hooks, and W3C trace context in message
headers.

Responsible for: whether a tracer or meter provider is installed (`enabled()`, `metrics_enabled()`: the
process's global ones, or those an application hands a Connection), the spans and metrics of a client
connection (`ClientTelemetry`: publish, receive, process and settle spans; sent and consumed message
counters and the operation duration histogram), moments of a traced message's life on a node
(`event_span`), and carrying a message's trace context in its headers (`traceparent`, `tracestate`).

Guarantees: this module never installs a provider, processor or exporter: an application configures
OpenTelemetry (`trace.set_tracer_provider(...)`, or `Connection(..., tracer_provider=...)`), and a node's
process is configured by services/telemetry.py. With no provider installed, `enabled()` is False and
callers skip every tracing call on the message path (the check costs a clock read); a global provider
installed later is seen within RECHECK_SECONDS, and at once by a Connection made after it.

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    trace.set_tracer_provider(TracerProvider())      # the application's choice, exporters and all
    connection = ringq.Connection(addresses)         # its producers and consumers now record spans
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ringq._version import __version__

SCOPE = "ringq"  # the instrumentation scope of every ringq tracer and meter
TRACEPARENT = "traceparent"
TRACEPARENT_BYTES = TRACEPARENT.encode()
RECHECK_SECONDS = 1.0

# The OpenTelemetry messaging semantic conventions (opentelemetry-semantic-conventions' incubating names).
MESSAGING_SYSTEM = "ringq"
SYSTEM = "messaging.system"
DESTINATION = "messaging.destination.name"
OPERATION_TYPE = "messaging.operation.type"  # create, send, receive, process, settle
OPERATION_NAME = "messaging.operation.name"  # ringq's own: publish, receive, process, ack, requeue, reject
MESSAGE_ID = "messaging.message.id"
CLIENT_ID = "messaging.client.id"
BODY_SIZE = "messaging.message.body.size"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
SENT_MESSAGES = "messaging.client.sent.messages"
CONSUMED_MESSAGES = "messaging.client.consumed.messages"
OPERATION_DURATION = "messaging.client.operation.duration"
PROCESS_DURATION = "messaging.process.duration"
# ringq's attributes, beside the conventions' (what identifies a message to the lifecycle job).
PUBLISHER = "ringq.publisher"
SEQ = "ringq.seq"
OUTCOME = "ringq.outcome"
REDELIVERED = "ringq.redelivered"
DELIVERY_COUNT = "ringq.delivery_count"
# Ordered streams: the stream, the broker group that took (or delivered) the message, its stream_seq.
STREAM = "ringq.stream"
STREAM_GROUP = "ringq.stream.group"
STREAM_SEQ = "ringq.stream.seq"
DUPLICATE = "ringq.stream.duplicate"  # a copy the SDK dropped instead of delivering

_propagator = TraceContextTextMapPropagator()
# Whether the process's global providers are installed (once they are, for good: a global provider cannot be
# replaced), and when to look again while they are not.
_tracing_on = False
_metrics_on = False
_look_again_at = 0.0
_monotonic = time.monotonic


def _tracer_installed(provider: trace.TracerProvider) -> bool:
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def _meter_installed(provider: metrics.MeterProvider) -> bool:
    # The API hands out a proxy (a private class) until a provider is set; NoOpMeterProvider is public.
    return not isinstance(provider, NoOpMeterProvider) and type(provider).__name__ != "_ProxyMeterProvider"


def refresh() -> None:
    """Look at the process's global providers now (a Connection does, when it is made)."""
    global _tracing_on, _metrics_on, _look_again_at
    _tracing_on = _tracing_on or _tracer_installed(trace.get_tracer_provider())
    _metrics_on = _metrics_on or _meter_installed(metrics.get_meter_provider())
    _look_again_at = _monotonic() + RECHECK_SECONDS


def enabled() -> bool:
    """True once a tracer provider is installed as the process's global one (a global provider cannot be
    replaced, so this never becomes False again)."""
    if _tracing_on:
        return True
    if _monotonic() >= _look_again_at:
        refresh()
    return _tracing_on


def metrics_enabled() -> bool:
    """True once a meter provider is installed as the process's global one."""
    if _metrics_on:
        return True
    if _monotonic() >= _look_again_at:
        refresh()
    return _metrics_on


def tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """ringq's tracer from `provider`, default the global one."""
    return trace.get_tracer(SCOPE, __version__, tracer_provider=provider)


def meter(provider: metrics.MeterProvider | None = None) -> metrics.Meter:
    """ringq's meter from `provider`, default the global one."""
    return metrics.get_meter(SCOPE, __version__, meter_provider=provider)


def inject(headers: MutableMapping[str, str], span: trace.Span) -> None:
    """Put `span`'s context into message headers."""
    _propagator.inject(headers, context=trace.set_span_in_context(span))


def extract(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The trace context a message carries, or None if it carries none."""
    if TRACEPARENT not in headers:
        return None
    return _propagator.extract(headers)


def event_span(
    name: str,
    headers: Mapping[str, str],
    attributes: Mapping[str, Any],
    *,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    using: trace.Tracer | None = None,
) -> None:
    """Record a span for a moment in a traced message's life (start = end = now), a child of the context
    the message carries; nothing for a message that carries none."""
    parent = extract(headers)
    if parent is None:
        return
    (using or tracer()).start_span(name, context=parent, kind=kind, attributes=dict(attributes)).end()


class ClientTelemetry:
    """The spans and metrics of one client connection, through `tracer_provider` and `meter_provider`
    (default: the process's global ones, whatever the application installs, when it does).

    Spans: `publish {queue}` (PRODUCER, from send until the confirm; its context rides in the message's
    headers), `receive {queue}` (CONSUMER, when a traced delivery reaches the application), `process
    {queue}` (CONSUMER, around Consumer.run's callback) and `ack|requeue|reject {queue}` (CLIENT, settle).
    Metrics: messaging.client.sent.messages, messaging.client.consumed.messages,
    messaging.client.operation.duration (publish to confirm; get), messaging.process.duration."""

    def __init__(
        self,
        client_id: str,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self.client_id = client_id
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._tracing = tracer_provider is not None and _tracer_installed(tracer_provider)
        self._metering = meter_provider is not None and _meter_installed(meter_provider)
        self.tracer = tracer(tracer_provider)
        self._instruments: _Instruments | None = None
        refresh()

    @property
    def tracing(self) -> bool:
        """Whether spans are recorded (a provider is installed)."""
        return self._tracing if self._tracer_provider is not None else enabled()

    @property
    def metering(self) -> bool:
        """Whether metrics are recorded (a provider is installed)."""
        return self._metering if self._meter_provider is not None else metrics_enabled()

    def _base(self, queue: str, operation_type: str, operation: str) -> dict[str, Any]:
        return {
            SYSTEM: MESSAGING_SYSTEM,
            DESTINATION: queue,
            OPERATION_TYPE: operation_type,
            OPERATION_NAME: operation,
            CLIENT_ID: self.client_id,
        }

    def instruments(self) -> _Instruments:
        if self._instruments is None:
            self._instruments = _Instruments(meter(self._meter_provider))
        return self._instruments

    # ------------------------------------------------------------------ publish

    def publish_span(self, queue: str, publisher: str, seq: int, body_size: int, server: str) -> trace.Span:
        """The span of one message's publish, until `published`."""
        attributes = self._base(queue, "send", "publish") | {PUBLISHER: publisher, SEQ: seq, BODY_SIZE: body_size}
        host, _, port = server.rpartition(":")
        if host and port.isdigit():
            attributes |= {SERVER_ADDRESS: host.strip("[]"), SERVER_PORT: int(port)}
        return self.tracer.start_span(f"publish {queue}", kind=trace.SpanKind.PRODUCER, attributes=attributes)

    def stream_publish_span(self, stream: str, seq: int, body_size: int, server: str) -> trace.Span:
        """The span of one message's publish to an ordered stream, until `stream_published`."""
        span = self.publish_span(stream, "", seq, body_size, server)
        span.set_attributes({STREAM: stream, STREAM_SEQ: seq})
        return span

    def stream_published(
        self, stream: str, span: trace.Span | None, started: float, group: str, error: str | None
    ) -> None:
        """A stream message's publish ended: confirmed by `group`, or failed (`error`)."""
        if span is not None and group:
            span.set_attribute(STREAM_GROUP, group)
        self.published(stream, span, started, "confirmed" if error is None else None, error)

    def stream_received(
        self,
        stream: str,
        headers: Mapping[str, str],
        group: str,
        seq: int,
        redelivered: bool,
        duplicate: bool,
        body_size: int,
    ) -> None:
        """A stream delivery reached the SDK: delivered to the application, or dropped as a `duplicate`."""
        if self.tracing:
            attributes = self._base(stream, "receive", "receive") | {
                STREAM: stream,
                STREAM_GROUP: group,
                STREAM_SEQ: seq,
                REDELIVERED: redelivered,
                DUPLICATE: duplicate,
                BODY_SIZE: body_size,
            }
            event_span(f"receive {stream}", headers, attributes, kind=trace.SpanKind.CONSUMER, using=self.tracer)
        if self.metering and not duplicate:
            attributes = {SYSTEM: MESSAGING_SYSTEM, DESTINATION: stream, OPERATION_NAME: "receive"}
            self.instruments().consumed.add(1, attributes)

    def published(
        self, queue: str, span: trace.Span | None, started: float, outcome: str | None, error: str | None
    ) -> None:
        """A message's publish ended: confirmed (`outcome`) or failed (`error`, a status code name)."""
        if span is not None:
            if outcome is not None:
                span.set_attribute(OUTCOME, outcome)
            if error is not None:
                span.set_attribute(ERROR_TYPE, error)
                span.set_status(trace.StatusCode.ERROR, error)
            span.end()
        if self.metering:
            attributes = self._base(queue, "send", "publish")
            del attributes[CLIENT_ID]  # metric attributes stay few: the client id would make a series per client
            failure = error or ("rejected" if outcome == "rejected" else None)
            if failure is not None:
                attributes[ERROR_TYPE] = failure
            instruments = self.instruments()
            instruments.sent.add(1, attributes)
            instruments.duration.record(time.monotonic() - started, attributes)

    # ------------------------------------------------------------------ consume

    def received(
        self,
        queue: str,
        headers: Mapping[str, str],
        message_id: int,
        publisher: str,
        seq: int,
        redelivered: bool,
        delivery_count: int,
        body_size: int,
        started: float | None = None,
    ) -> None:
        """A delivery reached the application (from a consume stream, or `get` when `started` is given)."""
        if self.tracing:
            attributes = self._base(queue, "receive", "receive") | {
                MESSAGE_ID: str(message_id),
                BODY_SIZE: body_size,
                PUBLISHER: publisher,
                SEQ: seq,
                REDELIVERED: redelivered,
                DELIVERY_COUNT: delivery_count,
            }
            event_span(f"receive {queue}", headers, attributes, kind=trace.SpanKind.CONSUMER, using=self.tracer)
        if self.metering:
            attributes = {SYSTEM: MESSAGING_SYSTEM, DESTINATION: queue, OPERATION_NAME: "receive"}
            instruments = self.instruments()
            instruments.consumed.add(1, attributes)
            if started is not None:
                attributes[OPERATION_TYPE] = "receive"
                instruments.duration.record(time.monotonic() - started, attributes)

    def settled(self, queue: str, headers: Mapping[str, str], kind: str, message_id: int) -> None:
        """The application settled a delivery (`kind`: ack, requeue, reject)."""
        if self.tracing:
            attributes = self._base(queue, "settle", kind) | {MESSAGE_ID: str(message_id)}
            event_span(f"{kind} {queue}", headers, attributes, kind=trace.SpanKind.CLIENT, using=self.tracer)

    @contextlib.contextmanager
    def processing(self, queue: str, headers: Mapping[str, str], message_id: int) -> Iterator[None]:
        """Around the application's handling of one delivery: a `process {queue}` span (current while it
        runs, so the application's own spans are its children) and messaging.process.duration."""
        started = time.monotonic()
        parent = extract(headers) if self.tracing else None
        span: trace.Span | None = None
        if parent is not None:
            attributes = self._base(queue, "process", "process") | {MESSAGE_ID: str(message_id)}
            span = self.tracer.start_span(
                f"process {queue}", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes
            )
        failure: str | None = None
        try:
            if span is None:
                yield
            else:
                with trace.use_span(span, end_on_exit=True):
                    yield
        except BaseException as error:
            failure = type(error).__qualname__
            raise
        finally:
            if self.metering:
                attributes = {SYSTEM: MESSAGING_SYSTEM, DESTINATION: queue, OPERATION_NAME: "process"}
                if failure is not None:
                    attributes[ERROR_TYPE] = failure
                self.instruments().process.record(time.monotonic() - started, attributes)


class _Instruments:
    """The instruments of one ClientTelemetry (the conventions' names and units)."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.sent = meter.create_counter(
            SENT_MESSAGES, unit="{message}", description="Messages the producer sent, counted when answered."
        )
        self.consumed = meter.create_counter(
            CONSUMED_MESSAGES, unit="{message}", description="Messages delivered to the application."
        )
        self.duration = meter.create_histogram(
            OPERATION_DURATION, unit="s", description="Publish until its confirm; get until its answer."
        )
        self.process = meter.create_histogram(
            PROCESS_DURATION, unit="s", description="The application's handling of a delivery (Consumer.run)."
        )
