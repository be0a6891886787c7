"""Binding a process's threads to CPUs from outside, as `taskset -a -p` does: how `make bench` places
ringq's nodes the way docs/configuration.md ("A node's CPU") recommends deploying them.

Responsible for: the round-robin placement of co-located nodes over the CPUs this process may use,
binding every thread of a process to a set of CPUs, and releasing it (every CPU this process may use).

Guarantees: Linux only (sched_setaffinity by thread id, the threads listed in /proc/PID/task). A thread
started later by a bound thread inherits its binding, so a process bound once stays bound; a thread
that ends while the process is being bound is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence


def available_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def round_robin(names: Sequence[str], cpus: Sequence[int]) -> dict[str, int]:
    """One CPU for each of `names`, in turn over `cpus`: with more names than CPUs, they share from the first."""
    if not cpus:
        raise ValueError("no CPU to place on")
    return {name: cpus[i % len(cpus)] for i, name in enumerate(names)}


def bind_threads(pid: int, cpus: Collection[int]) -> int:
    """Bind every thread of process `pid` to `cpus`; returns how many threads were bound."""
    bound = 0
    for entry in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(entry), set(cpus))
        except ProcessLookupError:  # the thread ended since the listing
            continue
        bound += 1
    return bound
