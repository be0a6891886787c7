"""The ringq Spark streaming source and sink (pipeline/streaming.py) against a live 3-node cluster: every row
published once and in order (a replayed batch adds nothing), every message read in queue order and
acknowledged after its batch, a failed batch's messages read again after a restart, and clear errors for
bad options."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

import ringq
from pipeline.lifecycle import spark_session
from pipeline.streaming import QueueOptions, RingqOptionError, SinkOptions, SourceOptions, register
from services import cluster
from tests.clusters import GUEST, access, client_tls, live_cluster, scoped

pytestmark = pytest.mark.integration

QUERY_TIMEOUT = 60  # seconds


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.ClusterInfo]:
    with live_cluster(tmp_path_factory.mktemp("streaming")) as info:
        yield info


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = spark_session("local[2]", {"spark.sql.shuffle.partitions": "2"})
    register(session)
    yield session
    session.stop()


def _addresses(info: cluster.ClusterInfo) -> str:
    return ",".join(node.address for node in info.nodes)


def _access(info: cluster.ClusterInfo) -> dict[str, str]:
    """The source's and sink's options for reaching `info` as guest over TLS (none for a plaintext cluster)."""
    if not info.tls:
        return {}
    return {"tlsCa": str(client_tls(info).ca), "user": GUEST.user, "password": GUEST.password}


def _finish(query: StreamingQuery) -> None:
    """Wait for a Trigger.AvailableNow query to end by itself."""
    if not query.awaitTermination(QUERY_TIMEOUT):
        query.stop()
        pytest.fail(f"the streaming query did not finish within {QUERY_TIMEOUT} s")
    assert query.exception() is None


def _drain(connection: ringq.Connection, queue: str, count: int) -> list[ringq.Delivery]:
    """Take `count` messages (acknowledged), then check nothing more comes."""
    consumer = connection.consumer(queue, prefetch=1000)
    deliveries: list[ringq.Delivery] = []
    while len(deliveries) < count:
        delivery = consumer.next(10.0)
        assert delivery is not None, f"only {len(deliveries)} of {count} messages in {queue}"
        deliveries.append(delivery)
        assert delivery.ack()
    assert consumer.next(0.5) is None, f"more than {count} messages in {queue}"
    consumer.close()
    return deliveries


def _settles(connection: ringq.Connection, queue: str, field: str, expected: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (value := int(getattr(connection.queue_status(queue), field))) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


# ---------------------------------------------------------------------- sink


def test_sink_publishes_each_row_once_in_order_and_a_replayed_batch_adds_nothing(
    spark: SparkSession, ring: cluster.ClusterInfo, tmp_path: Path
) -> None:
    queue = "ha.spark-sink"
    inputs = tmp_path / "lines"
    inputs.mkdir()
    expected = [f"m{i:03d}" for i in range(500)]
    for part in range(5):  # one file per micro-batch (maxFilesPerTrigger 1), in modification-time order
        path = inputs / f"part-{part}.txt"
        path.write_text("".join(line + "\n" for line in expected[part * 100 : (part + 1) * 100]))
        os.utime(path, (1_700_000_000 + part, 1_700_000_000 + part))
    checkpoint = tmp_path / "checkpoint"
    histories = tmp_path / "histories"

    def run() -> str:
        lines = spark.readStream.option("maxFilesPerTrigger", 1).text(str(inputs))
        messages = lines.select(
            F.col("value").alias("body"), F.create_map(F.lit("line"), F.col("value")).alias("headers")
        )
        query = (
            messages.writeStream.format("ringq")
            .option("addresses", _addresses(ring))
            .options(**_access(ring))
            .option("queue", queue)
            .option("historyDir", str(histories))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        _finish(query)
        return str(query.id)

    with ringq.Connection(_addresses(ring).split(","), **access(ring)) as connection:
        connection.declare_queue(queue)
        query_id = run()
        commits = checkpoint / "commits"
        assert sorted(int(p.name) for p in commits.iterdir() if p.name.isdigit()) == [0, 1, 2, 3, 4]
        assert _settles(connection, queue, "depth", 500) == 500
        # Forget that batch 4 was committed: the restarted query replays it (same query id, batch id and
        # partition: same publisher ids and seqs) and the queue drops every one of its messages.
        for name in ("4", ".4.crc"):
            (commits / name).unlink(missing_ok=True)
        assert run() == query_id
        assert (commits / "4").exists(), "batch 4 ran again"
        deliveries = _drain(connection, queue, 500)

    assert [d.body.decode() for d in deliveries] == expected, "every row once, in order"
    assert [d.headers.get("line") for d in deliveries] == expected
    assert [(d.publisher, d.seq) for d in deliveries] == [
        (scoped(ring, f"spark-{query_id}-{i // 100}-0"), i % 100 + 1) for i in range(500)
    ], "publisher id per (query, batch, partition) (scoped to the user on a TLS cluster); seq = row index + 1"
    confirms = Counter(
        (event["publisher"].rsplit("-", 2)[1], event["outcome"])
        for path in histories.glob("history-spark-*.jsonl")
        for event in map(json.loads, path.read_text().splitlines())
        if event["event"] == "confirm"
    )
    assert confirms == {(str(b), "confirmed"): 100 for b in range(5)} | {("4", "duplicate"): 100}, (
        "the replayed batch published again and the queue dropped all of it"
    )


# -------------------------------------------------------------------- source


def _reader(spark: SparkSession, ring: cluster.ClusterInfo, queue: str) -> DataFrame:
    return (
        spark.readStream.format("ringq")
        .option("addresses", _addresses(ring))
        .options(**_access(ring))
        .option("queue", queue)
        .option("maxMessagesPerBatch", "100")
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


def _publish(connection: ringq.Connection, queue: str, count: int) -> None:
    connection.declare_queue(queue)
    producer = connection.producer(queue, publisher_id="src", window=count)
    for i in range(count):
        producer.send(b"s%03d" % i, headers={"i": str(i)})
    producer.flush()
    producer.close()


def test_source_reads_every_message_in_order_and_acknowledges_after_the_batch(
    spark: SparkSession, ring: cluster.ClusterInfo, tmp_path: Path
) -> None:
    queue = "ha.spark-source"
    batches: dict[int, list[Row]] = {}
    with ringq.Connection(_addresses(ring).split(","), **access(ring)) as connection:
        _publish(connection, queue, 500)
        frame = _reader(spark, ring, queue)
        assert frame.schema.simpleString() == (
            "struct<body:binary,publisher:string,seq:bigint,message_id:bigint,redelivered:boolean,"
            "headers:map<string,string>>"
        )
        _finish(_collecting(frame, tmp_path / "checkpoint", batches))
        assert _settles(connection, queue, "depth", 0) == 0, "every message acknowledged once its batch was done"

    rows = [row for batch_id in sorted(batches) for row in batches[batch_id]]
    assert [row.seq for row in rows] == list(range(1, 501)), "every message once, in publisher order"
    assert [row.body for row in rows] == [b"s%03d" % i for i in range(500)]
    assert [row.headers for row in rows] == [{"i": str(i)} for i in range(500)]
    assert {row.publisher for row in rows} == {scoped(ring, "src")}
    assert not any(row.redelivered for row in rows)
    assert len(rows) == len({row.message_id for row in rows})
    assert len(batches) == 5 and all(len(batch) == 100 for batch in batches.values()), "maxMessagesPerBatch"


def test_source_reads_a_failed_batch_again_after_a_restart(
    spark: SparkSession, ring: cluster.ClusterInfo, tmp_path: Path
) -> None:
    queue = "ha.spark-replay"
    checkpoint = tmp_path / "checkpoint"
    first: dict[int, list[Row]] = {}
    second: dict[int, list[Row]] = {}
    with ringq.Connection(_addresses(ring).split(","), **access(ring)) as connection:
        _publish(connection, queue, 300)
        query = _collecting(_reader(spark, ring, queue), checkpoint, first, fail_batch=1)
        with pytest.raises(StreamingQueryException, match="fails on purpose"):
            query.awaitTermination(QUERY_TIMEOUT)
        assert [row.seq for row in first[0]] == list(range(1, 101))
        assert [row.seq for row in first[1]] == list(range(101, 201)), "batch 1 was read, then failed"
        # Batch 0 was acknowledged; what the failed run held went back to the queue with its source process.
        assert _settles(connection, queue, "ready", 200) == 200

        _finish(_collecting(_reader(spark, ring, queue), checkpoint, second))
        assert _settles(connection, queue, "depth", 0) == 0

    assert sorted(second) == [1, 2], "the restart replays batch 1, then reads on"
    assert [row.seq for row in second[1]] == list(range(101, 201))
    assert all(row.redelivered for row in second[1]), "the replayed batch's messages are flagged redelivered"
    assert [row.seq for row in second[2]] == list(range(201, 301))


# ------------------------------------------------------------------- options


def _error(action: Callable[[], StreamingQuery]) -> str:
    """The error of starting a query, raised by start() or by the query once it runs."""
    try:
        query = action()
    except Exception as error:
        return str(error)
    try:
        query.awaitTermination(QUERY_TIMEOUT)
    except StreamingQueryException as error:
        return str(error)
    finally:
        query.stop()
    return ""


def test_missing_options_and_columns_are_named(spark: SparkSession, tmp_path: Path) -> None:
    with pytest.raises(Exception, match='needs the option "queue"'):
        spark.readStream.format("ringq").option("addresses", "127.0.0.1:1").load()
    with pytest.raises(Exception, match='needs the option "addresses"'):
        spark.readStream.format("ringq").option("queue", "q").load()

    numbers = spark.readStream.format("rate").load()
    bodies = numbers.select(F.col("value").cast("string").alias("body"))

    def sink(frame: DataFrame, options: dict[str, str], name: str) -> Callable[[], StreamingQuery]:
        writer = frame.writeStream.format("ringq").option("checkpointLocation", str(tmp_path / name))
        return lambda: writer.options(**options).start()

    assert 'needs the option "queue"' in _error(sink(bodies, {"addresses": "127.0.0.1:1"}, "no-queue"))
    assert 'needs the option "addresses"' in _error(sink(bodies, {"queue": "q"}, "no-addresses"))
    everything = {"addresses": "127.0.0.1:1", "queue": "q"}
    assert 'column "body"' in _error(sink(numbers, everything, "no-body"))


def test_option_parsing() -> None:
    options = SourceOptions.parse({"Addresses": " 127.0.0.1:1 , h:2,", "QUEUE": "q", "maxmessagesperbatch": "10"})
    assert options.origin == QueueOptions(("127.0.0.1:1", "h:2"), "q")
    assert (options.max_per_batch, options.prefetch, options.poll_timeout) == (10, 20, 0.5)
    sink = SinkOptions.parse({"addresses": "h:1", "queue": "q", "window": "5", "persistent": "true"})
    assert (sink.window, sink.batch, sink.persistent) == (5, 100, True)
    for bad, message in [
        ({"addresses": "h", "queue": "q"}, "not host:port"),
        ({"addresses": "h:1", "queue": "q", "maxMessagesPerBatch": "0"}, "at least 1"),
        ({"addresses": "h:1", "queue": "q", "maxMessagesPerBatch": "x"}, "must be an integer"),
        ({"addresses": "h:1", "queue": "q", "maxMessagesPerBatch": "10", "prefetch": "5"}, "at least"),
        ({"addresses": "h:1", "queue": " "}, 'needs the option "queue"'),
    ]:
        with pytest.raises(RingqOptionError, match=message):
            SourceOptions.parse(bad)
    with pytest.raises(RingqOptionError, match="true or false"):
        SinkOptions.parse({"addresses": "h:1", "queue": "q", "persistent": "maybe"})
    secured = QueueOptions.parse({"addresses": "h:1", "queue": "q", "tlsCa": "ca.pem", "User": "u", "password": "p"})
    assert (secured.tls_ca, secured.user, secured.password) == ("ca.pem", "u", "p")
    assert "'p'" not in repr(secured), "the password is not shown"
    for alone in ({"user": "u"}, {"password": "p"}):
        with pytest.raises(RingqOptionError, match='"user" and "password" go together'):
            QueueOptions.parse({"addresses": "h:1", "queue": "q", **alone})
