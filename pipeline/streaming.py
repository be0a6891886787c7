"""A Spark Structured Streaming source and sink for ringq queues (format "ringq") and a source for ringq
ordered streams (format "ringq-stream"), on PySpark 4's Python Data Source API.

Responsible for: `RingqDataSource` (register it with `register(spark)`), its options (parsed and checked
with clear errors), the sink (`RingqStreamWriter`: every row becomes one message, published with confirms)
and the source (`RingqStreamReader`: messages taken with a consumer, acknowledged once their micro-batch
is done).

    register(spark)
    (df.select(F.col("value").alias("body"))               # body: binary or string; headers: optional
       .writeStream.format("ringq")
       .option("addresses", "127.0.0.1:7101,127.0.0.1:7102").option("queue", "orders")
       .option("checkpointLocation", "/tmp/ck").start())
    rows = (spark.readStream.format("ringq")
              .option("addresses", "127.0.0.1:7101").option("queue", "orders")
              .option("maxMessagesPerBatch", "1000").load())
    # body binary, publisher string, seq long, message_id long, redelivered boolean, headers map<string,string>

Options: `addresses` (comma-separated host:port of any nodes; required), `queue` (required; it must
exist: neither side declares it), `vhost` ("/"), `retryForSeconds` (30: how long the SDK retries through a
failover without progress), `historyDir` (none: a directory where each sink task and each source process
records its ringq client history, `history-spark-*.jsonl`, for `python -m pipeline --history DIR`; lines
a killed process had not flushed are lost), `tlsCa` (none: plaintext, a development cluster on loopback; a
path: TLS to the nodes, trusting that CA's PEM), `user` and `password` (together: who the query acts as on
a cluster with authentication on; Spark's default spark.redaction.regex hides a "password" option in its
UI and logs). Sink: `window` (1000 unconfirmed messages per task), `batch`
(100 messages per publish request), `persistent` (false). Source: `maxMessagesPerBatch` (1000),
`prefetch` (twice maxMessagesPerBatch), `pollTimeoutMs` (500: how long a trigger waits for a first
message), `replayTimeoutMs` (5000: how long a replayed batch waits for each of its messages). A missing
or bad source option fails `load()`; the sink's options and columns are checked when the query runs its
first batch (`start()` does not reach Python), so they fail the query (StreamingQueryException).

Where things run: the sink's `write` in the tasks (one connection and producer per task); the source's
consumer in the driver's Python source process (one per query), which ships each batch's rows to its
task inside the partition (so a batch, maxMessagesPerBatch messages, passes through the driver). The
source is a `DataSourceStreamReader`, not a `SimpleDataSourceStreamReader`: the simple one re-reads a
replayed batch in a task (`readBetweenOffsets`), where nothing could acknowledge its messages after the
batch; here `partitions` runs in the source process for replays too. Spark calls `commit(end)` of batch N
only when it builds batch N+1 (and never for the last batch of a run), so the source also acknowledges in
`latestOffset(start)`, which Spark calls only after the batch ending at `start` completed.

Guarantees of the sink (at least once into the queue; no duplicate from a retried batch):
- A task's `write` returns only once the queue confirmed every row of its partition (outcome CONFIRMED,
  or DUPLICATE: the queue already held it). A message the queue rejected (full, overflow
  reject-publish) or a publish that failed after the SDK's retries fails the task, hence the batch:
  a micro-batch is committed only when every one of its messages is in the queue.
- Each task publishes with publisher id `spark-<query id>-<batch id>-<partition id>` and seq = the
  row's index in its partition + 1 (the query id survives restarts from the same checkpoint). A task
  attempt retried, or a whole batch replayed after a failure or restart, publishes under the same ids,
  so the queue drops what it already holds: no duplicate, provided the replay yields the same rows in
  the same partitions in the same order (a deterministic query over a replayable source, e.g. files;
  not a nondeterministic shuffle). The queue remembers every publisher id (one small entry per
  batch and partition) for as long as it exists.
- Rows of one partition keep their order in the queue; partitions of a batch interleave; batches follow
  each other (batch N+1 starts after batch N is confirmed).
- Not transactional: the messages of a batch are visible to consumers as soon as they are confirmed,
  before Spark commits the batch; a batch that fails and is never retried leaves what it confirmed.

Guarantees of the source (at least once; in queue order):
- One consumer (prefetch `prefetch`) in the driver's source process takes the messages; a micro-batch
  is the next messages in queue order, at most maxMessagesPerBatch (or all the source holds with
  Trigger.AvailableNow's read limit), in one partition (queue order kept). Offsets count the
  messages the query has taken: {"messages": N}.
- A message is acknowledged only after the micro-batch holding it completed: when Spark commits the
  offsets or asks for the next batch's offsets (`latestOffset` is called only once the previous batch's
  sink finished and its commit log entry is written; with asyncProgressTrackingEnabled, once the sink
  finished: the commit log entry may come later). Before going idle (a trigger finds no new
  message) the source closes its connection, which sends the acknowledgements and waits until the queue
  applied them; so a Trigger.AvailableNow run leaves nothing of its own unacknowledged.
- A crash, a failed batch or a stop: the messages not acknowledged go back to the queue (the consumer's
  stream ends with the process) at their place and come again, flagged redelivered. After a restart
  Spark replays the last uncommitted batch: the source takes the same number of messages again, which
  are the requeued ones when this query is the queue's only consumer. The last batch before a `stop()`
  is not acknowledged unless a trigger ran after it; it is delivered again on the next run.
- Trigger.AvailableNow takes at most the messages ready in the queue when the run starts, and ends once
  they are taken (or when none arrives within pollTimeoutMs).
- Not exactly once: a message can reach the sink twice (after a crash, a failed batch, a stop, or a
  failover of the queue's master). Deduplicate on (publisher, seq) downstream if it matters.

The ordered-stream source (format "ringq-stream", `RingqOrderedStreamReader`):

    rows = (spark.readStream.format("ringq-stream")
              .option("addresses", "127.0.0.1:7101").option("stream", "orders").load())
    # stream_seq long, group string, body binary, headers map<string,string>, redelivered boolean

Options: those of the queue source with `stream` (required; the stream must exist) in place of `queue`,
and `leaseTtlMs` (3000, at least 300: the consumer lease's time to live). Guarantees (at least once; in
stream order; a committed batch never again):
- The source process is the stream's single active consumer: it takes the consumer lease (waiting as a
  standby while another holds it, e.g. the previous run's process until its lease expires) at the first
  offset or partition Spark asks for, renews it on an event-loop thread of its own between Spark's calls,
  and gives it up at `stop()` or when a Trigger.AvailableNow run finds nothing more (Spark ends that
  process without waiting for `stop`). A lost lease fails the query; the messages it held come again.
- Rows are in stream order, each stream_seq once: the SDK drops copies, and the source keeps one
  delivery per stream_seq (a message that comes again on a new consume call replaces the one held, for
  its acknowledgement, and adds no row). Offsets are the last stream_seq of each batch,
  {"stream_seq": N}; a batch holds at most maxMessagesPerBatch messages, in one partition.
- A message is acknowledged only after the batch holding it completed (as for queues: in `commit` or the
  next `latestOffset`). After a restart Spark replays the last uncommitted batch: the new consumer
  resumes after the last acknowledgement, the batch's messages come again flagged redelivered, and any
  message at or below the start of the batch (a committed batch whose acknowledgements had not reached
  the stream) is acknowledged and dropped, not read again.
- Trigger.AvailableNow takes at most the unacknowledged messages of the stream's groups when the run
  starts (copies count there, so a run may end on pollTimeoutMs instead) and ends when none is left.
- With historyDir set, each message the SDK hands the source is recorded in its history as a
  `stream_deliver` event (stream, stream_seq, group, redelivered; by ringq.streams), flushed after each
  take, for the lifecycle job's stream-order check (pipeline.guarantees.stream_order_violations).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pyspark import TaskContext
from pyspark.sql import Row, SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

import ringq
from ringq import aio
from ringq.streams import StreamConsumer, StreamMessage

T = TypeVar("T")
FORMAT = "ringq"
OFFSET_KEY = "messages"
# Local properties Spark sets on every task of a micro-batch (StreamExecution.QUERY_ID_KEY and
# MicroBatchExecution.BATCH_ID_KEY).
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
# Between two messages of one trigger: a longer silence ends the batch.
DRAIN_GAP_SECONDS = 0.02

SOURCE_SCHEMA = StructType(
    [
        StructField("body", BinaryType(), False),
        StructField("publisher", StringType(), False),
        StructField("seq", LongType(), False),
        StructField("message_id", LongType(), False),
        StructField("redelivered", BooleanType(), False),
        StructField("headers", MapType(StringType(), StringType(), False), False),
    ]
)
HEADERS_TYPE = MapType(StringType(), StringType())

log = logging.getLogger(__name__)


class RingqOptionError(ValueError):
    """A missing or bad option (or column) of the ringq source or sink."""


# ------------------------------------------------------------------ options


def _lowered(options: Mapping[str, str]) -> dict[str, str]:
    return {key.lower(): value for key, value in options.items()}


def _required(options: dict[str, str], name: str, example: str) -> str:
    value = options.get(name.lower(), "").strip()
    if not value:
        raise RingqOptionError(f'the ringq data source needs the option "{name}" ({example})')
    return value


def _integer(options: dict[str, str], name: str, default: int, minimum: int) -> int:
    text = options.get(name.lower())
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise RingqOptionError(f'option "{name}" must be an integer, got {text!r}') from None
    if value < minimum:
        raise RingqOptionError(f'option "{name}" must be at least {minimum}, got {value}')
    return value


def _seconds(options: dict[str, str], name: str, default: float) -> float:
    text = options.get(name.lower())
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise RingqOptionError(f'option "{name}" must be a number, got {text!r}') from None
    if value < 0:
        raise RingqOptionError(f'option "{name}" must not be negative, got {value}')
    return value


def _boolean(options: dict[str, str], name: str, default: bool) -> bool:
    text = options.get(name.lower())
    if text is None:
        return default
    if text.strip().lower() in ("true", "1", "yes"):
        return True
    if text.strip().lower() in ("false", "0", "no"):
        return False
    raise RingqOptionError(f'option "{name}" must be true or false, got {text!r}')


@dataclass(frozen=True)
class QueueOptions:
    """Where the queue is: the options both the source and the sink need."""

    addresses: tuple[str, ...]
    queue: str
    vhost: str = "/"
    retry_for: float = 30.0
    history_dir: str | None = None
    tls_ca: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> QueueOptions:
        lowered = _lowered(options)
        text = _required(lowered, "addresses", 'comma-separated host:port of ringq nodes, e.g. "127.0.0.1:7101"')
        addresses = tuple(part.strip() for part in text.split(",") if part.strip())
        for address in addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise RingqOptionError(f'option "addresses": {address!r} is not host:port')
        user, password = lowered.get("user") or None, lowered.get("password")
        if (user is None) != (password is None):
            raise RingqOptionError('the options "user" and "password" go together')
        return cls(
            addresses=addresses,
            queue=_required(lowered, "queue", "the name of an existing ringq queue"),
            vhost=lowered.get("vhost", "/") or "/",
            retry_for=_seconds(lowered, "retryForSeconds", 30.0),
            history_dir=lowered.get("historydir") or None,
            tls_ca=lowered.get("tlsca") or None,
            user=user,
            password=password,
        )

    def connect(self, name: str) -> ringq.Connection:
        """A connection named `name`, recording its history in `history-<name>.jsonl` of historyDir if set."""
        return ringq.Connection(list(self.addresses), **self._connection_arguments(name))

    def connect_aio(self, name: str) -> aio.Connection:
        """`connect`, for asyncio (made on the event loop that will use it)."""
        return aio.Connection(list(self.addresses), **self._connection_arguments(name))

    def _connection_arguments(self, name: str) -> dict[str, Any]:
        # "" rather than None: not $RINGQ_HISTORY, one file that every task would append to at once.
        history = os.path.join(self.history_dir, f"history-{name}.jsonl") if self.history_dir else ""
        return {
            "vhost": self.vhost,
            "name": name,
            "retry_for": self.retry_for,
            "history": history,
            "tls": ringq.TLS(ca=self.tls_ca) if self.tls_ca else None,
            "credentials": ringq.Credentials(self.user, self.password or "") if self.user is not None else None,
        }


@dataclass(frozen=True)
class SinkOptions:
    target: QueueOptions
    window: int = 1000
    batch: int = 100
    persistent: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        lowered = _lowered(options)
        return cls(
            target=QueueOptions.parse(options),
            window=_integer(lowered, "window", 1000, 1),
            batch=_integer(lowered, "batch", 100, 1),
            persistent=_boolean(lowered, "persistent", False),
        )


@dataclass(frozen=True)
class SourceOptions:
    origin: QueueOptions
    max_per_batch: int = 1000
    prefetch: int = 2000
    poll_timeout: float = 0.5
    replay_timeout: float = 5.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        lowered = _lowered(options)
        most = _integer(lowered, "maxMessagesPerBatch", 1000, 1)
        prefetch = _integer(lowered, "prefetch", 2 * most, 1)
        if prefetch < most:
            raise RingqOptionError(
                f'option "prefetch" ({prefetch}) must be at least "maxMessagesPerBatch" ({most}): the source holds '
                "a whole batch unacknowledged"
            )
        return cls(
            origin=QueueOptions.parse(options),
            max_per_batch=most,
            prefetch=prefetch,
            poll_timeout=_integer(lowered, "pollTimeoutMs", 500, 0) / 1000,
            replay_timeout=_integer(lowered, "replayTimeoutMs", 5000, 0) / 1000,
        )


# -------------------------------------------------------------- data source


class RingqDataSource(DataSource):
    """The "ringq" format: a streaming source (readStream) and a streaming sink (writeStream)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        QueueOptions.parse(self.options)  # a missing queue or addresses fails at load(), not at start()
        return SOURCE_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        options = SourceOptions.parse(self.options)
        if schema.simpleString() != SOURCE_SCHEMA.simpleString():
            raise RingqOptionError(
                f"the ringq source has the schema {SOURCE_SCHEMA.simpleString()}; do not give it another "
                f"({schema.simpleString()})"
            )
        return RingqStreamReader(options)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return RingqStreamWriter.of(SinkOptions.parse(self.options), schema)


