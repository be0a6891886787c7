"""The blocking stream producer and consumer (ringq.blocking) over stand-ins for the asyncio ones, no cluster:
results and errors come back to the calling thread, acks made on any thread reach the consumer on the SDK's
loop thread, and closing a consumer from another thread ends an iteration blocked waiting for a message.
The round trip against a live cluster: tests/test_integration_ringqctl_streams.py."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, cast

import pytest

import ringq
from ringq import blocking, streams
from ringq.errors import RingqError
from ringq.streams import StreamMessage


class AioConsumer:
    """Stands in for ringq.streams.StreamConsumer: hands out what is put in `inbox`, records acks and the
    thread they ran on."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[StreamMessage | RingqError] = asyncio.Queue()
        self.acked: list[tuple[int, int]] = []  # (stream_seq, thread id)
        self.closed = False
        self.fencing_token = 7
        self.duplicates_dropped = 2
        self.redeliveries = 1
        self.waiting = ""

    async def next(self, timeout: float | None = None) -> StreamMessage | None:
        if self.closed:
            raise StopAsyncIteration
        try:
            item = await asyncio.wait_for(self.inbox.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(item, RingqError):
            raise item
        return item

    def ack(self, message: StreamMessage) -> None:
        self.acked.append((message.stream_seq, threading.get_ident()))

    async def close(self) -> None:
        self.closed = True


def consumer() -> tuple[blocking.StreamConsumer, AioConsumer]:
    async def made() -> AioConsumer:
        return AioConsumer()

    stand_in = blocking._run(made())
    return blocking.StreamConsumer(cast(streams.StreamConsumer, stand_in)), stand_in


def deliver(stand_in: AioConsumer, *seqs: int) -> None:
    for seq in seqs:
        message = StreamMessage(seq, f"m{seq}".encode(), {}, "stream/s/1", False, seq, cast(Any, stand_in))
        blocking._background_loop().call_soon_threadsafe(stand_in.inbox.put_nowait, message)


def loop_thread() -> int:
    async def ident() -> int:
        return threading.get_ident()

    return blocking._run(ident())


def test_messages_come_in_order_and_acks_run_on_the_loop_thread() -> None:
    wrapper, stand_in = consumer()
    deliver(stand_in, 1, 2, 3)
    got = []
    for message in wrapper:
        assert isinstance(message, ringq.StreamMessage)
        got.append(message.stream_seq)
        message.ack()
        if len(got) == 3:
            break
    wrapper.close()
    assert got == [1, 2, 3]
    assert [seq for seq, _ in stand_in.acked] == [1, 2, 3]
    assert {thread for _, thread in stand_in.acked} == {loop_thread()}
    assert (wrapper.fencing_token, wrapper.duplicates_dropped, wrapper.redeliveries) == (7, 2, 1)


def test_next_times_out_with_none_and_after_close_returns_none() -> None:
    wrapper, stand_in = consumer()
    started = time.monotonic()
    assert wrapper.next(0.2) is None
    assert time.monotonic() - started >= 0.2
    deliver(stand_in, 5)
    message = wrapper.next(5)
    assert message is not None and message.stream_seq == 5
    wrapper.ack(message)
    with wrapper:
        pass  # closes
    assert wrapper.next(5) is None
    assert list(wrapper) == []
    assert stand_in.closed
    assert [seq for seq, _ in stand_in.acked] == [5]


def test_close_from_another_thread_ends_a_blocked_iteration() -> None:
    wrapper, _ = consumer()
    ended = threading.Event()
    seen: list[StreamMessage] = []

    def iterate() -> None:
        seen.extend(wrapper)
        ended.set()

    thread = threading.Thread(target=iterate, daemon=True)
    thread.start()
    time.sleep(0.2)
    assert not ended.is_set()
    wrapper.close()
    assert ended.wait(5), "the iteration still waits after close()"
    assert seen == []


def test_an_error_of_the_consumer_is_raised_in_the_iterating_thread() -> None:
    wrapper, stand_in = consumer()
    lost = RingqError("the consumer lease was lost")
    blocking._background_loop().call_soon_threadsafe(stand_in.inbox.put_nowait, lost)
    with pytest.raises(RingqError, match="lease was lost"):
        next(iter(wrapper))
    wrapper.close()


class AioProducer:
    """Stands in for ringq.streams.StreamProducer: confirms every message with seq token<<32|n, except a body
    b"fail" (fails with a RingqError)."""

    def __init__(self) -> None:
        self.fencing_token = 3
        self.resends = 0
        self.groups_used = ["stream/s/1"]
        self.n = 0
        self.closed = False

    async def send(self, body: bytes, *, headers: Any = None, persistent: Any = None) -> asyncio.Future[int]:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if body == b"fail":
            asyncio.get_running_loop().call_later(0.01, future.set_exception, RingqError("lease lost"))
        else:
            self.n += 1
            asyncio.get_running_loop().call_later(0.01, future.set_result, self.fencing_token << 32 | self.n)
        return future

    async def publish_many(self, bodies: Any) -> list[int]:
        return [await (await self.send(body)) for body in bodies]

    async def flush(self) -> None:
        await asyncio.sleep(0.02)

    async def close(self) -> None:
        self.closed = True


def test_producer_results_and_errors_come_to_the_caller() -> None:
    async def made() -> AioProducer:
        return AioProducer()

    stand_in = blocking._run(made())
    called: list[int] = []
    with blocking.StreamProducer(cast(streams.StreamProducer, stand_in)) as producer:
        assert producer.publish(b"a") == 3 << 32 | 1
        future = producer.send(b"b", callback=lambda done: called.append(done.result()))
        assert future.result(5) == 3 << 32 | 2
        assert producer.publish_many([b"c", b"d"]) == [3 << 32 | 3, 3 << 32 | 4]
        with pytest.raises(RingqError, match="lease lost"):
            producer.publish(b"fail")
        producer.flush()
        assert (producer.fencing_token, producer.resends, producer.groups_used) == (3, 0, ["stream/s/1"])
    assert stand_in.closed
    assert called == [3 << 32 | 2]
