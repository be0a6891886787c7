"""A node's memory alarm (RabbitMQ's vm_memory_high_watermark).

Responsible for: deciding whether a node uses too much memory to take more publishes
(`memory_alarm`, pure), and a small asyncio shell (`MemoryMonitor`) that measures the node's
resident memory (ten times a second near the watermark, once a second far below it: `check_interval`,
pure) and keeps the answer for the rest of the node: the queue service stops reading publish streams
while `alarm` is on (gRPC's flow control then blocks the publishers, as RabbitMQ blocks their
connections), consumers go on as before, and the node's heartbeat carries the figures to the
coordinator, which shows them in `ringqctl cluster_status`.

Guarantees: a watermark of 0 disables the alarm; the alarm is on exactly when the last measurement
found the resident memory at or above the watermark, so a publisher overshoots it by at most what the
node takes in a tenth of a second (a second passes between measurements only while the node is more
than FAR_HEADROOM_BYTES below the watermark, several seconds of the fastest intake measured); while
it is on, a measurement first asks the C allocator to return freed memory to the system (glibc's
malloc_trim, once a second at most), so memory freed by consumers counts as freed; nothing is refused
or lost: a blocked publisher resumes where it stopped.

It also gives memory back after a large queue drains (`release_due`, pure): once the interpreter's
allocated blocks have fallen from their peak to half (by at least RELEASE_MIN_BLOCKS), or by at least
SETTLED_RELEASE_MIN_BLOCKS and then stopped falling (the drain is over), it runs a full collection,
which also empties the interpreter's free lists (cached tuples, dicts, floats... whose blocks keep
otherwise empty allocator arenas from going back to the system), then malloc_trim; the peak then
starts again from there, so a node whose memory does not fall never pays for a collection. The blocks are
counted once a second while they move or the resident memory grows, every ten seconds while neither does
(`blocks_count_due`, pure). Both cadences are for idle nodes (issue 13): with 1,000 idle queues a count a
second was 8 % of a node's CPU, and ten measurements a second instead of one a fifth of it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
import time
from collections.abc import Callable

log = logging.getLogger("ringq.memory")

MEBIBYTE = 1024 * 1024
# Measured often, the alarm comes before a fast publisher has gone far past the watermark (at 1 s, a single
# node took 68 MiB of 1 KiB messages past it in a test): every CHECK_INTERVAL_SECONDS near the watermark,
# every FAR_CHECK_INTERVAL_SECONDS while more than FAR_HEADROOM_BYTES below it (or without one). The fastest
# intake measured, W1 with 1 MiB bodies (docs/benchmarks.md), is about 80 MB/s: six seconds of headroom.
CHECK_INTERVAL_SECONDS = 0.1
FAR_CHECK_INTERVAL_SECONDS = 1.0
FAR_HEADROOM_BYTES = 512 * MEBIBYTE
TRIM_INTERVAL_SECONDS = 1.0  # malloc_trim walks the heap: at most this often
# Allocated blocks are counted this often while they move (sys.getallocatedblocks reads a header in every
# pool of every arena: about 1 ms for a few hundred MiB), and every QUIET_BLOCKS_EVERY_SECONDS while they and
# the resident memory stay put.
BLOCKS_EVERY_SECONDS = 1.0
QUIET_BLOCKS_EVERY_SECONDS = 10.0
# A release (see the module docstring) once the blocks fell by at least this many (a queued 256-byte message
# takes 4: about 120 MiB of them) to half their peak, or by SETTLED_RELEASE_MIN_BLOCKS (about 12 MiB) and
# then moved less than SETTLED_PERCENT between two counts.
RELEASE_MIN_BLOCKS = 1_000_000
SETTLED_RELEASE_MIN_BLOCKS = 100_000
SETTLED_PERCENT = 1
# RabbitMQ's default vm_memory_high_watermark: this share of the machine's memory.
DEFAULT_WATERMARK_SHARE = 0.4


def memory_alarm(used_bytes: int, watermark_bytes: int) -> bool:
    """Whether a node using `used_bytes` is at or past a watermark of `watermark_bytes` (0: none)."""
    return watermark_bytes > 0 and used_bytes >= watermark_bytes


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm).

    Read with os.read, not a text-mode open(): each text-mode open leaves a few small blocks in the
    interpreter's allocator that later opens free and replace (about a hundred live at any time). Ten
    times a second through a drain, those replacements land in whatever allocator pools the drain was
    emptying, and each left one of the allocator's 1 MiB arenas with a single live block, which keeps
    the whole arena from going back to the system: 27 of the 55 such arenas on the master after a
    1,000,000-message drain held nothing else (issue 13: memory returned after a drain)."""
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        return int(os.read(fd, 256).split()[1]) * _PAGE_SIZE
    finally:
        os.close(fd)


def total_memory_bytes() -> int:
    """The machine's memory."""
    return os.sysconf("SC_PHYS_PAGES") * _PAGE_SIZE


def default_watermark_bytes() -> int:
    return int(total_memory_bytes() * DEFAULT_WATERMARK_SHARE)


def _trimmer() -> ctypes._NamedFuncPointer | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    return trim


def check_interval(used_bytes: int, watermark_bytes: int) -> float:
    """Seconds until the next measurement of a node using `used_bytes` under a watermark of `watermark_bytes`."""
    if watermark_bytes > 0 and watermark_bytes - used_bytes < FAR_HEADROOM_BYTES:
        return CHECK_INTERVAL_SECONDS
    return FAR_CHECK_INTERVAL_SECONDS


