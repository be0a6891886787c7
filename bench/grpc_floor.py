"""`make bench-floor`: what Python gRPC alone costs on this machine, with no broker logic at all.

Two measurements bound what ringq can reach, since every hop of a message is a gRPC stream message
between Python processes (asyncio, the I/O path services/grpc_io.py chooses):

- the CPU one stream write costs the writing process, for a small and a ring-frame-sized message;
- the latency of three path shapes made of bare relays, 256-byte messages at fixed rates:
  - `ring`, the ring round, then delivery (ringq's shape): producer -> A -> B -> C -> A -> consumer, A carrying
    two hops as a master does (the publish in; the ring's return and the delivery out). A confirmed,
    delivered message in ringq crosses these five hops at least: a mirror holds the message, and knows
    it was delivered, before the consumer sees it.
  - `beside`, delivery beside the ring round: A hands each message to the consumer at once and sends it round
    B -> C -> A at the same time (what a master that delivers before its mirrors have the message
    would do: two hops to the consumer, with the ring's traffic on the same processes).
  - `direct`, no ring: producer -> A -> consumer, two hops and nothing else.

The relays do the least we know how to do in Python gRPC: a relay never waits for a write before reading on, and
what queues behind a write goes out with the next one as a single gRPC message (ringq's links do the
same). Producer and consumer are separate processes, as in `make bench`, and latency runs from the moment
the producer hands each message to its stream to its receipt, as there. Shapes and rates take turns, repeated `--runs`
times; a cell is the median (min-max) of the runs.

The producer paces one of two ways (`--pacing`): `exact` sleeps to each message's own scheduled time (the
lowest floor a producer could give); `tick` sends what has fallen due every PACE_TICK_S and awaits that
write before sleeping again, as `make bench`'s producers do (bench/reference/rabbitmq_workloads.py,
`AsyncWindowProducer._pace`): fewer, larger frames, so the relays' CPU is comparable with the brokers' there.

    python -m bench.grpc_floor [--rates 1000,2000] [--seconds 6] [--runs 3] [--pacing exact,tick]
                               [--write docs/benchmarks.md]
"""

from __future__ import annotations

import services.grpc_io  # noqa: F401 (first: the nodes' I/O path, chosen before grpc loads)

# isort: split
import argparse
import asyncio
import os
import platform
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.markdown import command_line, replace_marked
from bench.reference.rabbitmq_workloads import PACE_TICK_S
from services.request_guard import EXCLUSIVE_PORT_OPTION

MARK_BEGIN = "<!-- grpc-floor:begin -->"
MARK_END = "<!-- grpc-floor:end -->"
_SERVICE, _METHOD = "floor.Relay", "/floor.Relay/Stream"
_STAMP = struct.Struct("<Bq")  # the hop index, then the send stamp (perf_counter_ns)
_LENGTH = struct.Struct("<I")  # each message in a gRPC message is prefixed by its length
BODY_BYTES = 256
PRIMING = 0  # the stamp of the messages that dial every link before the timed ones: not counted
THE_END = -1  # the stamp of the message that follows the last timed one: the consumer writes out
WARM_UP_S = 1.0  # sent at the rate before the timed messages

# Path shapes: for each relay (by its place: 0 is A, 1 is B, 2 is C), the places a message with hop index i
# goes to next; "consumer" is the consumer's place.
Route = dict[int, list[list[int | str]]]
SHAPES: dict[str, tuple[str, Route]] = {
    "ring": (
        "ring round, then delivery (ringq): producer -> A -> B -> C -> A -> consumer",
        {0: [[1], [], [], ["consumer"]], 1: [[], [2]], 2: [[], [], [0]]},
    ),
    "beside": (
        "delivery beside the ring round: producer -> A -> consumer, and A -> B -> C -> A",
        {0: [[1, "consumer"], [], [], []], 1: [[], [2]], 2: [[], [], [0]]},
    ),
    "direct": ("no ring: producer -> A -> consumer", {0: [["consumer"]]}),
}


def _same(data: bytes) -> bytes:
    return data


