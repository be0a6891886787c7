"""How `make bench` places ringq's nodes on CPUs (bench/cpu_binding.py): round-robin over the CPUs, and every
thread of a process bound, including those it starts afterwards, then released. Runs on a child process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cpu_binding import available_cpus, bind_threads, round_robin

# A child with two threads besides its main one, which starts a third when it reads a line.
_CHILD = """
import sys, threading, time
for _ in range(2):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("started", flush=True)
time.sleep(60)
"""


def _allowed(pid: int) -> dict[int, str]:
    """Each thread's CPUs, as the kernel lists them (Cpus_allowed_list)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = line.split(":", 1)[1].strip()
    return out


def _parse_list(text: str) -> set[int]:
    found: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def test_nodes_take_the_cpus_in_turn_and_share_from_the_first() -> None:
    assert round_robin(["node1", "node2", "node3"], [0, 1]) == {"node1": 0, "node2": 1, "node3": 0}
    assert round_robin(["node1", "node2"], [2, 5, 7]) == {"node1": 2, "node2": 5}
    with pytest.raises(ValueError, match="no CPU"):
        round_robin(["node1"], [])


def test_every_thread_is_bound_those_started_later_too_and_then_released() -> None:
    cpus = available_cpus()
    first = cpus[0]
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        assert bind_threads(child.pid, {first}) == 3
        assert {_parse_list(v) == {first} for v in _allowed(child.pid).values()} == {True}
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 10
        while len(_allowed(child.pid)) < 4:  # the new thread is listed once it runs
            assert time.monotonic() < deadline, "the fourth thread never appeared"
            time.sleep(0.01)
        assert {_parse_list(v) == {first} for v in _allowed(child.pid).values()} == {True}
        assert bind_threads(child.pid, cpus) == 4
        assert {_parse_list(v) == set(cpus) for v in _allowed(child.pid).values()} == {True}
    finally:
        child.kill()
        child.wait()
