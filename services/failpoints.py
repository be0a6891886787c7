"""Failpoints: named places where a fault test makes a process die at an exact moment (as TiKV's
fail-rs or etcd's gofail do), for what timing alone cannot hit reliably.

    RINGQ_FAILPOINTS="transaction.decided=5"   # exit at the 5th pass of that place

Responsible for: reading $RINGQ_FAILPOINTS once, at import, and ending the process, as SIGKILL would
(status 137, no cleanup, nothing flushed), the N-th time it passes a named place. Guarantees: with the
variable unset, as in production, passing a failpoint costs one dictionary lookup and does nothing.
Places: transaction.decided (a queue's master decided a transaction and handed its one ring report to
its group member, before any mirror could have applied it).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("ringq.failpoints")
KILLED = 137  # the status of a process SIGKILL ended


def _armed(text: str) -> dict[str, int]:
    armed: dict[str, int] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = entry.partition("=")
        armed[name] = int(count) if count else 1
    return armed


_ARMED = _armed(os.environ.get("RINGQ_FAILPOINTS", ""))


def reached(name: str) -> None:
    """Pass the failpoint `name`: exit like SIGKILL if it is armed and this is the pass it waits for."""
    if name not in _ARMED:
        return
    _ARMED[name] -= 1
    if _ARMED[name] <= 0:
        log.critical("failpoint %s: exiting as SIGKILL would", name)
        os._exit(KILLED)