def _server(on_stream: Callable[[AsyncIterator[bytes], Any], AsyncIterator[bytes]]) -> tuple[grpc.aio.Server, int]:
    """A server on a port of the kernel's choosing, its own alone (no SO_REUSEPORT: a port picked in advance
    and bound later could meanwhile go to another process, which would then take a share of the traffic)."""
    handler = grpc.stream_stream_rpc_method_handler(on_stream, request_deserializer=_same, response_serializer=_same)
    server = grpc.aio.server(options=[EXCLUSIVE_PORT_OPTION])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Stream": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    return server, port


def _tell(line: str) -> None:
    """A line to the parent (measure_path), which reads the children's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _stream_to(port: int) -> tuple[grpc.aio.Channel, Any]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream: Any = channel.stream_stream(_METHOD, request_serializer=_same, response_deserializer=_same)
    return channel, stream(wait_for_ready=True)


def _messages(frame: bytes) -> Iterator[bytes]:
    """The length-prefixed messages one gRPC message carries."""
    at = 0
    while at < len(frame):
        (length,) = _LENGTH.unpack_from(frame, at)
        yield frame[at + _LENGTH.size : at + _LENGTH.size + length]
        at += _LENGTH.size + length


class _Outbox:
    """A stream to one port whose writer sends, in one gRPC message, everything queued behind its last write."""

    def __init__(self, port: int) -> None:
        self._channel, self._call = _stream_to(port)
        self._queued: list[bytes] = []
        self._wake = asyncio.Event()
        self._written = asyncio.Event()  # set while nothing is queued or being written
        self._written.set()
        self._writer = asyncio.get_running_loop().create_task(self._write())

    def put(self, message: bytes) -> None:
        self._queued.append(_LENGTH.pack(len(message)) + message)
        self._written.clear()
        self._wake.set()

    async def written(self) -> None:
        """Until what was queued has been written."""
        await self._written.wait()

    async def _write(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queued = self._queued, []
            await self._call.write(b"".join(batch))
            if not self._queued:
                self._written.set()

    async def close(self, timeout: float = 30.0) -> None:
        """Once what was queued is written (within `timeout` seconds): end the stream, close the channel."""
        await asyncio.wait_for(self._written.wait(), timeout)
        await self._call.done_writing()
        self._writer.cancel()
        await self._channel.close(None)


def _parse_route(line: str) -> list[list[int]]:
    """A relay's route as measure_path writes it: for each hop index, the ports it goes to ("-": none)."""
    return [[int(port) for port in targets.split(",")] if targets != "-" else [] for targets in line.split()]


def _format_route(ports: list[list[int]]) -> str:
    return " ".join(",".join(map(str, targets)) or "-" for targets in ports)


async def _relay() -> None:
    """Serve on a free port and say which; read the route (`_parse_route`) from stdin, say "ready"; then send a
    message with hop index i to every port of route[i], with hop index i + 1. No route: a sink."""
    outboxes: dict[int, _Outbox] = {}
    route: list[list[int]] = []

    async def on_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for frame in requests:
            if not route:
                continue  # a sink (measure_writes): its bytes are not messages
            for message in _messages(frame):
                hop = message[0]
                for target in route[hop] if hop < len(route) else ():
                    if target not in outboxes:
                        outboxes[target] = _Outbox(target)
                    outboxes[target].put(bytes([hop + 1]) + message[1:])
        return
        yield b""  # a stream handler: it answers nothing

    server, port = _server(on_stream)
    await server.start()
    _tell(str(port))
    route[:] = _parse_route(await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline))
    _tell("ready")
    await server.wait_for_termination()


async def _consume(out: Path) -> None:
    """Serve on a free port and say which, noting each message's stamp and receipt time until THE_END arrives;
    write them to `out`."""
    received: list[tuple[int, int]] = []
    ended = asyncio.Event()

    async def on_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for frame in requests:
            now = time.perf_counter_ns()
            for message in _messages(frame):
                stamp = _STAMP.unpack_from(message)[1]
                if stamp == THE_END:
                    ended.set()
                elif stamp != PRIMING:
                    received.append((stamp, now))
        return
        yield b""

    server, port = _server(on_stream)
    await server.start()
    _tell(str(port))
    await ended.wait()
    out.write_text("".join(f"{stamp} {now}\n" for stamp, now in received))
    await server.stop(None)


