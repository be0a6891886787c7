"""`make bench-floor`: what Python gRPC alone costs on this machine, with no broker logic at all.

Two measurements bound what ringq can reach, since every hop of a message is a gRPC stream message
between Python processes (asyncio, the I/O path services/grpc_io.py chooses):

- the CPU one stream write costs the writing process, for a small and a ring-frame-sized message;
- the latency of ringq's path shape made of bare relays: producer -> A -> B -> C -> A -> consumer, three
  relay processes (A carries two hops, as the master does: the publish in, the ring's return and the
  delivery out), 256-byte messages at fixed rates, each relay forwarding every message as it comes;
  latency from the producer's send to the consumer's receipt, and the relays' CPU.

A confirmed, delivered message in ringq crosses these five hops at least (publish, three ring hops,
delivery): the relays' latency is a floor under W2 at a fixed rate.

    python -m bench.grpc_floor [--rates 500,1000,2000] [--seconds 6] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import services.grpc_io  # noqa: F401 (first: the nodes' I/O path, chosen before grpc loads)

# isort: split
import argparse
import asyncio
import os
import platform
import resource
import socket
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.markdown import command_line, replace_marked

MARK_BEGIN = "<!-- grpc-floor:begin -->"
MARK_END = "<!-- grpc-floor:end -->"
_SERVICE, _METHOD = "floor.Relay", "/floor.Relay/Stream"
_STAMP = struct.Struct("<Bq")  # the hop index, then the send time (perf_counter_ns)
BODY_BYTES = 256


def _same(data: bytes) -> bytes:
    return data


def _server(on_stream: Callable[[AsyncIterator[bytes], Any], AsyncIterator[bytes]], port: int) -> grpc.aio.Server:
    handler = grpc.stream_stream_rpc_method_handler(on_stream, request_deserializer=_same, response_serializer=_same)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Stream": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    return server


def _stream_to(port: int) -> Any:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream: Any = channel.stream_stream(_METHOD, request_serializer=_same, response_deserializer=_same)
    return stream(wait_for_ready=True)


async def _relay(port: int, route: list[int]) -> None:
    """Serve on `port`; forward a message stamped with hop i to route[i], stamped i + 1 (no route: a sink)."""
    calls: dict[int, Any] = {}

    async def on_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for message in requests:
            if not route:
                continue
            target = route[message[0]]
            if target not in calls:
                calls[target] = _stream_to(target)
            await calls[target].write(bytes([message[0] + 1]) + message[1:])
        return
        yield b""  # a stream handler: it answers nothing

    server = _server(on_stream, port)
    await server.start()
    await server.wait_for_termination()


@dataclass
class PathResult:
    rate: float
    sent: int
    received: int
    p50_ms: float
    p99_ms: float
    relay_cores: float


async def _drive(first: int, consumer: int, rate: float, seconds: float) -> tuple[int, list[float]]:
    latencies: list[float] = []

    async def on_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for message in requests:
            latencies.append((time.perf_counter_ns() - _STAMP.unpack_from(message)[1]) / 1e6)
        return
        yield b""

    server = _server(on_stream, consumer)
    await server.start()
    call = _stream_to(first)
    await call.write(_STAMP.pack(0, time.perf_counter_ns()) + bytes(BODY_BYTES - _STAMP.size))  # all dialled
    deadline = time.monotonic() + 30
    while not latencies and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    latencies.clear()
    padding = bytes(BODY_BYTES - _STAMP.size)
    start, sent = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        delay = start + sent / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await call.write(_STAMP.pack(0, time.perf_counter_ns()) + padding)
        sent += 1
    await asyncio.sleep(1.0)
    await server.stop(None)
    return sent, latencies


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def measure_path(rate: float, seconds: float) -> PathResult:
    a, b, c, consumer = _free_ports(4)
    routes = {a: [b, 0, 0, consumer], b: [0, c], c: [0, 0, a]}  # hop i goes to routes[relay][i]
    relays = [
        subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "relay", str(port), *map(str, route)])
        for port, route in routes.items()
    ]
    try:
        before = sum(_cpu_seconds(p.pid) for p in relays)
        started = time.monotonic()
        sent, latencies = asyncio.run(_drive(a, consumer, rate, seconds))
        cores = (sum(_cpu_seconds(p.pid) for p in relays) - before) / (time.monotonic() - started)
    finally:
        for relay in relays:
            relay.kill()
            relay.wait()
    kept = latencies or [float("nan")]
    return PathResult(rate, sent, len(latencies), _percentile(kept, 0.5), _percentile(kept, 0.99), cores)


async def _write_cost(size: int, count: int, port: int) -> tuple[float, float]:
    """CPU seconds (user, system) one stream write of `size` bytes costs this process."""
    call = _stream_to(port)
    message = os.urandom(size)
    await call.write(message)
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(count):
        await call.write(message)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_utime - before.ru_utime) / count, (after.ru_stime - before.ru_stime) / count


def measure_writes(sizes: list[int], count: int) -> dict[int, tuple[float, float]]:
    (port,) = _free_ports(1)
    sink = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "relay", str(port)])
    try:
        return {size: asyncio.run(_write_cost(size, count, port)) for size in sizes}
    finally:
        sink.kill()
        sink.wait()


def section(writes: dict[int, tuple[float, float]], paths: list[PathResult], command: str) -> str:
    lines = [
        MARK_BEGIN,
        "## Python gRPC alone: the floor under every hop (`make bench-floor`)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), Python "
        f"{platform.python_version()}, grpcio {grpc.__version__}, Linux {platform.release()}  ",
        f"Measured: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "No broker logic: processes that only move bytes over gRPC asyncio streams, with the nodes' I/O path "
        "(bench/grpc_floor.py says what and why).",
        "",
        "| one stream write of | CPU of the writer, us (user + system) |",
        "|---:|---:|",
    ]
    for size, (user, system) in writes.items():
        lines.append(f"| {size:,} bytes | {(user + system) * 1e6:.0f} ({user * 1e6:.0f} + {system * 1e6:.0f}) |")
    lines += [
        "",
        "| producer -> A -> B -> C -> A -> consumer, 256-byte messages at | received | p50 ms | p99 ms "
        "| relays' CPU, cores |",
        "|---:|---:|---:|---:|---:|",
    ]
    for path in paths:
        lines.append(
            f"| {path.rate:,.0f} msgs/s | {path.received:,} of {path.sent:,} | {path.p50_ms:.2f} | {path.p99_ms:.2f} "
            f"| {path.relay_cores:.2f} |"
        )
    lines.append(MARK_END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["relay"]:
        asyncio.run(_relay(int(arguments[1]), [int(port) for port in arguments[2:]]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="500,1000,2000", help="msgs/s of the relay path, comma-separated")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long each rate is sent (default 6)")
    parser.add_argument("--writes", type=int, default=3000, help="stream writes timed per size (default 3000)")
    parser.add_argument("--write", type=Path, help="put the results into this Markdown file")
    args = parser.parse_args(arguments)
    writes = measure_writes([BODY_BYTES, 26_000], args.writes)
    paths = [measure_path(float(rate), args.seconds) for rate in args.rates.split(",")]
    text = section(writes, paths, command_line("bench.grpc_floor", "bench-floor", argv))
    print(text)
    if args.write is not None:
        replace_marked(args.write, MARK_BEGIN, MARK_END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
