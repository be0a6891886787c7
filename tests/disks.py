"""Disk faults for integration tests with real node processes.

Responsible for: finding where a node keeps a queue's message log; damaging a log as failing media
do (one byte flipped inside a record that later records follow) and as a crash does (a cut tail);
small filesystems (tmpfs) mounted as a node's data directory, which a test fills and frees on
demand; a publisher that keeps a steady pace and records what it was told about every message;
draining a queue; and collecting a scenario's unmet demands so that one slow run reports them all.

Guarantees:
- `small_disk` unmounts its filesystem when its block exits, whatever happened inside (the caller
  stops the processes using it first: they are inside the block); it skips the test, with the
  reason, where this machine or user cannot mount one.
- `SmallDisk.kept_full` keeps the filesystem full for as long as its block runs (whatever a node
  frees is taken again within `refill_interval_s`) and frees it when the block exits.
- The record walker reads the message log's format as services/queue/message_log.py documents it (a
  16-byte header: magic, type, version, reserved, body length, CRC32; then the body) and never
  writes; `damage_middle_record` and `cut_tail` change exactly the bytes they report.
- Waits poll a state until a deadline (`until`); nothing here sleeps a fixed time to let something
  happen (the publisher's pace is a load, not a wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import os
import shutil
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from ringq import aio
from ringq.errors import RingqError
from ringq.internal.v1 import queue_replication_pb2
from ringq.models import QueueEvent, QueueStatus
from services import cluster
from services import node as node_process
from services.coordinator.metadata import QueueRecord
from services.queue.manager import queue_dir_name
from services.queue.replica_log import current_log_directory
from tests.clusters import HA_ALL, access, every_node_live

# ------------------------------------------------------------------------------------- the node's flags

DISK_FREE_LIMIT_FLAG = "--disk-free-limit-mb"


def node_accepts(flag: str) -> bool:
    """Whether `ringq node` (services/node.py) knows `flag` (taking one value) on this branch."""
    _, unknown = node_process.parser().parse_known_args(["--id", "probe", "--coordinator", "127.0.0.1:1", flag, "0"])
    return not unknown


def disk_alarm_off() -> list[str]:
    """Node arguments that keep the disk-free alarm out of a test (none where nodes have no such alarm)."""
    return [DISK_FREE_LIMIT_FLAG, "0"] if node_accepts(DISK_FREE_LIMIT_FLAG) else []


# ------------------------------------------------------------------------------------- waiting


async def until(condition: Callable[[], Awaitable[bool]], seconds: float, what: str, period_s: float = 0.1) -> None:
    """Return once `condition()` is true; AssertionError naming `what` if it is still false after `seconds`.
    An error of a call (the SDK's or a raw stub's) counts as false (a node may be restarting)."""
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError, RingqError):
            if await condition():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds:g} s")
        await asyncio.sleep(period_s)


async def watch(connection: aio.Connection, queue: str, seconds: float, period_s: float = 0.2) -> list[QueueStatus]:
    """The queue's status every `period_s` for `seconds`: watching a state that must hold for a while (a full
    disk makes no loop), not waiting for something to happen. A status that meets an error is skipped."""
    statuses: list[QueueStatus] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(RingqError):
            statuses.append(await connection.queue_status(queue))
        await asyncio.sleep(period_s)
    return statuses


class Demands:
    """The demands of one fault scenario: an unmet one is recorded and the scenario goes on where it can,
    so one run (tens of seconds) reports every unmet demand, not only the first."""

    def __init__(self) -> None:
        self.unmet: list[str] = []

    def check(self, met: bool, demand: str) -> bool:
        """Record `demand` as unmet unless `met`; return `met`."""
        if not met:
            self.unmet.append(demand)
        return met

    async def eventually(self, condition: Awaitable[None], demand: str) -> bool:
        """Await `condition` (an `until`); record `demand` as unmet if it times out. Whether it was met."""
        try:
            await condition
        except AssertionError as timeout:
            self.unmet.append(f"{demand} ({timeout})")
            return False
        return True

    async def wait(self, condition: Awaitable[None], demand: str) -> None:
        """As `eventually`, for a demand the scenario cannot go on without: if it is unmet, fail at once
        with every unmet demand so far."""
        if not await self.eventually(condition, demand):
            self.settle()

    def settle(self) -> None:
        """Fail listing every unmet demand, if there is any."""
        assert not self.unmet, "unmet demands:\n- " + "\n- ".join(self.unmet)


# ------------------------------------------------------------------------------------- clusters


async def start_cluster(directory: Path, node_args: Sequence[str]) -> cluster.ClusterInfo:
    """Three nodes and a coordinator in `directory`, queues named ha.* mirrored on every node and synced
    automatically, with TLS and authentication on; returns once the coordinator counts every node live (so
    placement sees them all)."""
    info = cluster.up(3, directory, node_args=list(node_args), tls=True)
    async with aio.Admin(info.node_addresses, **access(info)) as admin:
        for name, (pattern, definition) in HA_ALL.items():
            await admin.set_policy(name, pattern, definition)
    await every_node_live(info)
    return info


def connect(info: cluster.ClusterInfo, *, retry_for: float = 30.0) -> aio.Connection:
    """A connection through every node of `info`, node1 first."""
    return aio.Connection(info.node_addresses, retry_for=retry_for, **access(info))


async def declare_on(info: cluster.ClusterInfo, node: str, queue: str) -> None:
    """Declare the durable `queue` through `node`, which makes that node its master."""
    address = info.process(node).address
    async with aio.Connection([address], **access(info)) as connection:
        declared = await connection.declare_queue(queue, durable=True)
    assert declared.master_node == node, f"{queue} was placed on {declared.master_node}, not {node}"


def events_of(status: QueueStatus, kind: str, node: str | None = None) -> list[QueueEvent]:
    """The queue's recent events of `kind` (from `node`, if given)."""
    return [e for e in status.events if e.kind == kind and (node is None or e.node == node)]


