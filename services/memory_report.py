"""An operator's look at where a process's memory went: with tracemalloc on (PYTHONTRACEMALLOC=N in the
process's environment), SIGUSR2 writes the allocation sites holding the most memory to
`memory-<pid>.txt` in the process's working directory, or in $RINGQ_MEMORY_REPORT_DIR. Without
tracemalloc the signal is ignored (a note in the log says how to turn it on). Nothing runs unless asked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tracemalloc
from pathlib import Path

log = logging.getLogger("ringq.memory")
TOP = 40


def write_report(directory: Path) -> Path:
    """The top allocation sites by size, one per line (size, count, site), into `directory`."""
    snapshot = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
    stats = snapshot.statistics("lineno")
    path = directory / f"memory-{os.getpid()}.txt"
    lines = [f"{s.size / 1024:10.1f} KiB {s.count:9d} {s.traceback.format()[0].strip()}" for s in stats[:TOP]]
    total = sum(s.size for s in stats)
    path.write_text(f"traced {total / 2**20:.1f} MiB in {len(stats)} sites\n" + "\n".join(lines) + "\n")
    return path


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Answer SIGUSR2 with a report (see the module docstring)."""

    def report() -> None:
        if not tracemalloc.is_tracing():
            log.warning("SIGUSR2: no memory report: start the process with PYTHONTRACEMALLOC=1 (or more frames)")
            return
        directory = Path(os.environ.get("RINGQ_MEMORY_REPORT_DIR", "."))
        log.warning("memory report written to %s", write_report(directory))

    loop.add_signal_handler(signal.SIGUSR2, report)
