"""The ringq-stream Spark source (pipeline/streaming.py) against a live 4-node TLS cluster: an ordered
stream read in stream order, each message once, acknowledged once its batch completed; a failed batch read
again (flagged redelivered) after a restart, and nothing of a completed batch again; the deliveries it
records pass the lifecycle job's stream-order check."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from pipeline.guarantees import stream_order_violations
from pipeline.inputs import read_history
from pipeline.lifecycle import spark_session
from pipeline.streaming import RingqOptionError, StreamSourceOptions, register
from services import cluster
from tests.clusters import GUEST, client_tls, connection, live_cluster

pytestmark = pytest.mark.integration

QUERY_TIMEOUT = 90  # seconds


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    with live_cluster(tmp_path_factory.mktemp("stream-source"), nodes=4) as info:
        yield info


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = spark_session("local[2]", {"spark.sql.shuffle.partitions": "2"})
    register(session)
    yield session
    session.stop()


def _publish(info: cluster.ClusterInfo, stream: str, count: int) -> list[int]:
    """Declare `stream` (3 groups) and publish m000.. with a header each; their stream_seqs, confirmed."""

    async def run() -> list[int]:
        async with connection(info) as conn:
            await conn.declare_stream(stream, groups=3, durable=False)
            producer = await conn.stream_producer(stream)
            futures = [await producer.send(b"m%03d" % i, headers={"i": str(i)}) for i in range(count)]
            seqs = list(await asyncio.gather(*futures))
            await producer.close()
            return seqs

    return asyncio.run(run())


def _status(info: cluster.ClusterInfo, stream: str) -> Any:
    async def run() -> Any:
        async with connection(info) as conn:
            return await conn.stream_status(stream)

    return asyncio.run(run())


def _reader(spark: SparkSession, info: cluster.ClusterInfo, stream: str, histories: Path) -> DataFrame:
    return (
        spark.readStream.format("ringq-stream")
        .option("addresses", ",".join(info.node_addresses))
        .option("tlsCa", str(client_tls(info).ca))
        .option("user", GUEST.user)
        .option("password", GUEST.password)
        .option("stream", stream)
        .option("maxMessagesPerBatch", "100")
        .option("historyDir", str(histories))
        .load()
    )


def _collecting(
    frame: DataFrame, checkpoint: Path, batches: dict[int, list[Row]], fail_batch: int | None = None
) -> StreamingQuery:
    def collect(batch: DataFrame, batch_id: int) -> None:
        batches[batch_id] = batch.collect()
        if batch_id == fail_batch:
            raise RuntimeError(f"batch {batch_id} fails on purpose")

    return (
        frame.writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def _finish(query: StreamingQuery) -> None:
    if not query.awaitTermination(QUERY_TIMEOUT):
        query.stop()
        pytest.fail(f"the streaming query did not finish within {QUERY_TIMEOUT} s")
    assert query.exception() is None


def _depth(info: cluster.ClusterInfo, stream: str) -> int:
    return sum(group.depth for group in _status(info, stream).groups)


def _delivered(histories: Path) -> list[dict[str, Any]]:
    return [
        event
        for path in sorted(histories.glob("history-spark-stream-source-*.jsonl"))
        for event in map(json.loads, path.read_text().splitlines())
        if event["event"] == "stream_deliver"
    ]


def _stream_order_violations(spark: SparkSession, histories: Path) -> list[Row]:
    """What the lifecycle job's stream-order check finds in the deliveries the source recorded."""
    history = read_history(spark, sorted(histories.glob("history-*.jsonl")))
    try:
        return stream_order_violations(history.rows).collect()
    finally:
        history.release()


