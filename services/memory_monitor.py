"""A node's memory alarm (RabbitMQ's vm_memory_high_watermark).

Responsible for: deciding whether a node uses too much memory to take more publishes
(`memory_alarm`, pure), and a small asyncio shell (`MemoryMonitor`) that measures the node's
resident memory ten times a second and keeps the answer for the rest of the node: the queue service
stops reading publish streams while `alarm` is on (gRPC's flow control then blocks the publishers,
as RabbitMQ blocks their connections), consumers go on as before, and the node's heartbeat carries
the figures to the coordinator, which shows them in `ringqctl cluster_status`.

Guarantees: a watermark of 0 disables the alarm; the alarm is on exactly when the last measurement
found the resident memory at or above the watermark, so a publisher overshoots it by at most what the
node takes in a tenth of a second; while it is on, a measurement first asks the C allocator to return
freed memory to the system (glibc's malloc_trim, once a second at most), so memory freed by consumers
counts as freed; nothing is refused or lost: a blocked publisher resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time

log = logging.getLogger("ringq.memory")

MEBIBYTE = 1024 * 1024
# Reading /proc/self/statm costs microseconds: measured often, the alarm comes before a fast publisher has
# gone far past the watermark (at 1 s, a single node took 68 MiB of 1 KiB messages past it in a test).
CHECK_INTERVAL_SECONDS = 0.1
TRIM_INTERVAL_SECONDS = 1.0  # malloc_trim walks the heap: at most this often
# RabbitMQ's default vm_memory_high_watermark: this share of the machine's memory.
DEFAULT_WATERMARK_SHARE = 0.4


def memory_alarm(used_bytes: int, watermark_bytes: int) -> bool:
    """Whether a node using `used_bytes` is at or past a watermark of `watermark_bytes` (0: none)."""
    return watermark_bytes > 0 and used_bytes >= watermark_bytes


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def total_memory_bytes() -> int:
    """The machine's memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_watermark_bytes() -> int:
    return int(total_memory_bytes() * DEFAULT_WATERMARK_SHARE)


def _trimmer() -> ctypes._NamedFuncPointer | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    return trim


class MemoryMonitor:
    """The resident memory of this node, measured every CHECK_INTERVAL_SECONDS, against its watermark."""

    def __init__(self, node_id: str, watermark_bytes: int) -> None:
        if watermark_bytes < 0:
            raise ValueError(f"the memory high watermark must be >= 0 bytes, got {watermark_bytes}")
        self.node_id = node_id
        self.watermark_bytes = watermark_bytes
        self.used_bytes: int | None = None  # None until the first measurement
        self._clear = asyncio.Event()
        self._clear.set()
        self._trim = _trimmer()
        self._trimmed_at = float("-inf")  # time.monotonic() of the last malloc_trim

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
        """Measure now (what `run` does every CHECK_INTERVAL_SECONDS)."""
        was_on = self.alarm
        now = time.monotonic()
        if was_on and self._trim is not None and now - self._trimmed_at >= TRIM_INTERVAL_SECONDS:
            self._trimmed_at = now
            self._trim(0)  # give freed memory back, or it would count as used for good
        self.used_bytes = resident_bytes()
        if self.alarm:
            self._clear.clear()
            if not was_on:
                log.warning("memory alarm on: %s; publishers are blocked", self.reason())
        else:
            self._clear.set()
            if was_on:
                log.info("memory alarm off: %d MiB used on %s", self.used_bytes // MEBIBYTE, self.node_id)

    async def run(self) -> None:
        """Measure every CHECK_INTERVAL_SECONDS until cancelled."""
        while True:
            self.measure()
            await asyncio.sleep(CHECK_INTERVAL_SECONDS)
