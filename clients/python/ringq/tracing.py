"""OpenTelemetry for ringq processes (clients and nodes): turning tracing on, the span file exporter,
and W3C trace context in message headers.

Responsible for: installing a tracer provider when asked to (the standard
`OTEL_EXPORTER_OTLP_ENDPOINT`, or a span directory from `--trace-dir` /
`RINGQ_TRACE_DIR`), and a meter provider (the same endpoint, or metric readers
the caller brings: a node's Prometheus scrape, services/prometheus.py); writing
finished spans as JSON lines in the format of docs/observability.md, and
carrying a message's trace context in its headers (`traceparent`, `tracestate`).

Guarantees: with neither an endpoint nor a directory no tracer provider is
installed and `enabled()` is False, so callers skip every tracing call on the
message path; with neither an endpoint nor a reader no meter provider is, and
`metrics_enabled()` is False. Spans and metrics of a process are flushed when
`shutdown()` runs (at exit).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_DIR_ENV = "RINGQ_TRACE_DIR"
TRACEPARENT = "traceparent"
TRACEPARENT_BYTES = TRACEPARENT.encode()
_propagator = TraceContextTextMapPropagator()
_state: dict[str, Any] = {"provider": None, "meters": None, "process": ""}


def enabled() -> bool:
    """True once `configure` installed a provider in this process."""
    return _state["provider"] is not None


def metrics_enabled() -> bool:
    """True once `configure` installed a meter provider (OTLP export, the readers it was given, or both)."""
    return _state["meters"] is not None


def configure(
    service_name: str,
    process: str,
    trace_dir: str | None = None,
    sample_ratio: float | None = None,
    *,
    metric_readers: Sequence[Any] = (),
) -> bool:
    """Install tracing for this process if an OTLP endpoint or a span directory is set, and metrics if an
    OTLP endpoint is or `metric_readers` (OpenTelemetry MetricReaders, e.g. a Prometheus scrape) are given;
    idempotent. `sample_ratio` (0..1) traces that share of new traces (default: OTEL_TRACES_SAMPLER, else
    all). Returns whether tracing is on."""
    if enabled():
        return True
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    directory = trace_dir or os.environ.get(TRACE_DIR_ENV)
    if not endpoint and not directory and not metric_readers:
        return False
    service = os.environ.get("OTEL_SERVICE_NAME", service_name)
    resource = Resource.create({"service.name": service, "ringq.process": process})
    if (endpoint or metric_readers) and not metrics_enabled():
        _configure_metrics(resource, bool(endpoint), metric_readers)
        atexit.register(shutdown)
    if not endpoint and not directory:
        return False
    sampler = None
    if sample_ratio is not None and "OTEL_TRACES_SAMPLER" not in os.environ:
        sampler = ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(resource=resource, sampler=sampler)
    if directory:
        path = Path(directory) / f"spans-{process}.jsonl"
        exporter = JsonLinesSpanExporter(path, process, service)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _state["provider"] = provider
    _state["process"] = process
    atexit.register(shutdown)
    return True


def _configure_metrics(resource: Resource, otlp: bool, metric_readers: Sequence[Any]) -> None:
    """Install the meter provider: OTLP export (every OTEL_METRIC_EXPORT_INTERVAL) if `otlp`, and
    `metric_readers`; the same instruments go to each."""
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider

    readers = list(metric_readers)
    if otlp:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    meters = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(meters)
    _state["meters"] = meters


def shutdown() -> None:
    """Flush and stop this process's tracing and metrics (idempotent)."""
    provider, meters = _state["provider"], _state["meters"]
    _state["provider"] = _state["meters"] = None
    if provider is not None:
        provider.shutdown()
    if meters is not None:
        meters.shutdown()


def tracer() -> trace.Tracer:
    provider = _state["provider"]
    if provider is None:
        return trace.NoOpTracer()
    result: trace.Tracer = provider.get_tracer("ringq")
    return result


def inject(headers: MutableMapping[str, str], span: trace.Span) -> None:
    """Put `span`'s context into message headers."""
    _propagator.inject(headers, context=trace.set_span_in_context(span))


def extract(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The trace context a message carries, or None if it carries none."""
    if TRACEPARENT not in headers:
        return None
    return _propagator.extract(headers)


def event_span(name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]) -> None:
    """Record a span for a moment in a traced message's life (start = end = now)."""
    parent = extract(headers)
    if parent is None:
        return
    tracer().start_span(name, context=parent, attributes=dict(attributes)).end()


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object a line (docs/observability.md)."""

    def __init__(self, path: Path, process: str, service: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._process = process
        self._service = service
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(self._record(span), separators=(",", ":")) + "\n" for span in spans]
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.writelines(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def _record(self, span: ReadableSpan) -> dict[str, Any]:
        context = span.context
        parent = span.parent
        return {
            "name": span.name,
            "trace_id": f"{context.trace_id:032x}" if context is not None else None,
            "span_id": f"{context.span_id:016x}" if context is not None else None,
            "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
            "start_unix_nano": span.start_time,
            "end_unix_nano": span.end_time,
            "process": self._process,
            "service": self._service,
            "attributes": dict(span.attributes or {}),
        }

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