async def _produce(
    first: int, rate: float, seconds: float, mark: Callable[[], None], pacing: str = "exact"
) -> tuple[int, int]:
    """Send to port `first` at `rate` for WARM_UP_S + `seconds`, each message stamped as it is handed to the
    stream, then THE_END; the number of timed messages and the stamp of the first one. `mark` is called when
    the timed messages start and when the last one is sent. `pacing`: see the module's text."""
    outbox = _Outbox(first)
    padding = bytes(BODY_BYTES - _STAMP.size)
    for _ in range(20):  # dial every link of the path before the clock starts
        outbox.put(_STAMP.pack(0, PRIMING) + padding)
        await asyncio.sleep(0.05)
    interval_ns = round(1e9 / rate)
    start_ns = time.perf_counter_ns()
    warm_up = round(WARM_UP_S * rate)
    total = warm_up + round(seconds * rate)
    sent = 0
    timed_from = 0
    while sent < total:
        if pacing == "tick":
            due = min(total, (time.perf_counter_ns() - start_ns) // interval_ns + 1)
        else:
            delay = (start_ns + sent * interval_ns - time.perf_counter_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            due = sent + 1
        while sent < due:
            stamp = time.perf_counter_ns()
            if sent == warm_up:
                mark()
                timed_from = stamp
            outbox.put(_STAMP.pack(0, stamp) + padding)
            sent += 1
        if pacing == "tick":
            await outbox.written()
            await asyncio.sleep(PACE_TICK_S)
    mark()
    outbox.put(_STAMP.pack(0, THE_END) + padding)
    await outbox.close()
    return total - warm_up, timed_from


PACINGS = {
    "exact": "each message at its own scheduled time",
    "tick": "what fell due, every 1 ms tick after the last write (as make bench's producers)",
}


@dataclass
class PathResult:
    shape: str
    pacing: str
    rate: float
    sent: int
    received: int
    p50_ms: float
    p99_ms: float
    relay_cores: float


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


class _Child:
    """A relay or consumer process, with the port it serves on (it picks it and says which)."""

    def __init__(self, *arguments: str) -> None:
        self.name = " ".join(arguments)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.grpc_floor", *arguments],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.process.pid
        self.port = int(self._hear())

    def _hear(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} process ended before it said where it serves")
        return line.strip()

    def route(self, ports: list[list[int]]) -> None:
        """Give a relay its route and wait until it has it."""
        assert self.process.stdin is not None
        self.process.stdin.write(_format_route(ports) + "\n")
        self.process.stdin.flush()
        if self._hear() != "ready":
            raise RuntimeError(f"the {self.name} process did not take its route")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


def measure_path(shape: str, rate: float, seconds: float, pacing: str = "exact") -> PathResult:
    """One run of `shape` (a key of SHAPES) at `rate` msgs/s for `seconds` after the warm-up, the producer
    paced by `pacing` (a key of PACINGS)."""
    route = SHAPES[shape][1]
    children: list[_Child] = []
    with tempfile.TemporaryDirectory(prefix="ringq-floor-") as directory:
        out = Path(directory) / "received"
        try:
            consumer = _Child("consume", str(out))
            children.append(consumer)
            relays: dict[int, _Child] = {}
            for place in route:
                relays[place] = _Child("relay")
                children.append(relays[place])
            ports = {place: relay.port for place, relay in relays.items()}
            for place, hops in route.items():
                relays[place].route(
                    [[consumer.port if t == "consumer" else ports[int(t)] for t in hop] for hop in hops]
                )
            marks: list[tuple[float, float]] = []  # (relays' CPU seconds, monotonic time) at the timed part's ends

            def mark() -> None:
                marks.append((sum(_cpu_seconds(r.pid) for r in relays.values()), time.monotonic()))

            sent, timed_from = asyncio.run(_produce(relays[0].port, rate, seconds, mark, pacing))
            (cpu_before, started), (cpu_after, ended) = marks
            cores = (cpu_after - cpu_before) / (ended - started)
            consumer.process.wait(timeout=30)
            pairs = (map(int, line.split()) for line in out.read_text().splitlines())
            latencies = [(now - stamp) / 1e6 for stamp, now in pairs if stamp >= timed_from]
        finally:
            for child in children:
                child.stop()
    kept = latencies or [float("nan")]
    p50, p99 = _percentile(kept, 0.5), _percentile(kept, 0.99)
    return PathResult(shape, pacing, rate, sent, len(latencies), p50, p99, cores)


async def _write_cost(size: int, count: int, port: int) -> tuple[float, float]:
    """CPU seconds (user, system) one stream write of `size` bytes costs this process."""
    channel, call = _stream_to(port)
    message = os.urandom(size)
    await call.write(message)
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(count):
        await call.write(message)
    after = resource.getrusage(resource.RUSAGE_SELF)
    await channel.close(None)
    return (after.ru_utime - before.ru_utime) / count, (after.ru_stime - before.ru_stime) / count


def measure_writes(sizes: list[int], count: int) -> dict[int, tuple[float, float]]:
    sink = _Child("relay")
    try:
        sink.route([])
        return {size: asyncio.run(_write_cost(size, count, sink.port)) for size in sizes}
    finally:
        sink.stop()


def _spread(values: list[float], digits: int = 2) -> str:
    """median (min-max)"""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def section(writes: dict[int, tuple[float, float]], paths: list[PathResult], command: str) -> str:
    def key(p: PathResult) -> tuple[str, str, float]:
        return (p.shape, p.pacing, p.rate)

    runs = max((sum(1 for p in paths if key(p) == key(q)) for q in paths), default=0)
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
        f"Bare relays, 256-byte messages; latency from the producer's hand-over to the consumer's receipt; "
        f"median (min-max) of {runs} runs, shapes and rates taking turns:",
        "",
        "| path | producer's pacing | rate, msgs/s | received of sent, all runs | p50 ms | p99 ms "
        "| relays' CPU, cores |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for shape, (description, _) in SHAPES.items():
        for pacing, rate in dict.fromkeys((p.pacing, p.rate) for p in paths if p.shape == shape):
            runs_of = [p for p in paths if key(p) == (shape, pacing, rate)]
            lines.append(
                f"| {description} | {PACINGS[pacing]} | {rate:,.0f} | {sum(p.received for p in runs_of):,} of "
                f"{sum(p.sent for p in runs_of):,} | {_spread([p.p50_ms for p in runs_of])} | "
                f"{_spread([p.p99_ms for p in runs_of])} | {_spread([p.relay_cores for p in runs_of])} |"
            )
    lines.append(MARK_END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["relay"]:
        asyncio.run(_relay())
        return 0
    if arguments[:1] == ["consume"]:
        asyncio.run(_consume(Path(arguments[1])))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1000,2000", help="msgs/s of the relay paths, comma-separated")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long each run is timed (default 6)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each shape at each rate (default 3)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="path shapes, comma-separated")
    parser.add_argument(
        "--pacing", default="exact", help=f"the producer's pacings, comma-separated, of {list(PACINGS)}"
    )
    parser.add_argument("--writes", type=int, default=3000, help="stream writes timed per size (default 3000)")
    parser.add_argument("--write", type=Path, help="put the results into this Markdown file")
    args = parser.parse_args(arguments)
    shapes = args.shapes.split(",")
    unknown = [shape for shape in shapes if shape not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}: choose from {list(SHAPES)}")
    pacings = args.pacing.split(",")
    if unknown := [pacing for pacing in pacings if pacing not in PACINGS]:
        parser.error(f"unknown pacings {unknown}: choose from {list(PACINGS)}")
    writes = measure_writes([BODY_BYTES, 26_000], args.writes)
    paths = []
    for _ in range(args.runs):
        for rate in args.rates.split(","):
            for pacing in pacings:
                for shape in shapes:
                    path = measure_path(shape, float(rate), args.seconds, pacing)
                    print(path, flush=True)
                    paths.append(path)
    text = section(writes, paths, command_line("bench.grpc_floor", "bench-floor", argv))
    print(text)
    if args.write is not None:
        replace_marked(args.write, MARK_BEGIN, MARK_END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
