"""bench/process_stats.py, shared by `make soak` and `make bench-scale`: RSS and CPU time read from /proc,
and when a set of RSS samples counts as settled. Reads this test's own process; starts nothing."""

from __future__ import annotations

import os
import time

import pytest

from bench import process_stats
from bench.process_stats import CpuMeter, is_settled, parse_cpu_ticks, parse_vmrss

STATUS = "Name:\tpython\nVmPeak:\t  300000 kB\nVmRSS:\t   51200 kB\nThreads:\t4\n"
# The command holds spaces and a ')': fields are counted after the last one.
STAT = "4242 (a) b) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 4 0 12345 1 2 3"


def test_vmrss_is_read_in_bytes() -> None:
    assert parse_vmrss(STATUS) == 50 * 1024 * 1024
    assert parse_vmrss("Name:\tkthreadd\n") is None  # kernel threads have no VmRSS
    with pytest.raises(ValueError):
        parse_vmrss("VmRSS:\t 12 MB\n")


def test_cpu_ticks_are_utime_plus_stime() -> None:
    assert parse_cpu_ticks(STAT) == 325


def test_own_process_reads_and_a_missing_pid_is_none() -> None:
    rss = process_stats.rss_bytes(os.getpid())
    assert rss is not None and rss > 1024 * 1024
    assert (process_stats.cpu_seconds(os.getpid()) or 0) > 0
    assert process_stats.rss_bytes(2**22 + 1) is None  # above the kernel's pid limit
    assert process_stats.cpu_seconds(2**22 + 1) is None


def test_cpu_meter_sees_a_busy_process_and_leaves_out_a_missing_one() -> None:
    # What the process got, by its own count: one busy thread gets about a core, less on a loaded machine
    # (make test's other worker; 49 % was seen), so the meter is held to that, not to a fixed share.
    wall, cpu = time.monotonic(), time.process_time()
    meter = CpuMeter([os.getpid(), 2**22 + 1])
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        pass
    used = meter.read()
    got = (time.process_time() - cpu) / (time.monotonic() - wall) * 100
    assert set(used) == {os.getpid()}
    assert got > 10 and abs(used[os.getpid()] - got) < 20, (used, got)


def test_settled_means_every_pid_within_the_tolerance_over_the_history() -> None:
    steady = [{1: 1000, 2: 500}, {1: 1005, 2: 502}, {1: 1001, 2: 501}]
    assert is_settled(steady, 0.01)
    moving = [{1: 1000, 2: 500}, {1: 1005, 2: 530}, {1: 1001, 2: 540}]
    assert not is_settled(moving, 0.01)
    assert is_settled(moving, 0.10)


def test_settled_rss_returns_when_quiet() -> None:
    started = time.monotonic()
    sample = process_stats.settled_rss([os.getpid()], quiet_s=0.2, step_s=0.1, tolerance=0.5, timeout_s=5)
    assert set(sample) == {os.getpid()}
    assert time.monotonic() - started < 2