def test_stream_source_reads_the_stream_in_order_and_acknowledges_after_each_batch(
    spark: SparkSession, ring: cluster.ClusterInfo, tmp_path: Path
) -> None:
    stream = "spark-orders"
    seqs = _publish(ring, stream, 300)
    assert seqs == sorted(seqs) and len(set(seqs)) == 300
    batches: dict[int, list[Row]] = {}
    frame = _reader(spark, ring, stream, tmp_path / "histories")
    assert frame.schema.simpleString() == (
        "struct<stream_seq:bigint,group:string,body:binary,headers:map<string,string>,redelivered:boolean>"
    )
    _finish(_collecting(frame, tmp_path / "checkpoint", batches))

    rows = [row for batch_id in sorted(batches) for row in batches[batch_id]]
    assert [row.stream_seq for row in rows] == seqs, "every confirmed message once, in stream order"
    assert [row.body for row in rows] == [b"m%03d" % i for i in range(300)]
    assert [row.headers for row in rows] == [{"i": str(i)} for i in range(300)]
    assert all(row.group.startswith(f"stream/{stream}/") for row in rows)
    assert not any(row.redelivered for row in rows)
    assert sorted(batches) == [0, 1, 2] and all(len(b) == 100 for b in batches.values()), "maxMessagesPerBatch"
    assert _depth(ring, stream) == 0, "every message acknowledged once its batch was done"
    status = _status(ring, stream)
    assert not [lease for lease in status.leases if lease.role == "consumer" and lease.holder], "lease given up"

    delivered = _delivered(tmp_path / "histories")
    assert [event["stream_seq"] for event in delivered] == seqs
    assert _stream_order_violations(spark, tmp_path / "histories") == []


def test_stream_source_reads_a_failed_batch_again_after_a_restart_and_nothing_completed(
    spark: SparkSession, ring: cluster.ClusterInfo, tmp_path: Path
) -> None:
    stream = "spark-replay"
    seqs = _publish(ring, stream, 300)
    checkpoint, histories = tmp_path / "checkpoint", tmp_path / "histories"
    first: dict[int, list[Row]] = {}
    second: dict[int, list[Row]] = {}
    query = _collecting(_reader(spark, ring, stream, histories), checkpoint, first, fail_batch=1)
    with pytest.raises(StreamingQueryException, match="fails on purpose"):
        query.awaitTermination(QUERY_TIMEOUT)
    assert [row.stream_seq for row in first[0]] == seqs[:100]
    assert [row.stream_seq for row in first[1]] == seqs[100:200], "batch 1 was read, then failed"

    _finish(_collecting(_reader(spark, ring, stream, histories), checkpoint, second))
    assert sorted(second) == [1, 2], "the restart replays batch 1, then reads on"
    assert [row.stream_seq for row in second[1]] == seqs[100:200], "batch 0, completed, does not come again"
    assert all(row.redelivered for row in second[1]), "the replayed batch's messages are flagged redelivered"
    assert [row.stream_seq for row in second[2]] == seqs[200:]
    assert _depth(ring, stream) == 0
    delivered = [event["stream_seq"] for event in _delivered(histories)]
    # The SDK records what it hands the source, prefetched messages a failed run never took included.
    assert set(delivered) == set(seqs) and len(delivered) >= len(seqs) + 100
    assert _stream_order_violations(spark, histories) == [], "the replay's repeats are flagged redelivered"


def test_stream_source_options() -> None:
    options = StreamSourceOptions.parse(
        {"addresses": "h:1", "stream": "s", "maxMessagesPerBatch": "10", "leaseTtlMs": "1000", "tlsCa": "ca"}
    )
    assert (options.stream, options.max_per_batch, options.prefetch, options.lease_ttl_ms) == ("s", 10, 20, 1000)
    assert options.origin.tls_ca == "ca"
    for bad, message in [
        ({"addresses": "h:1"}, 'needs the option "stream"'),
        ({"addresses": "h:1", "queue": "q"}, 'as "stream", not "queue"'),
        ({"addresses": "h:1", "stream": "s", "leaseTtlMs": "10"}, "at least 300"),
        ({"stream": "s"}, 'needs the option "addresses"'),
    ]:
        with pytest.raises(RingqOptionError, match=message):
            StreamSourceOptions.parse(bad)
