"""Seeds of a simulation run on every core: each seed is independent and deterministic, so running them
in worker processes changes nothing but the wall time (`make test` runs 2,000 seeds of each simulation).

Workers are spawned (not forked: the test process may hold gRPC's threads by then) once per session and
shared; a failing seed raises its own AssertionError, naming the seed, in the test that ran it.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_pool: ProcessPoolExecutor | None = None


def pool() -> ProcessPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn"))
    return _pool


def run_seeds(check: Callable[[int], T], seeds: Iterable[int]) -> list[T]:
    """`check(seed)` for every seed, on every core; the results in seed order (a failure raises)."""
    seeds = list(seeds)
    chunk = max(1, len(seeds) // (4 * (os.cpu_count() or 1)))
    return list(pool().map(check, seeds, chunksize=chunk))


def shutdown() -> None:
    global _pool
    if _pool is not None:
        _pool.shutdown(cancel_futures=True)
        _pool = None
