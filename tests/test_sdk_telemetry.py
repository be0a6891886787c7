"""The SDK and OpenTelemetry, without a cluster: importing and using ringq installs no tracer or meter
provider (whatever OTEL_* variables say) and imports no OpenTelemetry SDK; the spans and metrics a
connection records go to the providers the application chooses, named by the OpenTelemetry messaging
semantic conventions (checked against opentelemetry-semantic-conventions' own names)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes import messaging_attributes as semconv
from opentelemetry.semconv._incubating.metrics import messaging_metrics

from ringq import aio, tracing
from ringq.v1 import queue_pb2

ROOT = Path(__file__).resolve().parent.parent

_USES_THE_SDK = """
import asyncio, json, sys
import ringq
from ringq import aio
from opentelemetry import metrics, trace

addresses = ["127.0.0.1:1", "127.0.0.1:2"]
with ringq.Connection(addresses, connect_timeout=0.5) as connection:
    for call in (lambda: connection.declare_queue("q"), lambda: connection.producer("q").publish(b"x")):
        try:
            call()
        except ringq.errors.ConnectionFailed:
            pass
    consumer = connection.consumer("q")
    assert consumer.next(timeout=0.1) is None or True

async def asynchronous():
    async with aio.Connection(addresses, connect_timeout=0.5) as connection:
        try:
            await connection.producer("q").publish(b"x")
        except ringq.errors.ConnectionFailed:
            pass

