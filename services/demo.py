"""`make demo`: a mirrored queue through a SIGKILL of its master, traced, then checked by the Spark job.

Starts a coordinator (embedded SQLite store) and three nodes on 127.0.0.1 in
var/demo, each writing spans to var/demo/spans; declares a queue mirrored on
every node; runs a producer (confirms, idempotent publisher id) and a
consumer (one ack per message) for about 20 seconds with a live progress
line; kills the master with SIGKILL half way and shows the promotion; lets
the consumer drain; stops the cluster (the nodes flush their spans); runs the
Spark lifecycle job over the client histories and the spans; and prints the
report's summary. Exits 1 if the job finds a lost message, a duplicate or a
reordering. The cluster is stopped whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider

from ringq import aio
from ringq.errors import RingqError
from ringq.security import TLS, Credentials
from services import certs, cluster, telemetry

NODE_ARGS = ["--failure-timeout-ms", "600", "--heartbeat-interval-ms", "100", "--grace-ms", "100"]
QUEUE = "demo.orders"
GUEST = Credentials("guest", "guest")  # seeded on a cluster's first start; accepted from loopback only
RATE = 1000  # messages a second, offered (the consumer keeps up on 2 cores, so latencies mean something)
TRACE_SAMPLE = 0.02  # one message in fifty carries a trace (unless OTEL_TRACES_SAMPLER says otherwise)


@dataclass
class Progress:
    published: int = 0
    confirmed: int = 0
    delivered: int = 0
    redelivered: int = 0
    master: str = ""
    events: list[str] = field(default_factory=list)


async def _produce(connection: aio.Connection, stop: asyncio.Event, progress: Progress) -> None:
    producer = connection.producer(QUEUE, publisher_id="demo-producer", window=2000, batch=200)
    started = time.monotonic()

    def confirmed(_: asyncio.Future[aio.Outcome]) -> None:
        progress.confirmed += 1

    while not stop.is_set():
        due = int((time.monotonic() - started) * RATE)
        while progress.published < due and not stop.is_set():
            await producer.send(b"order %d" % (progress.published + 1), callback=confirmed)
            progress.published += 1
        await asyncio.sleep(0.005)
    await producer.flush()


async def _consume(connection: aio.Connection, progress: Progress) -> None:
    async for delivery in connection.consumer(QUEUE, prefetch=500):
        progress.delivered += 1
        progress.redelivered += delivery.redelivered
        delivery.ack()


async def _watch_master(connection: aio.Connection, progress: Progress) -> None:
    while True:
        try:
            master = (await connection.queue_status(QUEUE)).master_node
        except RingqError:  # a status during the promotion may fail; the next one answers
            master = ""
        if master and master != progress.master:
            if progress.master:
                progress.events.append(f"promotion: {master} is the master now")
            progress.master = master
        await asyncio.sleep(0.1)


async def _demo_user(info: cluster.ClusterInfo, tls: TLS) -> Credentials:
    """A user made for this run (random password), with every permission on "/", made as guest."""
    user = Credentials("demo", secrets.token_urlsafe(16))
    async with aio.Admin(info.node_addresses, tls=tls, credentials=GUEST) as admin:
        await admin.add_user(user.user, user.password)
        await admin.set_permissions(user.user, configure=".*", write=".*", read=".*")
    return user


async def _traffic(directory: Path, seconds: float, spans: TracerProvider | None) -> tuple[str, float | None]:
    info = cluster.up(
        3, directory / "cluster", node_args=[*NODE_ARGS, "--trace-dir", str(directory / "spans")], tls=True
    )
    print(
        f"cluster up with mutual TLS (certificates in {info.tls_dir}): coordinator {info.coordinator.address} "
        "(SQLite), " + ", ".join(f"{n.name} {n.address}" for n in info.nodes)
    )
    tls = TLS(ca=certs.ca_paths(info.tls_dir).certificate)
    user = await _demo_user(info, tls)
    print(f"user {user.user!r} created, with every permission on the vhost / (guest works from loopback only)")
    admin = aio.Admin(info.node_addresses, tls=tls, credentials=GUEST)
    await admin.set_policy("demo-ha", "^demo\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})
    while sum(node.alive for node in (await admin.cluster_status()).nodes) < len(info.nodes):
        await asyncio.sleep(0.1)  # placement sees every node only once its heartbeat has arrived
    await admin.close()
    addresses = [n.address for n in info.nodes]
    histories = directory / "histories"
    producing = aio.Connection(
        addresses,
        name="producer",
        history=str(histories / "history-producer.jsonl"),
        tls=tls,
        credentials=user,
        tracer_provider=spans,
    )
    consuming = aio.Connection(
        addresses,
        name="consumer",
        history=str(histories / "history-consumer.jsonl"),
        tls=tls,
        credentials=user,
        tracer_provider=spans,
    )
    status = await producing.declare_queue(QUEUE)
    while len(status.synchronised_mirrors) < 2:
        await asyncio.sleep(0.1)
        status = await producing.queue_status(QUEUE)
    progress = Progress(master=status.master_node)
    mirrors = ", ".join(status.synchronised_mirrors)
    print(f"queue {QUEUE}: master {status.master_node}, mirrors {mirrors} (synchronised)")
    stop = asyncio.Event()
    tasks = [
        asyncio.ensure_future(_produce(producing, stop, progress)),
        asyncio.ensure_future(_consume(consuming, progress)),
        asyncio.ensure_future(_watch_master(consuming, progress)),
    ]
    started = time.monotonic()
    killed, killed_at, promoted_after = "", 0.0, None

    def show(elapsed: float) -> None:
        nonlocal promoted_after
        for event in progress.events:
            promoted_after = time.monotonic() - killed_at if killed and promoted_after is None else promoted_after
            print(f"\n  {elapsed:5.1f}s  {event} ({promoted_after or 0:.2f}s after the kill)")
        progress.events.clear()
        print(
            f"\r  {elapsed:5.1f}s  published {progress.published:>6,}  confirmed {progress.confirmed:>6,}  "
            f"delivered {progress.delivered:>6,} ({progress.redelivered} redelivered)  master {progress.master:<6}",
            end="",
            flush=True,
        )

    while (elapsed := time.monotonic() - started) < seconds:
        if not killed and elapsed > seconds / 2:
            killed, killed_at = progress.master, time.monotonic()
            cluster.kill(directory / "cluster", killed, signal.SIGKILL)
            producing.history.record("fault", what="SIGKILL", node=killed)
            print(f"\n  {elapsed:5.1f}s  SIGKILL {killed} (the master)")
        show(elapsed)
        await asyncio.sleep(0.2)
    stop.set()
    await tasks[0]  # every message published is confirmed
    drained_by = time.monotonic() + 20
    while time.monotonic() < drained_by:  # the consumer takes and acks what is left
        show(time.monotonic() - started)
        status = await consuming.queue_status(QUEUE)
        if status.depth == 0:
            break
        await asyncio.sleep(0.2)
    show(time.monotonic() - started)
    for task in tasks[1:]:
        task.cancel()
    await asyncio.gather(*tasks[1:], return_exceptions=True)
    await producing.close()
    await consuming.close()
    print()
    return killed, promoted_after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path("var/demo"), help="where everything goes (default var/demo)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to publish (default 20)")
    args = parser.parse_args(argv)
    directory: Path = args.dir.resolve()  # the nodes run in their own directories: give them absolute paths
    cluster.down(directory / "cluster")
    shutil.rmtree(directory, ignore_errors=True)
    # The demo is the application: it configures OpenTelemetry for its clients (the SDK installs nothing),
    # a provider of its own writing the span file the Spark job reads, not a global one.
    spans = telemetry.tracer_provider("ringq-client", "demo-clients", str(directory / "spans"), TRACE_SAMPLE)
    try:
        asyncio.run(_traffic(directory, args.seconds, spans))
    finally:
        if spans is not None:
            spans.shutdown()
        stopped = cluster.down(directory / "cluster")
        print(f"cluster down ({', '.join(stopped)} stopped); logs in {directory / 'cluster' / 'logs'}")
    return _report(directory)


def _report(directory: Path) -> int:
    """Run the Spark lifecycle job over what the demo recorded, printing its summary; 1 if it found a lost,
    duplicated or reordered message.

    In a process of its own: this one has run gRPC's asyncio stack, whose threads may be busy when Spark
    forks its JVM, and under load the JVM then died before it could send its port (JAVA_GATEWAY_EXITED:
    gRPC skips its fork handlers while other threads call into it)."""
    print("running the Spark lifecycle job (local[*]) ...", flush=True)
    command = [
        sys.executable,
        "-m",
        "pipeline",
        *("--history", str(directory / "histories")),
        *("--spans", str(directory / "spans")),
        *("--out", str(directory / "report")),
        "--fail-on-violation",
    ]
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
