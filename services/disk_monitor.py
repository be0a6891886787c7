"""A node's disk-free alarm (RabbitMQ's disk_free_limit).

Responsible for: deciding whether the disk holding a node's data directory is
too full to take more persistent messages (`disk_alarm`, pure), and a small
asyncio shell (`DiskMonitor`) that measures the free space of that directory's
file system every second and keeps the latest answer for the rest of the node:
the queue service blocks persistent publishes while `alarm` is on (and tells
publishers `reason()`), and the node's heartbeat carries `free_bytes` and
`alarm` to the coordinator, which shows them in `ringqctl cluster_status`.

Guarantees: a limit of 0 disables the alarm; the alarm is on exactly when the
last measurement found fewer free bytes than the limit; a measurement that
fails (the file system went away) keeps the previous answer and is logged
once, not every second; the monitor never blocks the event loop (statvfs runs
in a worker thread). Free bytes are those available to an unprivileged process
(`f_bavail`), as RabbitMQ counts them: the blocks reserved for root do not
help a node that does not run as root.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

log = logging.getLogger("ringq.disk")

MEBIBYTE = 1024 * 1024
CHECK_INTERVAL_SECONDS = 1.0


def disk_alarm(free_bytes: int, limit_bytes: int) -> bool:
    """Whether `free_bytes` left on a node's disk is too little under a limit of `limit_bytes` (0: no limit)."""
    return limit_bytes > 0 and free_bytes < limit_bytes


def free_bytes_at(directory: str) -> int:
    """Bytes an unprivileged process may still write on the file system of `directory`, or of its
    nearest existing parent (a node's data directory is created by its first durable queue)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


class DiskMonitor:
    """The free space of one node's data directory, measured every second, against its limit."""

    def __init__(self, node_id: str, directory: str, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"the disk free limit must be >= 0 bytes, got {limit_bytes}")
        self.node_id = node_id
        self.directory = directory
        self.limit_bytes = limit_bytes
        self.free_bytes: int | None = None  # None until the first measurement
        self._failing = False

    @property
    def alarm(self) -> bool:
        """On while the last measurement found less free space than the limit."""
        return self.free_bytes is not None and disk_alarm(self.free_bytes, self.limit_bytes)

    def reason(self) -> str:
        """Why persistent publishes are blocked, as one sentence for publishers and logs ("" without the alarm)."""
        if not self.alarm or self.free_bytes is None:
            return ""
        return (
            f"disk free {_mebibytes(self.free_bytes)} is below the limit of {_mebibytes(self.limit_bytes)} "
            f"on {self.node_id}"
        )

    async def measure(self) -> None:
        """Measure the free space now (what `run` does every second)."""
        was_on = self.alarm
        try:
            free_bytes = await asyncio.to_thread(free_bytes_at, self.directory)
        except OSError as error:
            if not self._failing:
                log.warning("cannot measure the free disk space of %s: %s", self.directory, error)
            self._failing = True
            return
        self._failing = False
        self.free_bytes = free_bytes
        if self.alarm and not was_on:
            log.warning("disk alarm on: %s; persistent publishes are blocked", self.reason())
        elif was_on and not self.alarm:
            log.info("disk alarm off: %s free on %s", _mebibytes(free_bytes), self.node_id)

    async def run(self) -> None:
        """Measure every CHECK_INTERVAL_SECONDS until cancelled."""
        while True:
            await self.measure()
            await asyncio.sleep(CHECK_INTERVAL_SECONDS)


def _mebibytes(size_bytes: int) -> str:
    """A size in whole MiB, rounded down (so a free size below a limit never prints as equal to it)."""
    return f"{size_bytes // MEBIBYTE} MiB"