def register(spark: SparkSession) -> None:
    """Make formats "ringq" (readStream and writeStream) and "ringq-stream" (readStream) available to `spark`."""
    spark.dataSource.register(RingqDataSource)
    spark.dataSource.register(RingqStreamDataSource)


# --------------------------------------------------------------------- sink


@dataclass
class RingqCommitMessage(WriterCommitMessage):
    """What one task published: its publisher id and how many rows the queue confirmed or already held."""

    publisher: str
    messages: int
    confirmed: int
    duplicates: int


class RingqSinkError(RuntimeError):
    """Rows of a partition that did not make it into the queue (the task fails; Spark retries it)."""


class _Confirms:
    """Counts the outcomes of a task's messages (completed on the SDK's thread) and waits for all."""

    def __init__(self) -> None:
        self.outcomes: Counter[ringq.Outcome] = Counter()
        self.errors: list[BaseException] = []
        self.sent = 0
        self.done = 0
        self._changed = threading.Condition()

    def __call__(self, future: Any) -> None:
        error = future.exception()
        with self._changed:
            if error is not None:
                self.errors.append(error)
            else:
                self.outcomes[future.result()] += 1
            self.done += 1
            self._changed.notify_all()

    def wait(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.done >= self.sent)


@dataclass(frozen=True)
class RingqStreamWriter(DataSourceStreamWriter):
    """Publishes each partition of a micro-batch with one producer; see the module's guarantees."""

    options: SinkOptions
    body_index: int
    body_is_text: bool
    headers_index: int | None

    @classmethod
    def of(cls, options: SinkOptions, schema: StructType) -> RingqStreamWriter:
        names = [field.name for field in schema.fields]
        if "body" not in names:
            raise RingqOptionError(
                f'the ringq sink publishes the column "body" (binary or string); the input has {names}'
            )
        body_type: DataType = schema["body"].dataType
        if not isinstance(body_type, BinaryType | StringType):
            raise RingqOptionError(f'column "body" must be binary or string, not {body_type.simpleString()}')
        headers_index = None
        if "headers" in names:
            headers_type = schema["headers"].dataType
            if not (
                isinstance(headers_type, MapType)
                and isinstance(headers_type.keyType, StringType)
                and isinstance(headers_type.valueType, StringType)
            ):
                raise RingqOptionError(
                    f'column "headers" must be map<string,string>, not {headers_type.simpleString()}'
                )
            headers_index = names.index("headers")
        return cls(options, names.index("body"), isinstance(body_type, StringType), headers_index)

    def write(self, iterator: Iterator[Row]) -> RingqCommitMessage:
        context = TaskContext.get()
        query_id = context.getLocalProperty(QUERY_ID_PROPERTY) if context is not None else None
        batch_id = context.getLocalProperty(BATCH_ID_PROPERTY) if context is not None else None
        if context is None or not query_id or batch_id is None:
            raise RingqSinkError("the ringq sink writes only from the tasks of a streaming micro-batch")
        publisher = f"spark-{query_id}-{batch_id}-{context.partitionId()}"
        first = next(iterator, None)
        if first is None:  # an empty partition: no connection
            return RingqCommitMessage(publisher=publisher, messages=0, confirmed=0, duplicates=0)
        target = self.options.target
        confirms = _Confirms()
        connection = target.connect(name=f"{publisher}-attempt{context.attemptNumber()}")
        try:
            producer = connection.producer(
                target.queue,
                publisher_id=publisher,
                window=self.options.window,
                batch=self.options.batch,
                persistent=self.options.persistent,
            )
            for row in itertools.chain([first], iterator):
                body, headers = self._message(row, confirms.sent)
                confirms.sent += 1  # before send: its callback may run at once
                producer.send(body, headers=headers, callback=confirms)
            producer.flush()
            confirms.wait()
        finally:
            connection.close()
        rejected = confirms.outcomes[ringq.Outcome.REJECTED]
        if confirms.errors:
            raise RingqSinkError(
                f"{len(confirms.errors)} of {confirms.sent} messages of {publisher} were not confirmed by queue "
                f"{target.queue!r}: {confirms.errors[0]}"
            ) from confirms.errors[0]
        if rejected:
            raise RingqSinkError(
                f"queue {target.queue!r} rejected {rejected} of {confirms.sent} messages of {publisher} (it is full "
                "and its overflow is reject-publish); a retry publishes them again, the others are deduplicated"
            )
        return RingqCommitMessage(
            publisher=publisher,
            messages=confirms.sent,
            confirmed=confirms.outcomes[ringq.Outcome.CONFIRMED],
            duplicates=confirms.outcomes[ringq.Outcome.DUPLICATE],
        )

    def _message(self, row: Row, index: int) -> tuple[bytes, dict[str, str] | None]:
        value = row[self.body_index]
        if value is None:
            raise RingqSinkError(f"row {index} of the partition has a null body")
        body = value.encode() if self.body_is_text else bytes(value)
        headers = None
        if self.headers_index is not None and row[self.headers_index] is not None:
            headers = {key: text for key, text in row[self.headers_index].items() if text is not None}
        return body, headers

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        done = [m for m in messages if isinstance(m, RingqCommitMessage)]
        log.info(
            "ringq sink: batch %d: %d messages in queue %r (%d were already there)",
            batchId,
            sum(m.messages for m in done),
            self.options.target.queue,
            sum(m.duplicates for m in done),
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning(
            "ringq sink: batch %d failed; what it confirmed stays in queue %r, a retry does not repeat it",
            batchId,
            self.options.target.queue,
        )


# ------------------------------------------------------------------- source


class RingqPartition(InputPartition):
    """The rows of one micro-batch, taken on the driver and shipped to the task that emits them."""

    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        super().__init__(len(rows))
        self.rows = rows


def _row(delivery: ringq.Delivery) -> tuple[Any, ...]:
    return (
        bytes(delivery.body),
        delivery.publisher,
        delivery.seq,
        delivery.message_id,
        delivery.redelivered,
        dict(delivery.headers),
    )


def _count(offset: Mapping[str, Any]) -> int:
    return int(offset[OFFSET_KEY])


class RingqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Takes messages with a consumer in the driver's source process and acknowledges them once their batch
    is done; see the module's guarantees. Spark creates readers in several processes (planning, tasks):
    nothing connects before the first offset or partition is asked for."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._connection: ringq.Connection | None = None
        self._consumer: ringq.Consumer | None = None
        self._held: deque[tuple[int, ringq.Delivery]] = deque()  # taken, not acknowledged, by offset
        self._taken: int | None = None  # offset of the last message taken
        self._budget: int | None = None  # Trigger.AvailableNow: how many more messages this run may take
        self._unflushed = False  # acknowledgements not known to be applied by the queue

    # Spark's calls, all in the driver's source process except `read`.

    def initialOffset(self) -> dict[str, int]:
        return {OFFSET_KEY: 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.options.max_per_batch)

    def prepareForTriggerAvailableNow(self) -> None:
        self._budget = int(self._connect().queue_status(self.options.origin.queue).ready)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        begin = _count(start)
        self._acknowledge_through(begin)  # Spark asks for batch N+1 only once batch N is done
        if self._taken is None or self._taken < begin:
            self._taken = begin
        most = limit.max_rows if isinstance(limit, ReadMaxRows) else self.options.prefetch
        self._take(begin + most, self.options.poll_timeout, DRAIN_GAP_SECONDS, budgeted=True)
        end = min(self._taken, begin + most)
        if end == begin and self._unflushed and not self._held:
            self._close()  # going idle: make sure the queue applied the acknowledgements
        return {OFFSET_KEY: end}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        low, high = _count(start), _count(end)
        if self._taken is None or self._taken < low:
            self._taken = low
        if self._taken < high:
            # A batch from the offset log of an earlier run (a restart): take as many messages again.
            self._take(high, self.options.replay_timeout, self.options.replay_timeout, budgeted=False)
            if self._taken < high:
                log.warning(
                    "ringq source: replaying messages %d..%d of queue %r found only %d",
                    low + 1,
                    high,
                    self.options.origin.queue,
                    self._taken - low,
                )
                self._taken = high
        rows = [_row(delivery) for offset, delivery in self._held if low < offset <= high]
        return [RingqPartition(rows)] if rows else []

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, RingqPartition)
        return iter(partition.rows)

    def commit(self, end: dict[str, Any]) -> None:
        self._acknowledge_through(_count(end))

    def stop(self) -> None:
        self._close()

    # The consumer.

    def _connect(self) -> ringq.Connection:
        if self._connection is None:
            origin = self.options.origin
            self._connection = origin.connect(name=f"spark-source-{origin.queue}-{os.getpid()}")
        return self._connection

    def _take(self, until: int, first_wait: float, gap: float, *, budgeted: bool) -> None:
        """Take messages (offsets self._taken+1..until) while they come within `first_wait`, then `gap`."""
        assert self._taken is not None
        if self._consumer is None:
            self._consumer = self._connect().consumer(self.options.origin.queue, prefetch=self.options.prefetch)
        wait = first_wait
        while self._taken < until and not (budgeted and self._budget is not None and self._budget <= 0):
            delivery = self._consumer.next(max(wait, 0.001))  # 0 would never find a message
            if delivery is None:
                return
            self._taken += 1
            self._held.append((self._taken, delivery))
            if self._budget is not None:
                self._budget -= 1
            wait = gap

    def _acknowledge_through(self, offset: int) -> None:
        lost = 0
        while self._held and self._held[0][0] <= offset:
            _, delivery = self._held.popleft()
            lost += not delivery.ack()
            self._unflushed = True
        if lost:
            log.warning(
                "ringq source: %d acknowledgements went with a broken stream; those messages come again",
                lost,
            )

    def _close(self) -> None:
        """Close the connection: the consumer sends its acknowledgements and the queue applies them before
        ending the stream; what it holds unacknowledged goes back to the queue."""
        connection, self._connection, self._consumer = self._connection, None, None
        self._unflushed = False
        if connection is not None:
            connection.close()