def blocks_count_due(seconds_since_count: float, moving: bool, resident_bytes_now: int, resident_at_count: int) -> bool:
    """Whether a measurement `seconds_since_count` after the last count of allocated blocks counts them again:
    every BLOCKS_EVERY_SECONDS while the last count found them moving (by more than SETTLED_PERCENT) or the
    resident memory grew since it (by more than SETTLED_PERCENT: a fill, whose peak a release measures from),
    else every QUIET_BLOCKS_EVERY_SECONDS. A drain, which frees blocks but keeps the resident memory, is seen
    by the next quiet count at the latest; from there counts come every BLOCKS_EVERY_SECONDS until it is over,
    so the release after it comes as soon as before."""
    if seconds_since_count >= QUIET_BLOCKS_EVERY_SECONDS:
        return True
    grew = (resident_bytes_now - resident_at_count) * 100 > resident_at_count * SETTLED_PERCENT
    return seconds_since_count >= BLOCKS_EVERY_SECONDS and (moving or grew)


def _moved(blocks: int, previous_blocks: int) -> bool:
    return abs(blocks - previous_blocks) * 100 > previous_blocks * SETTLED_PERCENT


def release_due(blocks: int, previous_blocks: int, peak_blocks: int) -> bool:
    """Whether memory freed since the peak is worth a full collection and a trim: half of it gone, and a
    lot; or enough, and the fall is over (`previous_blocks`: the count before this one)."""
    fallen = peak_blocks - blocks
    if fallen >= RELEASE_MIN_BLOCKS and 2 * blocks <= peak_blocks:
        return True
    return fallen >= SETTLED_RELEASE_MIN_BLOCKS and not _moved(blocks, previous_blocks)


class MemoryMonitor:
    """The resident memory of this node, measured every `check_interval`, against its watermark."""

    def __init__(self, node_id: str, watermark_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        if watermark_bytes < 0:
            raise ValueError(f"the memory high watermark must be >= 0 bytes, got {watermark_bytes}")
        self.node_id = node_id
        self.watermark_bytes = watermark_bytes
        self.used_bytes: int | None = None  # None until the first measurement
        self._clear = asyncio.Event()
        self._clear.set()
        self._trim = _trimmer()
        self._trimmed_at = float("-inf")  # the clock at the last malloc_trim
        self._clock = clock
        self._counted_at = float("-inf")  # when allocated blocks were last counted
        self._blocks_moving = True  # whether the last count found them moving (see blocks_count_due)
        self._resident_at_count = 0  # the resident memory when they were last counted
        self._peak_blocks = 0  # the most allocated blocks seen since the last release
        self._last_blocks = 0
        self.releases = 0

    @property
    def alarm(self) -> bool:
        return self.used_bytes is not None and memory_alarm(self.used_bytes, self.watermark_bytes)

    def reason(self) -> str:
        """Why publishers are blocked, as one sentence ("" without the alarm)."""
        if not self.alarm or self.used_bytes is None:
            return ""
        return (
            f"memory used {self.used_bytes // MEBIBYTE} MiB is at or above the high watermark of "
            f"{self.watermark_bytes // MEBIBYTE} MiB on {self.node_id}"
        )

    async def wait_clear(self) -> None:
        """Return once the alarm is off (at once while it is)."""
        await self._clear.wait()

    def measure(self) -> None:
        """Measure now (what `run` does every `check_interval`)."""
        was_on = self.alarm
        now = self._clock()
        if was_on and self._trim is not None and now - self._trimmed_at >= TRIM_INTERVAL_SECONDS:
            self._trimmed_at = now
            self._trim(0)  # give freed memory back, or it would count as used for good
        used = resident_bytes()
        if blocks_count_due(now - self._counted_at, self._blocks_moving, used, self._resident_at_count):
            self._counted_at = now
            if self._release_if_due():
                used = resident_bytes()
            self._resident_at_count = used
        self.used_bytes = used
        if self.alarm:
            self._clear.clear()
            if not was_on:
                log.warning("memory alarm on: %s; publishers are blocked", self.reason())
        else:
            self._clear.set()
            if was_on:
                log.info("memory alarm off: %d MiB used on %s", self.used_bytes // MEBIBYTE, self.node_id)

    def _release_if_due(self) -> bool:
        """Count the allocated blocks; release memory if due (see the module docstring). True if released."""
        blocks, previous = sys.getallocatedblocks(), self._last_blocks
        self._last_blocks = blocks
        self._blocks_moving = _moved(blocks, previous)
        peak = self._peak_blocks = max(self._peak_blocks, blocks)
        if not release_due(blocks, previous, peak):
            return False
        before, started = resident_bytes(), time.monotonic()
        gc.collect()  # a full one: it empties the free lists too
        if self._trim is not None:
            self._trimmed_at = self._clock()
            self._trim(0)
        self.releases += 1
        self._peak_blocks = self._last_blocks = sys.getallocatedblocks()
        log.info(
            "memory released after allocated blocks fell from %d to %d: resident %d -> %d MiB (%.0f ms)",
            peak,
            blocks,
            before // MEBIBYTE,
            resident_bytes() // MEBIBYTE,
            (time.monotonic() - started) * 1000,
        )
        return True

    async def run(self) -> None:
        """Measure every `check_interval` until cancelled."""
        while True:
            self.measure()
            await asyncio.sleep(check_interval(self.used_bytes or 0, self.watermark_bytes))
