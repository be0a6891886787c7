"""OTel metrics and spans over OTLP: nodes started with the standard OTEL_EXPORTER_OTLP_ENDPOINT export
queue depth (ready, unacknowledged), consumers, publish / deliver / ack counters, the ring round trip (in
seconds) and the node's identity and health to a collector (a fake one here, serving OTLP/gRPC on
127.0.0.1), or over OTLP/HTTP when OTEL_EXPORTER_OTLP_PROTOCOL says http/protobuf.
tests/test_prometheus.py scrapes the same instruments."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from ringq import aio
from services import cluster
from services.queue.metrics import (
    ACKED,
    CONSUMERS,
    DELIVERED,
    IDENTITY,
    MESSAGES,
    MESSAGES_READY,
    MESSAGES_UNACKED,
    PUBLISHED,
    ROUND_TRIP,
    SERVING,
)
from tests.clusters import NODE_ARGS, access

pytestmark = pytest.mark.integration


class FakeCollector(metrics_service_pb2_grpc.MetricsServiceServicer, trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps the latest value of every metric by name, and counts spans by name."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[Any]] = {}
        self.span_names: dict[str, int] = {}

    def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            for resource in request.resource_metrics:
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        self.metrics.setdefault(metric.name, []).append(metric)
            return metrics_service_pb2.ExportMetricsServiceResponse()
        for resource_spans in request.resource_spans:
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.span_names[span.name] = self.span_names.get(span.name, 0) + 1
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector() -> Iterator[tuple[FakeCollector, str]]:
    fake = FakeCollector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(fake, server)  # type: ignore[no-untyped-call]
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(fake, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        server.stop(None)


def _attributes(point: Any) -> dict[str, str]:
    return {a.key: a.value.string_value for a in point.attributes}


def _sum(points: list[Any]) -> float:
    return float(sum(p.as_int or p.as_double for p in points))


def test_nodes_export_queue_metrics_and_spans_over_otlp(
    collector: tuple[FakeCollector, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, endpoint = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "300")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    info = cluster.up(3, tmp_path, node_args=NODE_ARGS, tls=True)  # the nodes inherit the environment
    try:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")  # this process does not export: no client tracing

        masters: list[str] = []

        async def traffic() -> None:
            async with aio.Connection(info.node_addresses, **access(info)) as connection:
                masters.append((await connection.declare_queue("metered")).master_node)
                await connection.producer("metered").publish_many([b"x"] * 50)
                consumer = connection.consumer("metered", prefetch=10)
                async for delivery in consumer:
                    delivery.ack()
                    if delivery.seq == 30:
                        break
                await consumer.close()

        asyncio.run(traffic())

        # Every figure checked below comes with some export: wait for the last of them (a loaded CI run read
        # the metrics as soon as the publishes had been exported, before the deliveries were).
        def exported(name: str) -> int:
            return max((p.as_int for m in fake.metrics.get(name, []) for p in m.sum.data_points), default=0)

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if (
                exported(PUBLISHED) >= 50
                and exported(DELIVERED) >= 30
                and exported(ACKED) >= 1
                and ROUND_TRIP in fake.metrics
                and {MESSAGES, MESSAGES_READY, MESSAGES_UNACKED, CONSUMERS, IDENTITY, SERVING} <= set(fake.metrics)
            ):
                break
            time.sleep(0.2)
        latest = {name: series[-1] for name, series in fake.metrics.items()}
        assert latest[PUBLISHED].sum.data_points[0].as_int == 50
        assert latest[DELIVERED].sum.data_points[0].as_int >= 30
        assert latest[ACKED].sum.data_points[0].as_int >= 1
        assert latest[ROUND_TRIP].histogram.data_points[0].count > 0
        assert latest[ROUND_TRIP].unit == "s"
        assert {MESSAGES, MESSAGES_READY, MESSAGES_UNACKED, CONSUMERS, IDENTITY, SERVING} <= set(latest)
        (point,) = [p for p in latest[MESSAGES].gauge.data_points if _attributes(p)["ringq.queue"] == "metered"]
        assert _attributes(point) == {"ringq.vhost": "/", "ringq.queue": "metered", "ringq.node": masters[0]}
    finally:
        cluster.down(tmp_path)


class _HttpCollector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP collector (protobuf bodies at /v1/metrics and /v1/traces): metric names and span names seen."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _HttpExport)
        self.metric_names: set[str] = set()
        self.span_names: set[str] = set()
        self.paths: set[str] = set()


class _HttpExport(http.server.BaseHTTPRequestHandler):
    server: _HttpCollector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.paths.add(self.path)
        if self.path == "/v1/metrics":
            metrics = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
            for resource in metrics.resource_metrics:
                for scope in resource.scope_metrics:
                    self.server.metric_names.update(m.name for m in scope.metrics)
            answer = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
        else:
            spans = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            for resource_spans in spans.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.server.span_names.update(s.name for s in scope_spans.spans)
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_nodes_export_over_otlp_http_when_the_protocol_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf: the same metrics and spans, POSTed to /v1/metrics and
    /v1/traces (services/telemetry.py picks the exporters)."""
    collector = _HttpCollector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.server_address[1]}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "300")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        info = cluster.up(3, tmp_path, node_args=NODE_ARGS, tls=True)
        try:

            async def traffic() -> None:
                # A provider of the application's, exporting nowhere: the messages carry trace context,
                # so the nodes record their spans.
                connected = aio.Connection(info.node_addresses, **access(info), tracer_provider=TracerProvider())
                async with connected as c:
                    await c.declare_queue("metered.http")
                    await c.producer("metered.http").publish_many([b"x"] * 5)

            asyncio.run(traffic())
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if PUBLISHED in collector.metric_names and "ringq.enqueue" in collector.span_names:
                    break
                time.sleep(0.2)
            assert {"/v1/metrics", "/v1/traces"} <= collector.paths
            assert {PUBLISHED, MESSAGES} <= collector.metric_names
            assert {"ringq.enqueue", "ringq.confirm"} <= collector.span_names
        finally:
            cluster.down(tmp_path)
    finally:
        collector.shutdown()
        collector.server_close()