# ------------------------------------------------------------ stream source


@dataclass(frozen=True)
class StreamSourceOptions:
    """The options of the "ringq-stream" source: where the ordered stream is, and how batches are cut."""

    origin: QueueOptions  # `queue` holds the stream's name: the same connection options as the queue source
    max_per_batch: int = 1000
    prefetch: int = 2000
    poll_timeout: float = 0.5
    replay_timeout: float = 5.0
    lease_ttl_ms: int = 3000

    @property
    def stream(self) -> str:
        return self.origin.queue

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> StreamSourceOptions:
        lowered = _lowered(options)
        if "queue" in lowered:
            raise RingqOptionError(
                'the ringq-stream source reads an ordered stream: give its name as "stream", not "queue" '
                '(format "ringq" reads queues)'
            )
        stream = _required(lowered, "stream", "the name of an existing ringq ordered stream")
        queue_source = SourceOptions.parse({**options, "queue": stream})
        return cls(
            origin=queue_source.origin,
            max_per_batch=queue_source.max_per_batch,
            prefetch=queue_source.prefetch,
            poll_timeout=queue_source.poll_timeout,
            replay_timeout=queue_source.replay_timeout,
            lease_ttl_ms=_integer(lowered, "leaseTtlMs", 3000, 300),
        )


