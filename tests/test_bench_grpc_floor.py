"""`make bench-floor` (bench/grpc_floor.py): its table, and a short real run of each relay path (every
message crosses its hops and arrives)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from bench import grpc_floor
from bench.grpc_floor import PathResult


def test_the_section_names_the_command_and_every_figure() -> None:
    text = grpc_floor.section(
        {256: (40e-6, 50e-6), 26_000: (35e-6, 45e-6)},
        [
            PathResult("ring", "exact", 2000.0, 12000, 12000, 1.5, 5.0, 0.9),
            PathResult("direct", "exact", 2000.0, 12000, 12000, 0.9, 1.7, 0.25),
            PathResult("ring", "exact", 2000.0, 12000, 11999, 2.5, 9.0, 1.1),
            PathResult("direct", "exact", 2000.0, 12000, 12000, 1.0, 1.8, 0.27),
            PathResult("ring", "exact", 2000.0, 12000, 12000, 2.0, 20.0, 1.0),
            PathResult("ring", "tick", 2000.0, 12000, 12000, 3.0, 6.0, 0.6),
        ],
        "make bench-floor",
    )
    assert text.startswith(grpc_floor.MARK_BEGIN) and text.endswith(grpc_floor.MARK_END)
    assert "Command: `make bench-floor`" in text
    assert "| 256 bytes | 90 (40 + 50) |" in text
    assert "| 26,000 bytes | 80 (35 + 45) |" in text
    assert "median (min-max) of 3 runs" in text
    ring, exact, tick = grpc_floor.SHAPES["ring"][0], grpc_floor.PACINGS["exact"], grpc_floor.PACINGS["tick"]
    assert (
        f"| {ring} | {exact} | 2,000 | 35,999 of 36,000 | 2.00 (1.50-2.50) | 9.00 (5.00-20.00) | 1.00 (0.90-1.10) |"
        in text
    )
    assert (
        f"| {ring} | {tick} | 2,000 | 12,000 of 12,000 | 3.00 (3.00-3.00) | 6.00 (6.00-6.00) | 0.60 (0.60-0.60) |"
        in text
    )
    direct = grpc_floor.SHAPES["direct"][0]
    assert (
        f"| {direct} | {exact} | 2,000 | 24,000 of 24,000 | 0.95 (0.90-1.00) | 1.75 (1.70-1.80) | 0.26 (0.25-0.27) |"
        in text
    )
    assert grpc_floor.SHAPES["beside"][0] not in text, "a shape that was not measured has no row"


def test_percentiles_of_the_latencies() -> None:
    values = [float(v) for v in range(1, 101)]
    assert grpc_floor._percentile(values, 0.5) == 51.0
    assert grpc_floor._percentile(values, 0.99) == 100.0


def test_messages_are_split_back_out_of_a_batch() -> None:
    batch = b"".join(grpc_floor._LENGTH.pack(len(m)) + m for m in (b"a", b"", b"xyz" * 100))
    assert list(grpc_floor._messages(batch)) == [b"a", b"", b"xyz" * 100]


def test_an_unknown_shape_is_refused() -> None:
    with pytest.raises(SystemExit):
        grpc_floor.main(["--shapes", "ring,star"])


def test_an_unknown_pacing_is_refused() -> None:
    with pytest.raises(SystemExit):
        grpc_floor.main(["--pacing", "exact,burst"])


def test_a_process_cpu_time_counts_what_it_burns() -> None:
    """The relays' CPU comes from /proc/PID/stat; a short timed part may round to no clock tick at all
    (a loaded CI run measured 0.0 over 0.5 s at 200 msgs/s), so the reading itself is checked here."""
    before = grpc_floor._cpu_seconds(os.getpid())
    started = time.process_time()
    while time.process_time() - started < 0.1:
        pass
    assert grpc_floor._cpu_seconds(os.getpid()) - before >= 0.05


@pytest.mark.integration
@pytest.mark.parametrize("shape", list(grpc_floor.SHAPES))
def test_every_message_crosses_its_path(shape: str) -> None:
    result = grpc_floor.measure_path(shape, rate=200.0, seconds=0.5)
    assert result.shape == shape
    assert result.sent == 100
    assert result.received == result.sent, "a message was lost on the relay path"
    assert 0 < result.p50_ms <= result.p99_ms
    assert result.relay_cores >= 0


@pytest.mark.integration
def test_a_tick_paced_producer_sends_every_message_once() -> None:
    """The `tick` pacing sends what fell due at each tick, stamped with each message's own time: all of them,
    none twice (the consumer would count a duplicate as one more received)."""
    result = grpc_floor.measure_path("direct", rate=400.0, seconds=0.5, pacing="tick")
    assert (result.pacing, result.sent, result.received) == ("tick", 200, 200)
    assert 0 < result.p50_ms <= result.p99_ms


@pytest.mark.integration
def test_a_relay_serves_on_a_port_of_its_own_and_says_which() -> None:
    """Found by CI: in a ring run the consumer never heard the end. Ports were picked in advance, freed, and
    bound by the relays later, with gRPC's default SO_REUSEPORT, while other tests started servers in
    parallel; a port taken meanwhile is shared silently, and traffic to it can reach the other process (the
    likeliest cause: nothing else on the path drops a message). Now each relay binds a port of the kernel's
    choosing, alone, and tells measure_path which."""
    relay = grpc_floor._Child("relay")
    try:
        relay.route([])
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", relay.port))
    finally:
        relay.stop()
