"""services/telemetry.py, a node's OpenTelemetry: the exporters and readers the standard variables select
(OTEL_TRACES_EXPORTER, OTEL_METRICS_EXPORTER, OTEL_EXPORTER_OTLP_PROTOCOL and the per-signal ones, the
endpoint), a bad value refused naming the variable, the span file of --trace-dir, and `configure`
installing the global providers the node's ringq.tracing hooks see (in a process of its own: a global
provider cannot be taken back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, InMemoryMetricReader, MetricReader
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from services import telemetry

ROOT = Path(__file__).resolve().parent.parent
ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}


def _exporters(readers: list[MetricReader]) -> list[type]:
    return [type(getattr(r, "_exporter", r)) for r in readers]


@pytest.mark.parametrize(
    ("environ", "spans", "metrics"),
    [
        ({}, [], []),
        (ENDPOINT, [GrpcSpans], [GrpcMetrics]),
        ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, [GrpcSpans], [GrpcMetrics]),
        ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, [HttpSpans], [HttpMetrics]),
        (
            {**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"},
            [HttpSpans],
            [GrpcMetrics],
        ),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317/"}, [GrpcSpans], []),
        ({"OTEL_TRACES_EXPORTER": "console"}, [ConsoleSpanExporter], []),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, [], [GrpcMetrics]),
        (
            {**ENDPOINT, "OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_METRICS_EXPORTER": "none"},
            [GrpcSpans, ConsoleSpanExporter],
            [],
        ),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "console"}, [GrpcSpans], [ConsoleMetricExporter]),
        ({"OTEL_TRACES_EXPORTER": " ", "OTEL_METRICS_EXPORTER": ""}, [], []),
    ],
    ids=[
        "nothing",
        "endpoint",
        "grpc",
        "http",
        "per-signal-protocol",
        "traces-endpoint-only",
        "console",
        "traces-none",
        "both-span-exporters",
        "console-metrics",
        "blank",
    ],
)
def test_the_variables_select_the_exporters(environ: dict[str, str], spans: list[type], metrics: list[type]) -> None:
    assert [type(e) for e in telemetry.span_exporters(environ)] == spans
    assert _exporters(telemetry.metric_readers((), environ)) == metrics


def test_readers_the_node_brings_come_first() -> None:
    prometheus = InMemoryMetricReader()  # stands for the Prometheus scrape's reader
    readers = telemetry.metric_readers([prometheus], ENDPOINT)
    assert readers[0] is prometheus and _exporters(readers[1:]) == [GrpcMetrics]
    assert telemetry.meter_provider("ringq-node", "node1", [], {}) is None, "no reader: no provider"
    assert telemetry.meter_provider("ringq-node", "node1", [InMemoryMetricReader()], {}) is not None


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER='jaeger': jaeger is not one of otlp, console, none"),
        ({"OTEL_METRICS_EXPORTER": "otlp,zipkin"}, "OTEL_METRICS_EXPORTER='otlp,zipkin': zipkin"),
        ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"),
        ({**ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='udp'"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(environ: dict[str, str], named: str) -> None:
    with pytest.raises(telemetry.TelemetryError, match="^" + named.replace("(", r"\(").replace("?", r"\?")):
        telemetry.span_exporters(environ)
        telemetry.metric_readers((), environ)


def test_the_span_file_of_trace_dir(tmp_path: Path) -> None:
    assert telemetry.tracer_provider("ringq-node", "node1", None, None, {}) is None, "nothing asked: nothing"
    provider = telemetry.tracer_provider("ringq-node", "node1", str(tmp_path), None, {"OTEL_SERVICE_NAME": "svc"})
    assert provider is not None
    with provider.get_tracer("t").start_as_current_span("ringq.enqueue", attributes={"ringq.queue": "q"}):
        pass
    provider.shutdown()
    (line,) = (tmp_path / "spans-node1.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert (record["name"], record["kind"], record["process"], record["service"]) == (
        "ringq.enqueue",
        "INTERNAL",
        "node1",
        "svc",
    )
    assert record["attributes"] == {"ringq.queue": "q"} and record["parent_span_id"] is None
    assert len(record["trace_id"]) == 32 and len(record["span_id"]) == 16
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider), "built, not installed"


_CONFIGURE = """
import json
from opentelemetry import metrics, trace
from ringq import tracing
from services import telemetry
before = (tracing.enabled(), tracing.metrics_enabled())
on = telemetry.configure("ringq-node", "node9", None)
print(json.dumps({
    "before": before,
    "on": on,
    "after": (tracing.enabled(), tracing.metrics_enabled()),
    "tracer_provider": type(trace.get_tracer_provider()).__module__,
    "meter_provider": type(metrics.get_meter_provider()).__module__,
    "again": telemetry.configure("ringq-node", "node9", None),
}))
telemetry.shutdown()
"""


def test_configure_installs_the_global_providers_the_node_hooks_see() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "console",
        "OTEL_METRIC_EXPORT_INTERVAL": "60000",
    }
    done = subprocess.run(
        [sys.executable, "-c", _CONFIGURE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"before"')))
    assert seen == {
        "before": [False, False],
        "on": True,
        "after": [True, True],
        "tracer_provider": "opentelemetry.sdk.trace",
        "meter_provider": "opentelemetry.sdk.metrics._internal",
        "again": True,
    }


def test_a_node_with_a_bad_variable_exits_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {"OTEL_TRACES_EXPORTER": "jaeger"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.node",
            "--id",
            "n1",
            "--listen",
            "127.0.0.1:0",
            "--coordinator",
            "127.0.0.1:1",
        ],
        cwd=tmp_path,
        env=env | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients" / "python")])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ringq node: OTEL_TRACES_EXPORTER='jaeger': jaeger is not one of otlp, console, none"
    )
