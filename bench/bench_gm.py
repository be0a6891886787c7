"""`make bench-gm`: confirmed-broadcast throughput and latency through a GM ring
of three node processes on loopback, 256-byte payloads.

One member on each node; the publisher's member is on node1, and every member's
deliveries stream to this process (so the figures include delivering every
message to three applications). Each request carries `--batch` payloads and
`--window` requests are in flight; a request's latency is from sending it to
its confirm (every live member delivered it). The run is repeated for each
flush interval given, since the interval is the ring's batching knob.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.markdown import command_line
from ringq.group import GroupMembership
from services import cluster

PAYLOAD = b"x" * 256


@dataclass
class Result:
    flush_ms: float
    batch: int
    window: int
    messages: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    def percentile(self, fraction: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def _drain(membership: GroupMembership, counts: dict[str, int]) -> None:
    async for event in membership.events():
        if event.WhichOneof("kind") == "delivery":
            counts[membership.member_id] = counts.get(membership.member_id, 0) + len(event.delivery.payloads)


async def _measure(
    addresses: list[str], seconds: float, batch: int, window: int, warmup: float
) -> tuple[int, float, list[float]]:
    name = f"bench-{time.monotonic_ns()}"
    memberships = [await GroupMembership.join(address, name) for address in addresses]
    counts: dict[str, int] = {}
    drains = [asyncio.ensure_future(_drain(m, counts)) for m in memberships]
    publisher = memberships[0]
    payloads = [PAYLOAD] * batch
    latencies: list[float] = []
    in_flight = asyncio.Semaphore(window)

    async def one(record: bool) -> None:
        sent = time.perf_counter()
        await publisher.broadcast(payloads, confirmed=True)
        if record:
            latencies.append((time.perf_counter() - sent) * 1000)
        in_flight.release()

    async def run(duration: float, record: bool) -> int:
        tasks = []
        until = time.perf_counter() + duration
        while time.perf_counter() < until:
            await in_flight.acquire()
            tasks.append(asyncio.ensure_future(one(record)))
        await asyncio.gather(*tasks)
        return len(tasks) * batch

    await run(warmup, record=False)
    started = time.perf_counter()
    messages = await run(seconds, record=True)
    elapsed = time.perf_counter() - started
    for membership in memberships:
        await membership.close()
    for drain in drains:
        drain.cancel()
    return messages, elapsed, latencies


def bench(flush_ms: float, seconds: float, batch: int, window: int, warmup: float) -> Result:
    with tempfile.TemporaryDirectory(prefix="ringq-bench-") as directory:
        info = cluster.up(
            3, Path(directory), node_args=["--flush-interval-ms", str(flush_ms), "--log-level", "WARNING"]
        )
        try:
            addresses = [node.address for node in info.nodes]
            messages, elapsed, latencies = asyncio.run(_measure(addresses, seconds, batch, window, warmup))
        finally:
            cluster.down(Path(directory))
    return Result(flush_ms, batch, window, messages, elapsed, latencies)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def table(results: list[Result]) -> str:
    lines = [
        "| flush interval | batch | in flight | messages | confirmed msgs/s | request p50 ms | request p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.flush_ms:g} ms | {r.batch} | {r.window} | {r.messages:,} | {r.rate:,.0f} | "
            f"{r.percentile(0.5):.2f} | {r.percentile(0.99):.2f} |"
        )
    return "\n".join(lines)


def write_section(path: Path, command: str, results: list[Result]) -> None:
    best = max(results, key=lambda r: r.rate)
    section = "\n".join(
        [
            "## GM ring: confirmed broadcast (`make bench-gm`)",
            "",
            f"Command: `{command}`  ",
            f"Machine: {machine()}  ",
            f"Measured: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            "Three node processes and a coordinator on 127.0.0.1, one member per node; the publisher is on",
            "node1 and all three members' deliveries stream to the benchmark process. 256-byte payloads,",
            "confirmed broadcast (a request returns once every live member delivered it).",
            "",
            table(results),
            "",
            f"Best: {best.rate:,.0f} confirmed msgs/s ({best.batch} payloads per request, {best.window} in flight,"
            f" {best.flush_ms:g} ms flush interval).",
            "",
        ]
    )
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    marker = "## GM ring: confirmed broadcast"
    if marker in text:
        head, _, rest = text.partition(marker)
        tail = rest.split("\n## ", 1)
        text = head + section + (("\n## " + tail[1]) if len(tail) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make bench-gm", description=__doc__)
    parser.add_argument("--flush-ms", default="0.5,2,5,10", help="comma-separated flush intervals to try")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per run (after warm-up)")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per run")
    parser.add_argument(
        "--shapes",
        default="250x8,10x64,1x1",
        help="comma-separated BATCHxWINDOW: payloads per request x requests in flight",
    )
    parser.add_argument("--write", type=Path, help="update this Markdown file with the results")
    args = parser.parse_args(argv)
    results = []
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    for batch, window in shapes:
        for flush_ms in [float(v) for v in args.flush_ms.split(",")]:
            result = bench(flush_ms, args.seconds, batch, window, args.warmup)
            print(
                f"batch {batch} x {window} in flight, flush {flush_ms:g} ms: {result.rate:,.0f} confirmed msgs/s, "
                f"p50 {result.percentile(0.5):.2f} ms, p99 {result.percentile(0.99):.2f} ms",
                flush=True,
            )
            results.append(result)
    print(table(results))
    if args.write:
        write_section(args.write, command_line("bench.bench_gm", "bench-gm", argv), results)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
