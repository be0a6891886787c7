"""Placement passes, one at a time, on a thread of their own.

Responsible for: running every pass that re-places queues (the placement loop's, and the one each
policy change asks for) serially on a dedicated thread, and coalescing policy changes: a change that
arrives while a pass runs is covered by the next pass, shared by every change that arrived meanwhile.
Guarantees: passes never occupy the worker threads that serve every other coordinator call (six
concurrent set_policy calls once held all of them, and every call timed out for minutes); a policy
change's caller gets the result of a pass that started after its policy was stored; at most
one pass waits behind the running one, however many changes arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")  # what a policy pass returns


class PlacementPasses(Generic[R]):
    """The coordinator's placement passes (see the module docstring); a policy pass returns an R."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="placement")
        self._one_at_a_time = asyncio.Lock()
        self._next_policy_pass: asyncio.Future[R] | None = None
        self._tasks: set[asyncio.Future[None]] = set()

    async def run(self, work: Callable[[], T]) -> T:
        """Run one pass (`work`, which blocks on the store) after the passes before it."""
        async with self._one_at_a_time:
            return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def apply_policies(self, work: Callable[[], R]) -> R:
        """A pass that re-applies the policies (`work`, whose result every caller sharing it gets), started
        after this call; calls made while it waits to start share it. A caller that goes away does
        not stop the pass."""
        shared = self._next_policy_pass
        if shared is None:
            shared = self._next_policy_pass = asyncio.get_running_loop().create_future()
            shared.add_done_callback(_retrieved)
            task = asyncio.ensure_future(self._policy_pass(work, shared))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(shared)

    async def _policy_pass(self, work: Callable[[], R], shared: asyncio.Future[R]) -> None:
        try:
            async with self._one_at_a_time:
                if self._next_policy_pass is shared:
                    self._next_policy_pass = None  # changes stored from now on need a later pass
                result = await asyncio.get_running_loop().run_in_executor(self._executor, work)
        except Exception as error:
            if self._next_policy_pass is shared:
                self._next_policy_pass = None
            shared.set_exception(error)
            return
        shared.set_result(result)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _retrieved(future: asyncio.Future[R]) -> None:
    """Mark a pass's failure as seen even if every caller sharing it went away (no asyncio warning)."""
    if not future.cancelled():
        future.exception()
