"""OpenTelemetry in ringq's server processes: the tracer and meter providers of a node, and their exporters.

Responsible for: building, from the standard OpenTelemetry variables, the span exporters and metric readers
a node uses, and installing the providers in the node's process:
- traces: OTEL_TRACES_EXPORTER (a comma-separated list of `otlp`, `console`, `none`; unset: `otlp` when an
  OTLP endpoint is set, else nothing), plus the JSON-lines span file of `--trace-dir` (what the Spark job
  reads, docs/observability.md);
- metrics: OTEL_METRICS_EXPORTER (the same values and default), plus the readers the caller brings (the
  node's Prometheus scrape, services/prometheus.py);
- OTLP over gRPC or HTTP: OTEL_EXPORTER_OTLP_PROTOCOL (or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL /
  OTEL_EXPORTER_OTLP_METRICS_PROTOCOL) `grpc` (the default) or `http/protobuf`; endpoint, headers,
  certificates, intervals and the sampler from the other standard variables, as the exporters read them.

Guarantees: with nothing selected nothing is installed, and `ringq.tracing.enabled()` /
`metrics_enabled()` stay False, so the message path makes no tracing calls; a bad value of one of these
variables raises TelemetryError naming it, before anything is installed; `shutdown()` flushes and stops
what `configure` installed (idempotent). The client SDK never imports this module: it uses the
OpenTelemetry API only, and an application configures OpenTelemetry itself.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased

from ringq import tracing

EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "grpc"
_SIGNALS = {"traces": "TRACES", "metrics": "METRICS"}
_state: dict[str, Any] = {"tracer": None, "meter": None}


class TelemetryError(ValueError):
    """An OpenTelemetry variable has a value ringq cannot act on; the message names it."""


def exporter_names(signal: str, environ: dict[str, str] | None = None) -> list[str]:
    """The exporters OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER select for `signal` ("traces", "metrics"):
    when the variable is unset, ["otlp"] if an OTLP endpoint is set, else none."""
    env = os.environ if environ is None else environ
    upper = _SIGNALS[signal]
    variable = f"OTEL_{upper}_EXPORTER"
    text = env.get(variable)
    if text is None or not text.strip():
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{upper}_ENDPOINT")
        return ["otlp"] if endpoint else []
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in EXPORTERS]
    if unknown:
        raise TelemetryError(f"{variable}={text!r}: {', '.join(unknown)} is not one of {', '.join(EXPORTERS)}")
    return [] if "none" in names else list(dict.fromkeys(names))


def otlp_protocol(signal: str, environ: dict[str, str] | None = None) -> str:
    """The OTLP protocol for `signal`: OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL,
    else grpc."""
    env = os.environ if environ is None else environ
    for variable in (f"OTEL_EXPORTER_OTLP_{_SIGNALS[signal]}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        text = env.get(variable, "").strip()
        if text:
            if text not in PROTOCOLS:
                raise TelemetryError(f"{variable}={text!r} is not one of {', '.join(PROTOCOLS)}")
            return text
    return DEFAULT_PROTOCOL


def span_exporters(environ: dict[str, str] | None = None) -> list[SpanExporter]:
    """The span exporters the variables select (not the span file: `--trace-dir` adds it)."""
    exporters: list[SpanExporter] = []
    for name in exporter_names("traces", environ):
        if name == "console":
            exporters.append(ConsoleSpanExporter())
        elif otlp_protocol("traces", environ) == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

            exporters.append(GrpcSpans())
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

            exporters.append(HttpSpans())
    return exporters


def metric_readers(extra: Sequence[MetricReader] = (), environ: dict[str, str] | None = None) -> list[MetricReader]:
    """The metric readers of a node's meter provider: `extra` (e.g. a Prometheus scrape's reader), then one
    periodic reader (every OTEL_METRIC_EXPORT_INTERVAL) per exporter the variables select."""
    readers = list(extra)
    for name in exporter_names("metrics", environ):
        if name == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif otlp_protocol("metrics", environ) == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics

            readers.append(PeriodicExportingMetricReader(GrpcMetrics()))
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics

            readers.append(PeriodicExportingMetricReader(HttpMetrics()))
    return readers


def resource(service_name: str, process: str, environ: dict[str, str] | None = None) -> Resource:
    """The process's resource: service.name (OTEL_SERVICE_NAME, else `service_name`) and ringq.process."""
    env = os.environ if environ is None else environ
    return Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", service_name), "ringq.process": process})


def tracer_provider(
    service_name: str,
    process: str,
    trace_dir: str | None = None,
    sample_ratio: float | None = None,
    environ: dict[str, str] | None = None,
) -> TracerProvider | None:
    """A tracer provider exporting to the selected exporters and, with `trace_dir`, to
    `trace_dir/spans-<process>.jsonl`; None if neither is asked for. `sample_ratio` (0..1) samples that
    share of new traces unless OTEL_TRACES_SAMPLER says otherwise."""
    env = os.environ if environ is None else environ
    exporters = span_exporters(environ)
    if not exporters and not trace_dir:
        return None
    where = resource(service_name, process, environ)
    sampler: Sampler | None = None
    if sample_ratio is not None and "OTEL_TRACES_SAMPLER" not in env:
        sampler = ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(resource=where, sampler=sampler)
    if trace_dir:
        service = str(where.attributes.get("service.name", service_name))
        span_file = JsonLinesSpanExporter(Path(trace_dir) / f"spans-{process}.jsonl", process, service)
        provider.add_span_processor(BatchSpanProcessor(span_file, schedule_delay_millis=500))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def meter_provider(
    service_name: str,
    process: str,
    extra_readers: Sequence[MetricReader] = (),
    environ: dict[str, str] | None = None,
) -> MeterProvider | None:
    """A meter provider with `metric_readers(extra_readers)`; None if there are none."""
    readers = metric_readers(extra_readers, environ)
    if not readers:
        return None
    return MeterProvider(resource=resource(service_name, process, environ), metric_readers=readers)


def configure(
    service_name: str,
    process: str,
    trace_dir: str | None = None,
    sample_ratio: float | None = None,
    *,
    metric_readers: Sequence[MetricReader] = (),
) -> bool:
    """Install this process's tracer provider (if exporters or `trace_dir` are asked for) and meter provider
    (if readers are: the selected exporters' and `metric_readers`) as OpenTelemetry's global ones, for the
    ringq.tracing hooks of the node; once per process. Returns whether tracing is on. TelemetryError for a
    bad variable."""
    if _state["tracer"] is not None or _state["meter"] is not None:
        return _state["tracer"] is not None
    traces = tracer_provider(service_name, process, trace_dir, sample_ratio)
    meters = meter_provider(service_name, process, metric_readers)
    if traces is not None:
        trace.set_tracer_provider(traces)
        _state["tracer"] = traces
    if meters is not None:
        metrics.set_meter_provider(meters)
        _state["meter"] = meters
    if traces is not None or meters is not None:
        atexit.register(shutdown)
    tracing.refresh()
    return traces is not None


def shutdown() -> None:
    """Flush and stop what `configure` installed (idempotent)."""
    traces, meters = _state["tracer"], _state["meter"]
    _state["tracer"] = _state["meter"] = None
    if traces is not None:
        traces.shutdown()
    if meters is not None:
        meters.shutdown()


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
            "kind": span.kind.name,
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
