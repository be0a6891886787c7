"""Group commit: many publisher confirms share one fsync.

Responsible for: turning "this message must be on disk before I confirm it"
into as few `flush()` calls as possible. A durable queue appends a persistent
message to its log (services/queue/message_log.py) and awaits
`GroupCommitter.commit()` before it sends the publisher's confirm; every
queue task waiting at the same time shares one flush, run in a worker thread
(asyncio.to_thread) so the event loop keeps serving while the disk syncs.

Guarantees:
- When `await commit()` returns, everything appended to the log before
  commit() was called is durable: it was covered by a `flush()` that *started
  after* the call and completed. A flush already under way when commit() is
  called never satisfies it (it may have taken its snapshot of the buffer
  before the caller's append).
- At most one flush runs at a time. Callers that arrive while one runs wait
  together for the next, which starts as soon as the running one ends. So a
  burst of N concurrent callers costs at most two flushes, and under steady
  load each flush covers everything appended during the previous one.
- If a flush raises, every caller waiting on that flush gets that exception
  (and nothing is promised about what it covered); callers of later flushes
  are not affected by it, though a FileMessageLog refuses every flush after a
  failed one, so they fail too until the log is reopened.
- With `max_delay` > 0, a flush starts no sooner than `max_delay` seconds
  after the first caller it serves arrived (trading that much latency for
  bigger batches at low load); a batch that already waited that long behind
  a running flush is not delayed further.
- Cancelling a caller does not cancel the flush others share. The committer
  belongs to the event loop it is first used in.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["Flushable", "GroupCommitter"]


class Flushable(Protocol):
    """What group commit needs of a log: a blocking flush that may run in a worker thread."""

    def flush(self) -> None: ...


class GroupCommitter:
    """Shares `log.flush()` between concurrent `commit()` callers (see the module docstring)."""

    def __init__(self, log: Flushable, *, max_delay: float = 0.0) -> None:
        if max_delay < 0:
            raise ValueError(f"max_delay must be >= 0, got {max_delay}")
        self._log = log
        self._max_delay = max_delay
        # The flush that has not started yet, and when its first caller came.
        self._next: asyncio.Future[None] | None = None
        self._next_since = 0.0
        self._runner: asyncio.Task[None] | None = None
        self.flushes = 0  # completed or failed flush() calls

    async def commit(self) -> None:
        """Return once everything appended to the log before this call is durable; raise if that flush failed."""
        loop = asyncio.get_running_loop()
        if self._next is None:
            self._next = loop.create_future()
            self._next_since = loop.time()
        waiter = self._next
        if self._runner is None:
            self._runner = loop.create_task(self._run(), name="group-commit")
        await asyncio.shield(waiter)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        batch: asyncio.Future[None] | None = None
        try:
            while self._next is not None:
                delay = self._next_since + self._max_delay - loop.time()
                if self._max_delay > 0 and delay > 0:
                    await asyncio.sleep(delay)
                # From here on, new callers wait for the next flush: this one
                # may read the buffer before their appends.
                batch, self._next = self._next, None
                try:
                    await asyncio.to_thread(self._log.flush)
                except Exception as exc:
                    batch.set_exception(exc)
                else:
                    batch.set_result(None)
                finally:
                    self.flushes += 1
                batch = None
        finally:
            self._runner = None
            # Only when cancelled or on a BaseException: fail whoever is still waiting.
            for waiting in (batch, self._next):
                if waiting is not None and not waiting.done():
                    waiting.cancel()
            self._next = None