asyncio.run(asynchronous())
print(json.dumps({
    "tracer_provider": type(trace.get_tracer_provider()).__name__,
    "meter_provider": type(metrics.get_meter_provider()).__name__,
    "sdk_modules": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")),
    "exporters": sorted(m for m in sys.modules if m.startswith("opentelemetry.exporter")),
}))
"""


def test_the_sdk_installs_no_provider_and_imports_no_opentelemetry_sdk(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    # What made the old SDK install exporters in the application's process: none of it does now.
    env |= {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
        "RINGQ_TRACE_DIR": str(tmp_path / "spans"),
    }
    done = subprocess.run(
        [sys.executable, "-c", _USES_THE_SDK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {
        "tracer_provider": "ProxyTracerProvider",
        "meter_provider": "_ProxyMeterProvider",
        "sdk_modules": [],
        "exporters": [],
    }
    assert not (tmp_path / "spans").exists(), "no span file either"
    assert not tracing.enabled() and not tracing.metrics_enabled(), "nor did this process get one"


def _recorded() -> tuple[tracing.ClientTelemetry, InMemorySpanExporter, InMemoryMetricReader]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    telemetry = tracing.ClientTelemetry("client-1", tracer_provider, MeterProvider(metric_readers=[reader]))
    return telemetry, spans, reader


def test_client_spans_and_metrics_follow_the_messaging_conventions() -> None:
    telemetry, spans, reader = _recorded()
    assert telemetry.tracing and telemetry.metering
    publish = telemetry.publish_span("orders", "p1", 7, 11, "127.0.0.1:7101")
    headers: dict[str, str] = {}
    tracing.inject(headers, publish)
    telemetry.published("orders", publish, 0.0, "confirmed", None)
    telemetry.received("orders", headers, 42, "p1", 7, False, 1, 11)
    telemetry.settled("orders", headers, "ack", 42)
    with telemetry.processing("orders", headers, 42):
        inner = trace.get_current_span()
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert set(finished) == {"publish orders", "receive orders", "ack orders", "process orders"}
    kinds = {name: s.kind for name, s in finished.items()}
    assert kinds == {
        "publish orders": trace.SpanKind.PRODUCER,
        "receive orders": trace.SpanKind.CONSUMER,
        "process orders": trace.SpanKind.CONSUMER,
        "ack orders": trace.SpanKind.CLIENT,
    }
    sent = finished["publish orders"].attributes or {}
    assert sent[semconv.MESSAGING_SYSTEM] == "ringq"
    assert sent[semconv.MESSAGING_DESTINATION_NAME] == "orders"
    assert sent[semconv.MESSAGING_OPERATION_TYPE] == semconv.MessagingOperationTypeValues.SEND.value
    assert sent[semconv.MESSAGING_OPERATION_NAME] == "publish"
    assert sent[semconv.MESSAGING_CLIENT_ID] == "client-1"
    assert sent[semconv.MESSAGING_MESSAGE_BODY_SIZE] == 11
    assert (sent["server.address"], sent["server.port"]) == ("127.0.0.1", 7101)
    assert (sent["ringq.publisher"], sent["ringq.seq"], sent["ringq.outcome"]) == ("p1", 7, "confirmed")
    expected_types = {
        "receive orders": semconv.MessagingOperationTypeValues.RECEIVE,
        "process orders": semconv.MessagingOperationTypeValues.PROCESS,
        "ack orders": semconv.MessagingOperationTypeValues.SETTLE,
    }
    parent = finished["publish orders"].context
    for name, operation in expected_types.items():
        span = finished[name]
        attributes = span.attributes or {}
        assert attributes[semconv.MESSAGING_OPERATION_TYPE] == operation.value, name
        assert attributes[semconv.MESSAGING_MESSAGE_ID] == "42", name
        assert span.parent is not None and parent is not None and span.parent.span_id == parent.span_id, name
        assert span.context is not None and span.context.trace_id == parent.trace_id, "one trace"
    assert inner.get_span_context().span_id == finished["process orders"].context.span_id, "current while processing"
    data = reader.get_metrics_data()
    assert data is not None
    metrics = {m.name: m for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics}
    assert set(metrics) == {
        messaging_metrics.MESSAGING_CLIENT_SENT_MESSAGES,
        messaging_metrics.MESSAGING_CLIENT_CONSUMED_MESSAGES,
        messaging_metrics.MESSAGING_CLIENT_OPERATION_DURATION,
        messaging_metrics.MESSAGING_PROCESS_DURATION,
    }
    assert metrics["messaging.client.operation.duration"].unit == "s"
    (point,) = metrics["messaging.client.sent.messages"].data.data_points
    assert (
        isinstance(point, NumberDataPoint)
        and point.value == 1
        and dict(point.attributes or {})[semconv.MESSAGING_DESTINATION_NAME] == "orders"
    )


def test_an_untraced_message_gets_no_consumer_spans_and_a_failed_publish_says_why() -> None:
    telemetry, spans, _ = _recorded()
    telemetry.received("orders", {}, 1, "p", 1, False, 1, 3)  # no traceparent: nothing to continue
    telemetry.settled("orders", {}, "ack", 1)
    publish = telemetry.publish_span("orders", "p", 2, 3, "not-an-address")
    telemetry.published("orders", publish, 0.0, None, "UNAVAILABLE")
    (failed,) = spans.get_finished_spans()
    assert failed.status.status_code == trace.StatusCode.ERROR
    assert (failed.attributes or {})["error.type"] == "UNAVAILABLE"
    assert "server.address" not in (failed.attributes or {})


def test_a_connection_records_through_the_providers_it_is_given() -> None:
    telemetry, spans, _ = _recorded()

    async def scenario() -> None:
        connection = aio.Connection("127.0.0.1:1", tracer_provider=TracerProvider())
        assert connection.telemetry.tracing and not connection.telemetry.metering
        consumer = connection.consumer("orders")
        consumer.connection.telemetry = telemetry
        headers: dict[str, str] = {}
        tracing.inject(headers, telemetry.publish_span("orders", "p", 1, 1, "h:1"))
        message = queue_pb2.QueueDelivery(consumer_tag="c", delivery_tag=1, publisher="p", seq=1, headers=headers)
        delivery = aio.Delivery(message, "orders", consumer, 0)
        ran = []
        with consumer.processing(delivery):
            ran.append(trace.get_current_span().get_span_context().is_valid)
        assert ran == [True]
        await connection.close()

    asyncio.run(scenario())
    assert [s.name for s in spans.get_finished_spans()] == ["process orders"]
