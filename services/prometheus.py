"""A node's Prometheus scrape endpoint (`ringq node --prometheus HOST:PORT`): its OpenTelemetry metrics,
the same instruments OTLP exports, served at http://HOST:PORT/metrics in the Prometheus text format.

Responsible for: the OpenTelemetry Prometheus exporter's metric reader (handed to
`services.telemetry.configure`, which installs the meter provider), with the process's own collectors
beside it (process_* CPU, memory, file descriptors; python_gc_*, python_info), and the HTTP server that
Prometheus scrapes, on a daemon thread. Names follow OpenTelemetry's Prometheus translation: dots become
underscores, a unit other than an annotation such as {message} is appended (seconds), counters end in
_total; the resource (service.name, ringq.process...) is the target_info series. docs/observability.md
has the table.

Guarantees: `start` binds the address or raises OSError saying which; `close` stops serving (idempotent).
Each scrape reads the gauges then, from the scrape's thread.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, start_http_server


class Scrape:
    """A started scrape endpoint: `reader` for the meter provider, `address` the HOST:PORT bound."""

    def __init__(self, reader: PrometheusMetricReader, server: Any, address: str) -> None:
        self.reader = reader
        self.address = address
        self._server = server

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def start(listen: str) -> Scrape:
    """Serve metrics for Prometheus at http://`listen`/metrics (HOST:PORT, port 0: any); OSError if it
    cannot be bound."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    # No otel_scope_* labels: every instrument is the one "ringq" meter's.
    reader = PrometheusMetricReader(registry=registry, scope_info_enabled=False)
    host, _, port = listen.rpartition(":")
    try:
        server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    except OSError as error:
        raise OSError(f"cannot listen on {listen} (--prometheus): {error.strerror or error}") from None
    return Scrape(reader, server, f"{host}:{server.server_port}")