async def drain(connection: aio.Connection, queue: str, seconds: float) -> list[aio.Delivery]:
    """Consume and acknowledge `queue` until it holds nothing; every delivery handed to the application,
    in order. AssertionError if it is not empty within `seconds`."""
    deliveries: list[aio.Delivery] = []
    consumer = connection.consumer(queue, prefetch=1000)
    iterator = aiter(consumer)
    deadline = time.monotonic() + seconds
    try:
        while True:
            try:
                delivery = await asyncio.wait_for(anext(iterator), 0.5)
            except TimeoutError:  # nothing came for a while: empty, or still recovering?
                with contextlib.suppress(RingqError):
                    if (await connection.queue_status(queue)).depth == 0:
                        return deliveries
                assert time.monotonic() < deadline, f"{queue}: not drained within {seconds:g} s"
                continue
            deliveries.append(delivery)
            delivery.ack()
    finally:
        await consumer.close()


# ------------------------------------------------------------------------------------- logs on disk

# A message log record's header (services/queue/message_log.py): magic, type, format version,
# reserved, body length, CRC32. Type 1 is an enqueue, whose body is the message id (8 bytes) and
# the message as a ReplicatedMessage.
_HEADER = struct.Struct("<4sBBHII")
_MAGIC = b"RQML"
_ENQUEUE = 1
_ID_BYTES = 8


@dataclass(frozen=True)
class Record:
    """Where one record of a segment lies: [offset, end), its body from `body`."""

    offset: int
    kind: int
    body: int
    end: int


def records(data: bytes) -> list[Record]:
    """The records of a segment's bytes, in order, up to the first that is incomplete or lacks the magic."""
    found: list[Record] = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        magic, kind, _, _, length, _ = _HEADER.unpack_from(data, offset)
        end = offset + _HEADER.size + length
        if magic != _MAGIC or end > len(data):
            break
        found.append(Record(offset, kind, offset + _HEADER.size, end))
        offset = end
    return found