STREAM_FORMAT = "ringq-stream"
STREAM_OFFSET_KEY = "stream_seq"
STREAM_SOURCE_SCHEMA = StructType(
    [
        StructField("stream_seq", LongType(), False),
        StructField("group", StringType(), False),
        StructField("body", BinaryType(), False),
        StructField("headers", MapType(StringType(), StringType(), False), False),
        StructField("redelivered", BooleanType(), False),
    ]
)


class RingqStreamDataSource(DataSource):
    """The "ringq-stream" format: a streaming source (readStream) of one ordered stream, in stream order."""

    @classmethod
    def name(cls) -> str:
        return STREAM_FORMAT

    def schema(self) -> StructType:
        StreamSourceOptions.parse(self.options)  # a bad option fails at load(), not at start()
        return STREAM_SOURCE_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        options = StreamSourceOptions.parse(self.options)
        if schema.simpleString() != STREAM_SOURCE_SCHEMA.simpleString():
            raise RingqOptionError(
                f"the ringq-stream source has the schema {STREAM_SOURCE_SCHEMA.simpleString()}; do not give it "
                f"another ({schema.simpleString()})"
            )
        return RingqOrderedStreamReader(options)


class _Loop:
    """An asyncio event loop on a daemon thread of this process, for the SDK's asyncio stream consumer (the
    blocking SDK has no stream verbs). Lease renewals run on it between Spark's calls."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def acknowledge(cls, messages: Iterable[StreamMessage]) -> None:
        """Acknowledge on the loop (the consumer's queues are not thread-safe)."""
        batch = list(messages)
        if batch:

            async def ack() -> None:
                for message in batch:
                    message.ack()

            cls.run(ack())

    @classmethod
    def run(cls, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="ringq-stream-source", daemon=True).start()
                cls._loop = loop
            loop = cls._loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)


