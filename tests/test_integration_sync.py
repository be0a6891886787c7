"""Integration: mirrors come and go while the queue keeps working (issue 4).

A queue mirrored on 2 nodes holds 20,000 messages; publishing goes on without
pause while the policy changes to ha-mode all (a third mirror joins empty and
syncs, batch by batch, while publishers are served; p99 publish latency
during the sync is recorded) and back to exactly 2 (the newest mirror goes).
Nothing is lost: the depth at the end is everything published.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services import cluster
from tests.clusters import NODE_ARGS, connection, every_node_live, set_policy

pytestmark = pytest.mark.integration
BACKLOG = 20_000


async def _wait(condition: object, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def _scenario(directory: Path) -> dict[str, float]:
    info = cluster.up(3, directory, node_args=NODE_ARGS, tls=True)
    await set_policy(info, "ha", "^ha\\.", {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"})
    await every_node_live(info)
    client = connection(info)
    await client.declare_queue("ha.sync")

    async def two_synchronised() -> bool:
        status = await client.queue_status("ha.sync")
        return len(status.mirrors) == 1 and len(status.synchronised_mirrors) == 1

    await _wait(two_synchronised, "the first mirror")
    await client.producer("ha.sync", window=2000, batch=200).publish_many([b"backlog"] * BACKLOG)

    producer = client.producer("ha.sync", window=200, batch=50)
    latencies: list[tuple[float, float]] = []  # (when, ms)
    stop = asyncio.Event()

    async def publish_forever() -> None:
        while not stop.is_set():
            started = time.monotonic()
            await producer.publish_many([b"live"] * 50)
            latencies.append((started, (time.monotonic() - started) * 1000))

    publishing = asyncio.ensure_future(publish_forever())
    await asyncio.sleep(0.5)
    sync_started = time.monotonic()
    await set_policy(info, "ha", "^ha\\.", {"ha-mode": "all", "ha-sync-mode": "automatic"})

    async def three_synchronised() -> bool:
        return len((await client.queue_status("ha.sync")).synchronised_mirrors) == 2

    await _wait(three_synchronised, "the new mirror to sync")
    sync_seconds = time.monotonic() - sync_started
    during = sorted(ms for when, ms in latencies if sync_started <= when <= sync_started + sync_seconds)
    assert len(during) >= 5, "publishing stalled during the sync"

    await set_policy(info, "ha", "^ha\\.", {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"})

    async def back_to_two() -> bool:
        return len((await client.queue_status("ha.sync")).mirrors) == 1

    await _wait(back_to_two, "the newest mirror to go")
    stop.set()
    await publishing
    status = await client.queue_status("ha.sync")
    published = BACKLOG + 50 * len(latencies)
    assert status.depth == published, f"{published - status.depth} messages lost"
    await client.close()
    return {
        "sync_seconds": sync_seconds,
        "batches_during_sync": len(during),
        "p99_ms": during[min(len(during) - 1, int(0.99 * len(during)))],
        "p50_ms": during[len(during) // 2],
    }


def test_a_mirror_syncs_while_publishing_goes_on_and_policies_change_live(tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    try:
        figures = asyncio.run(asyncio.wait_for(_scenario(directory), 240))
        print(
            f"sync of {BACKLOG:,} messages took {figures['sync_seconds']:.1f}s; "
            f"{figures['batches_during_sync']:.0f} publish batches meanwhile, "
            f"p50 {figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms"
        )
    finally:
        cluster.down(directory)