def queue_log_dir(cluster_directory: Path, node: str, queue: str, gm_group: str) -> Path:
    """The directory where `node` keeps the log of `queue` (vhost "/") in its incarnation `gm_group`: a
    node's data directory is DATA/<node> in the cluster's directory (services/queue/manager.py)."""
    found = cluster_directory / "data" / node / "queues" / queue_dir_name(QueueRecord("/", queue, gm_group=gm_group))
    assert found.is_dir(), f"{node} has no log directory for {queue} ({gm_group}): {found}"
    return Path(current_log_directory(str(found)))


def newest_segment(log_dir: Path) -> Path:
    segments = sorted(log_dir.glob("*.seg"))
    assert segments, f"no segment in {log_dir}"
    return segments[-1]


def logged_messages(log_dir: Path) -> set[tuple[str, int]]:
    """(publisher, seq) of every message an enqueue record of the log's segments carries."""
    logged: set[tuple[str, int]] = set()
    for segment in sorted(log_dir.glob("*.seg")):
        data = segment.read_bytes()
        for record in records(data):
            if record.kind == _ENQUEUE:
                logged.add(_message_key(data[record.body + _ID_BYTES : record.end]))
    return logged


def _message_key(payload: bytes) -> tuple[str, int]:
    message = queue_replication_pb2.ReplicatedMessage.FromString(payload)
    return message.publisher, message.publisher_seq


@dataclass(frozen=True)
class Damage:
    """One byte flipped in `segment` at `offset`, inside the enqueue record of the message `message`."""

    segment: Path
    offset: int
    message: tuple[str, int]


def damage_middle_record(segment: Path) -> Damage:
    """Flip one byte in the middle of the body of the first enqueue record at or after the middle of
    `segment` that other records follow (so it was made durable before them: media damage, not a crash)."""
    data = bytearray(segment.read_bytes())
    found = records(bytes(data))
    middle = len(data) // 2
    candidates = [r for r in found[:-1] if r.end > middle and r.kind == _ENQUEUE]
    assert candidates, f"{segment}: no enqueue record followed by others after its middle ({len(found)} records)"
    record = candidates[0]
    message = _message_key(bytes(data[record.body + _ID_BYTES : record.end]))
    offset = (record.body + record.end) // 2
    data[offset] ^= 0xFF
    with open(segment, "r+b") as file:
        file.seek(offset)
        file.write(data[offset : offset + 1])
    return Damage(segment, offset, message)


def cut_tail(segment: Path, byte_count: int) -> int:
    """Cut `byte_count` bytes off the end of `segment`, as a crash during its last write may; its new size."""
    size = segment.stat().st_size - byte_count
    assert size > 0, f"{segment} is not longer than {byte_count} bytes"
    os.truncate(segment, size)
    return size


# ------------------------------------------------------------------------------------- small disks

_FILLER = "filler"
_CHUNK_BYTES = 1024 * 1024
_MIN_CHUNK_BYTES = 4096


def mount_unavailable_reason() -> str | None:
    """Why this process cannot mount a tmpfs, or None if it may try."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "the mount and umount commands are not installed"
    return None


class SmallDisk:
    """A tmpfs of `size_mib` MiB mounted at `path`: fill it with a filler file, free it again."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path = path
        self.size_mib = size_mib
        self.filler = path / _FILLER
        self.full_since: float | None = None  # monotonic time the filler first met ENOSPC in this fill

    def free_bytes(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize

    def fill(self) -> int:
        """Append to the filler until the filesystem has no room left; how many bytes that took."""
        written = 0
        chunk = _CHUNK_BYTES
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while chunk >= _MIN_CHUNK_BYTES:
                try:
                    written += os.write(fd, bytes(chunk))
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    chunk //= 2
        finally:
            os.close(fd)
        if self.full_since is None:
            self.full_since = time.monotonic()
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)
        self.full_since = None

    @contextlib.asynccontextmanager
    async def kept_full(self, refill_interval_s: float = 0.05) -> AsyncIterator[SmallDisk]:
        """Full while the block runs, whatever the node frees meanwhile; freed when it exits."""

        async def keep() -> None:
            while True:
                self.fill()
                await asyncio.sleep(refill_interval_s)

        self.fill()
        keeper = asyncio.ensure_future(keep())
        try:
            yield self
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            self.free()