def _stream_seq(offset: Mapping[str, Any]) -> int:
    return int(offset[STREAM_OFFSET_KEY])


def _stream_row(message: StreamMessage) -> tuple[Any, ...]:
    return (message.stream_seq, message.group, bytes(message.body), dict(message.headers), message.redelivered)


class RingqOrderedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Reads one ordered stream as its single active consumer (the consumer lease is taken at the first
    offset or partition asked for and held until the query stops) and acknowledges each message once the
    batch holding it completed; see the stream source's guarantees in the module docstring."""

    def __init__(self, options: StreamSourceOptions) -> None:
        self.options = options
        self._connection: aio.Connection | None = None
        self._consumer: StreamConsumer | None = None
        self._held: OrderedDict[int, StreamMessage] = OrderedDict()  # taken, not acknowledged, by stream_seq
        self._rows: dict[int, tuple[Any, ...]] = {}  # the row of each held message, as first taken
        self._done = 0  # stream_seq through which Spark completed the batches (acknowledged or to be)
        self._budget: int | None = None  # Trigger.AvailableNow: how many more deliveries this run may see

    # Spark's calls, all in the driver's source process except `read`.

    def initialOffset(self) -> dict[str, int]:
        return {STREAM_OFFSET_KEY: 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.options.max_per_batch)

    def prepareForTriggerAvailableNow(self) -> None:
        status = _Loop.run(self._connect().stream_status(self.options.stream))
        depths = [group.depth for group in status.groups]
        # Unacknowledged messages of every group (copies included: the SDK drops those, so a run may end on
        # a poll timeout instead); unknown while a group's master is unreachable: no bound then.
        self._budget = None if any(depth < 0 for depth in depths) else sum(depths)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        begin = _stream_seq(start)
        self._acknowledge_through(begin)  # Spark asks for batch N+1 only once batch N is done
        most = limit.max_rows if isinstance(limit, ReadMaxRows) else self.options.prefetch
        self._take(lambda: self._count_after(begin) >= most, self.options.poll_timeout, DRAIN_GAP_SECONDS)
        after = [seq for seq in self._held if seq > begin][:most]
        if not after and not self._held and self._budget is not None:
            # Trigger.AvailableNow found nothing more: the run ends here. Spark stops this process without
            # waiting for `stop`, so give the lease up (and send the acknowledgements) now.
            self.stop()
        return {STREAM_OFFSET_KEY: after[-1] if after else begin}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        low, high = _stream_seq(start), _stream_seq(end)
        self._acknowledge_through(low)
        if not self._held or next(reversed(self._held)) < high:
            # A batch from the offset log of an earlier run (a restart): take again through its last message.
            wait = self.options.replay_timeout
            self._take(lambda: bool(self._held) and next(reversed(self._held)) >= high, wait, wait)
            if not self._held or next(reversed(self._held)) < high:
                log.warning(
                    "ringq-stream source: replaying stream %r through stream_seq %d found only %d messages",
                    self.options.stream,
                    high,
                    self._count_after(low),
                )
        rows = [self._rows[seq] for seq in self._held if low < seq <= high]
        return [RingqPartition(rows)] if rows else []

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, RingqPartition)
        return iter(partition.rows)

    def commit(self, end: dict[str, Any]) -> None:
        self._acknowledge_through(_stream_seq(end))

    def stop(self) -> None:
        """Send the acknowledgements, give the consumer lease up and close the connection."""
        connection, self._connection, self._consumer = self._connection, None, None
        self._held.clear()
        self._rows.clear()
        if connection is not None:
            _Loop.run(connection.close())

    # The consumer.

    def _connect(self) -> aio.Connection:
        if self._connection is None:
            origin = self.options.origin
            name = f"spark-stream-source-{origin.queue}-{os.getpid()}"

            async def made() -> aio.Connection:  # its channels belong to the loop that makes it
                return origin.connect_aio(name)

            self._connection = _Loop.run(made())
        return self._connection

    def _count_after(self, seq: int) -> int:
        return sum(1 for held in self._held if held > seq)

    def _take(self, enough: Callable[[], bool], first_wait: float, gap: float) -> None:
        """Take messages while `enough()` is false and they come within `first_wait`, then `gap`; drop (and
        acknowledge) what Spark already completed, keep one copy of each message held."""
        connection = self._connect()
        if self._consumer is None:
            self._consumer = _Loop.run(
                connection.stream_consumer(
                    self.options.stream, prefetch=self.options.prefetch, lease_ttl_ms=self.options.lease_ttl_ms
                )
            )
        try:
            self._take_from(self._consumer, connection, enough, first_wait, gap)
        finally:
            connection.history.flush()  # a source process is killed rather than stopped: keep what it saw

    def _take_from(
        self,
        consumer: StreamConsumer,
        connection: aio.Connection,
        enough: Callable[[], bool],
        first_wait: float,
        gap: float,
    ) -> None:
        wait = first_wait
        while not enough() and not (self._budget is not None and self._budget <= 0):
            message = _Loop.run(consumer.next(max(wait, 0.001)))  # raises once the lease is lost
            if message is None:
                return
            if self._budget is not None:
                self._budget -= 1
            wait = gap
            seq = message.stream_seq
            if seq <= self._done:  # a batch Spark completed holds it (its acknowledgement lost, or not yet sent)
                _Loop.acknowledge([message])
            elif seq in self._held:
                self._held[seq] = message  # it came again on a new consume call: acknowledge this delivery
            elif self._held and seq < next(reversed(self._held)):
                raise RingqStreamOrderError(
                    f"stream {self.options.stream!r} delivered stream_seq {seq} after {next(reversed(self._held))}"
                )
            else:
                self._held[seq] = message
                self._rows[seq] = _stream_row(message)  # the SDK recorded its delivery (stream_deliver)

    def _acknowledge_through(self, seq: int) -> None:
        self._done = max(self._done, seq)
        completed: list[StreamMessage] = []
        while self._held and next(iter(self._held)) <= self._done:
            done, message = self._held.popitem(last=False)
            self._rows.pop(done, None)
            completed.append(message)
        _Loop.acknowledge(completed)


class RingqStreamOrderError(RuntimeError):
    """The stream delivered a message below one already taken (never, by the stream's guarantees)."""
