"""Integration: transactions on a live TLS cluster (QueueService.Commit, ringq.transaction).

1. Commit applies a consumer's acknowledgements and a producer's publishes together; a rollback applies
   nothing; a commit with an unknown delivery tag is refused whole.
2. A master killed (SIGKILL) while workers commit transactions (ack an input, publish its output) leaves
   every transaction applied whole or not at all: once the inputs are drained through the new master,
   every input has exactly one output. A transaction applied in part would show as an input acknowledged
   without its output (one missing) or an output without its acknowledgement (the input redelivered and
   processed again: two outputs).
3. A master that exits at the exact moment after deciding a transaction (a failpoint) leaves it applied
   whole or not at all on the mirror that takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ringq import aio
from ringq.errors import PreconditionFailed, RingqError, Unavailable
from services import cluster
from tests.clusters import access, live_cluster

pytestmark = pytest.mark.integration

INPUTS = 400
WORKERS = 4


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    with live_cluster(tmp_path_factory.mktemp("transactions"), tls=True) as info:
        yield info


def _connection(info: cluster.ClusterInfo) -> aio.Connection:
    return aio.Connection(info.node_addresses, **access(info), retry_for=20.0, call_timeout=10.0)


def test_commit_applies_acks_and_publishes_together_and_rollback_nothing(secure: cluster.ClusterInfo) -> None:
    async def scenario() -> None:
        async with _connection(secure) as client:
            queue = "ha.tx.one"
            await client.declare_queue(queue)
            await client.producer(queue).publish_many([b"a", b"b"])
            consumer = client.consumer(queue, prefetch=2)
            deliveries = aiter(consumer)
            first = await asyncio.wait_for(anext(deliveries), 10)
            second = await asyncio.wait_for(anext(deliveries), 10)
            producer = client.producer(queue, publisher_id="worker")
            # Rolled back (an exception in the block): nothing happens.
            with pytest.raises(RuntimeError):
                async with producer.transaction(consumer) as tx:
                    tx.ack(first)
                    tx.publish(b"A")
                    raise RuntimeError("changed my mind")
            status = await client.queue_status(queue)
            assert (status.depth, status.unacked) == (2, 2)
            # Committed: "a" is gone and "A" is there, together (delivered at once: prefetch had room again).
            async with producer.transaction(consumer) as tx:
                tx.ack(first)
                tx.publish(b"A")
            assert (await client.queue_status(queue)).depth == 2
            assert (await asyncio.wait_for(anext(deliveries), 10)).body == b"A"
            # An unknown delivery tag: refused whole, the publish with it not added.
            tx = producer.transaction(consumer)
            tx.ack(second)
            tx.ack(first)  # acknowledged already
            tx.publish(b"B")
            with pytest.raises(PreconditionFailed) as refused:
                await tx.commit()
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert (await client.queue_status(queue)).depth == 2
            await consumer.close()
            await producer.close()

    asyncio.run(scenario())


def test_a_master_killed_while_transactions_commit_leaves_each_whole_or_absent(secure: cluster.ClusterInfo) -> None:
    """Workers take "in-N" and, in one transaction, acknowledge it and publish "out-N" to the same queue;
    "out-N" messages are acknowledged as they come. A transaction applied in part would leave an "in-N"
    without its "out-N", or an "out-N" whose "in-N" comes back and is processed again (two "out-N" of
    different publisher seqs); a plain redelivery of "out-N" has the same seq."""

    async def scenario() -> None:
        async with _connection(secure) as client:
            queue = "ha.work"
            await client.declare_queue(queue)
            await client.producer(queue, publisher_id="feeder").publish_many(
                [f"in-{i:04d}".encode() for i in range(INPUTS)]
            )
            master = (await client.queue_status(queue)).master_node
            outputs: dict[bytes, set[tuple[str, int]]] = {}
            committed = 0

            async def worker(number: int) -> None:
                nonlocal committed
                for attempt in itertools.count():
                    consumer = client.consumer(queue, prefetch=5)
                    # A new producer numbers from 1 again: under the same id its messages would be duplicates.
                    producer = client.producer(queue, publisher_id=f"worker-{number}-{attempt}")
                    try:
                        async for delivery in consumer:
                            if delivery.body.startswith(b"out-"):
                                outputs.setdefault(delivery.body, set()).add((delivery.publisher, delivery.seq))
                                delivery.ack()
                                continue
                            async with producer.transaction(consumer) as tx:
                                tx.ack(delivery)
                                tx.publish(b"out-" + delivery.body[3:])
                            committed += 1
                    except RingqError:
                        pass  # the master went away mid-commit: whole or nothing; a new consumer goes on
                    finally:
                        with contextlib.suppress(RingqError):
                            await consumer.close()
                        with contextlib.suppress(RingqError):
                            await producer.close()

            workers = [asyncio.ensure_future(worker(n)) for n in range(WORKERS)]
            try:
                deadline = time.monotonic() + 30
                while committed < INPUTS // 4:
                    assert time.monotonic() < deadline, f"only {committed} transactions committed"
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(cluster.kill, secure.directory, master, signal.SIGKILL)
                deadline = time.monotonic() + 60
                while len(outputs) < INPUTS or (await _depth(client, queue)) != 0:
                    if time.monotonic() > deadline:
                        status = await client.queue_status(queue)
                        raise AssertionError(
                            f"{len(outputs)} outputs of {INPUTS} after the failover; queue: depth {status.depth}, "
                            f"ready {status.ready}, unacked {status.unacked}, consumers {status.consumers}, "
                            f"master {status.master_node}, {status.status}"
                        )
                    await asyncio.sleep(0.1)
            finally:
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
            expected = {f"out-{i:04d}".encode() for i in range(INPUTS)}
            assert set(outputs) == expected, (
                f"inputs acknowledged without their output: {sorted(expected - set(outputs))[:10]}"
            )
            twice = sorted(body for body, sources in outputs.items() if len(sources) > 1)
            assert not twice, f"outputs published without their input's acknowledgement: {twice[:10]}"

    try:
        asyncio.run(scenario())
    finally:
        with contextlib.suppress(cluster.ClusterError):
            for node in cluster.load(secure.directory).nodes:
                if not cluster.is_alive(node):
                    cluster.start_node(secure.directory, node.name)


async def _depth(client: aio.Connection, queue: str) -> int:
    try:
        return (await client.queue_status(queue)).depth
    except RingqError:
        return -1  # no master yet


def test_a_master_killed_right_after_deciding_a_transaction_leaves_it_whole_or_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exact moment: the master exits (as SIGKILL) at its third transaction, once it decided it and
    handed its one ring report to its group member, before any mirror could have applied it
    (services/failpoints.py). The mirror that takes over holds all of it or none of it."""
    monkeypatch.setenv("RINGQ_FAILPOINTS", "transaction.decided=3")

    async def scenario(info: cluster.ClusterInfo) -> None:
        async with _connection(info) as client:
            queue = "ha.failpoint"
            await client.declare_queue(queue)
            deadline = time.monotonic() + 20
            while len((await client.queue_status(queue)).synchronised_mirrors) < 2:
                assert time.monotonic() < deadline, "the mirrors did not synchronise"
                await asyncio.sleep(0.05)
            await client.producer(queue, publisher_id="feeder").publish_many([f"in-{i}".encode() for i in range(5)])
            master = (await client.queue_status(queue)).master_node
            consumer = client.consumer(queue, prefetch=5)
            deliveries = aiter(consumer)
            producer = client.producer(queue, publisher_id="worker")
            for n in range(3):
                delivery = await asyncio.wait_for(anext(deliveries), 10)
                assert delivery.body == f"in-{n}".encode()
                tx = producer.transaction(consumer)
                tx.ack(delivery)
                tx.publish(f"out-{n}".encode())
                if n < 2:
                    await tx.commit()
                else:
                    with pytest.raises(Unavailable) as failed:
                        await tx.commit()  # its master exits at the failpoint
                    assert failed.value.code == grpc.StatusCode.UNAVAILABLE, failed.value
            with contextlib.suppress(RingqError):
                await consumer.close()
            deadline = time.monotonic() + 30
            while True:  # a mirror takes over; what the old consumer held goes back to ready
                with contextlib.suppress(RingqError):
                    status = await client.queue_status(queue)
                    if status.master_node != master and status.unacked == 0:
                        break
                assert time.monotonic() < deadline, "no mirror took over"
                await asyncio.sleep(0.1)
            bodies = set()
            while (taken := await client.get(queue, no_ack=True)) is not None:
                bodies.add(taken.body.decode())
            assert {"out-0", "out-1", "in-3", "in-4"} <= bodies and not {"in-0", "in-1"} & bodies, bodies
            applied = {"out-2"} <= bodies and "in-2" not in bodies
            absent = "in-2" in bodies and "out-2" not in bodies
            assert applied or absent, f"the transaction was applied in part: {sorted(bodies)}"
            assert len(bodies) == 5, sorted(bodies)

    with live_cluster(tmp_path / "cluster", tls=True) as info:
        asyncio.run(scenario(info))
