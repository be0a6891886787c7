"""`make bench-floor` (bench/grpc_floor.py): its table, and a short real run of the relay path (every message
crosses the five hops and arrives)."""

from __future__ import annotations

import pytest

from bench import grpc_floor
from bench.grpc_floor import PathResult


def test_the_section_names_the_command_and_every_figure() -> None:
    text = grpc_floor.section(
        {256: (40e-6, 50e-6), 26_000: (35e-6, 45e-6)},
        [PathResult(500.0, 3000, 3000, 1.26, 10.0, 0.6)],
        "make bench-floor",
    )
    assert text.startswith(grpc_floor.MARK_BEGIN) and text.endswith(grpc_floor.MARK_END)
    assert "Command: `make bench-floor`" in text
    assert "| 256 bytes | 90 (40 + 50) |" in text
    assert "| 26,000 bytes | 80 (35 + 45) |" in text
    assert "| 500 msgs/s | 3,000 of 3,000 | 1.26 | 10.00 | 0.60 |" in text


def test_percentiles_of_the_latencies() -> None:
    values = [float(v) for v in range(1, 101)]
    assert grpc_floor._percentile(values, 0.5) == 51.0
    assert grpc_floor._percentile(values, 0.99) == 100.0


@pytest.mark.integration
def test_every_message_crosses_the_five_hops() -> None:
    result = grpc_floor.measure_path(rate=200.0, seconds=0.5)
    assert result.sent > 0
    assert result.received == result.sent, "a message was lost on the relay path"
    assert 0 < result.p50_ms <= result.p99_ms
    assert result.relay_cores > 0