@contextlib.contextmanager
def small_disk(path: Path, size_mib: int) -> Iterator[SmallDisk]:
    """Mount a `size_mib` MiB tmpfs at `path` (created if need be) for the block; skip the test if that
    is not allowed here. Whatever uses the filesystem must be stopped inside the block."""
    reason = mount_unavailable_reason()
    if reason is None:
        path.mkdir(parents=True, exist_ok=True)
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=10,
        )
        reason = None if mounted.returncode == 0 else f"mount failed: {mounted.stderr.strip()}"
    if reason is not None:
        pytest.skip(f"this test mounts a small tmpfs as a node's data directory: {reason}")
    try:
        yield SmallDisk(path, size_mib)
    finally:
        unmounted = subprocess.run(["umount", str(path)], capture_output=True, text=True, timeout=10)
        if unmounted.returncode != 0:  # still busy: detach it now, the kernel frees it once unused
            subprocess.run(["umount", "--lazy", str(path)], check=True, timeout=10)


# ------------------------------------------------------------------------------------- publishing


@dataclass
class Ledger:
    """What a publisher was told: per seq, when it was confirmed, or the status it was refused with."""

    confirmed: dict[int, float] = field(default_factory=dict)  # seq -> monotonic time of the confirm
    refused: dict[int, tuple[grpc.StatusCode, str]] = field(default_factory=dict)  # seq -> (code, details)
    sent: int = 0

    def confirmed_between(self, start: float, end: float) -> int:
        return sum(start <= at < end for at in self.confirmed.values())

    def longest_wait(self, start: float, end: float) -> float:
        """The longest time in [start, end) during which no message was confirmed, in seconds."""
        times = sorted(at for at in self.confirmed.values() if start <= at < end)
        edges = [start, *times, end]
        return max(later - earlier for earlier, later in itertools.pairwise(edges))

    def last_confirm(self) -> float:
        return max(self.confirmed.values(), default=0.0)


class SteadyPublisher:
    """Publishes through `producer` at `per_second`, in batches of `batch`, from when its block starts until
    it ends or `stop` is called; records every outcome in `ledger`."""

    def __init__(self, producer: aio.Producer, per_second: int, batch: int = 25) -> None:
        self.producer = producer
        self.per_second = per_second
        self.batch = batch
        self.ledger = Ledger()
        self._task: asyncio.Future[None] | None = None

    async def __aenter__(self) -> SteadyPublisher:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop sending (what was sent is still answered)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def answered(self, seconds: float) -> None:
        """Stop sending; return once every message sent was confirmed or refused (AssertionError after `seconds`)."""
        await self.stop()
        await until(self._all_answered, seconds, "every message sent was confirmed or refused")

    async def _all_answered(self) -> bool:
        return len(self.ledger.confirmed) + len(self.ledger.refused) == self.ledger.sent

    async def _run(self) -> None:
        interval_s = self.batch / self.per_second
        next_at = time.monotonic()
        while True:
            for _ in range(self.batch):
                future = await self.producer.send(b"steady %d" % self.producer.next_seq)
                seq = self.producer.next_seq - 1
                self.ledger.sent += 1
                future.add_done_callback(functools.partial(self._answered, seq))
            next_at += interval_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    def _answered(self, seq: int, outcome: asyncio.Future[aio.Outcome]) -> None:
        if outcome.cancelled():
            self.ledger.refused[seq] = (grpc.StatusCode.CANCELLED, "the producer was closed")
        elif isinstance(error := outcome.exception(), RingqError):
            self.ledger.refused[seq] = (error.code, error.details)
        elif error is not None:
            self.ledger.refused[seq] = (grpc.StatusCode.UNKNOWN, repr(error))
        elif outcome.result() == aio.Outcome.REJECTED:
            self.ledger.refused[seq] = (grpc.StatusCode.FAILED_PRECONDITION, "rejected: the queue is full")
        else:
            self.ledger.confirmed[seq] = time.monotonic()

    async def confirmed_at_least(self, count: int, seconds: float, what: str) -> None:
        async def enough() -> bool:
            return len(self.ledger.confirmed) >= count

        await until(enough, seconds, what)
