"""What the benchmarks read about running processes from /proc: resident memory and CPU time per pid.

Responsible for: a process's RSS (VmRSS of /proc/PID/status), its CPU time (user + system of
/proc/PID/stat), the CPU a set of processes used over a window (percent of one core each), and waiting
until a set of processes' RSS has settled. Used by `make soak` (bench/soak.py) and `make bench-scale`
(bench/bench_scale.py) on the pids of ringq's node processes (`node_pids`). A process that is gone reads as None
(RSS) or is left out (CPU), so a sample never raises for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from services.cluster import ClusterInfo

MIB = 1024 * 1024
_PROC = Path("/proc")


def node_pids(info: ClusterInfo | None) -> dict[str, int]:
    """The pid of each node process of a running cluster (services.cluster), by node name."""
    if info is None:
        raise RuntimeError("the cluster is not running")
    return {node.name: node.pid for node in info.nodes}


def parse_vmrss(status: str) -> int | None:
    """The resident set size in bytes from the text of /proc/PID/status (None without a VmRSS line)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split(":", 1)[1].split()
            if unit.lower() != "kb":
                raise ValueError(f"unexpected VmRSS unit {unit!r}")
            return int(value) * 1024
    return None


def parse_cpu_ticks(stat: str) -> int:
    """User + system clock ticks from the text of /proc/PID/stat (the command may hold spaces and ')')."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime and stime: fields 14 and 15 of the line


def rss_bytes(pid: int) -> int | None:
    """`pid`'s resident set size in bytes now; None if there is no such process."""
    try:
        return parse_vmrss((_PROC / str(pid) / "status").read_text())
    except OSError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) `pid` has used so far; None if there is no such process."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return parse_cpu_ticks(stat) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU use of a set of processes between `start()` and each `read()`, percent of one core per pid.

    `read` restarts the window, so calling it every minute gives each minute's use."""

    def __init__(self, pids: Sequence[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.pids = list(pids)
        self._clock = clock
        self._cpu: dict[int, float] = {}
        self._at = 0.0
        self.start()

    def start(self) -> None:
        self._at = self._clock()
        self._cpu = {pid: cpu for pid in self.pids if (cpu := cpu_seconds(pid)) is not None}

    def read(self) -> dict[int, float]:
        """Percent of one core each pid used since the window began (a pid gone since is left out)."""
        before, at = self._cpu, self._at
        self.start()
        elapsed = self._at - at
        return {
            pid: 100 * (cpu - before[pid]) / elapsed if elapsed > 0 else 0.0
            for pid, cpu in self._cpu.items()
            if pid in before
        }


def cpu_percent(pids: Sequence[int], seconds: float) -> dict[int, float]:
    """Percent of one core each of `pids` uses over the next `seconds` (blocks that long)."""
    meter = CpuMeter(pids)
    time.sleep(seconds)
    return meter.read()


def settled_rss(
    pids: Sequence[int], *, quiet_s: float = 3.0, tolerance: float = 0.01, timeout_s: float = 60.0, step_s: float = 0.5
) -> dict[int, int]:
    """Each pid's RSS once none of them has moved by more than `tolerance` (a fraction) over `quiet_s`,
    or when `timeout_s` has passed; a pid that is gone is left out."""
    history: list[dict[int, int]] = []
    keep = max(1, round(quiet_s / step_s)) + 1
    deadline = time.monotonic() + timeout_s
    while True:
        sample = {pid: rss for pid in pids if (rss := rss_bytes(pid)) is not None}
        history = [*history[-(keep - 1) :], sample]
        if (len(history) == keep and is_settled(history, tolerance)) or time.monotonic() >= deadline:
            return sample
        time.sleep(step_s)


def is_settled(history: Sequence[Mapping[int, int]], tolerance: float) -> bool:
    """Whether every pid's RSS stayed within `tolerance` (a fraction of its latest value) across `history`."""
    latest = history[-1]
    for pid, now in latest.items():
        values = [sample[pid] for sample in history if pid in sample]
        if now <= 0 or (max(values) - min(values)) / now > tolerance:
            return False
    return True
