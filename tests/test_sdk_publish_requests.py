"""The SDK producer's Publish requests (ringq.aio.Producer._request): every still unconfirmed message of
the batch, in order, with its body, seq, persistence and headers; none that is settled, and no request
at all when none is left (the broker refuses a request without messages)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ringq import aio
from ringq.v1 import queue_pb2


def _producer() -> aio.Producer:
    connection: Any = SimpleNamespace(
        credentials=None, tls=None, ref=lambda queue: queue_pb2.QueueRef(vhost="/", queue=queue)
    )
    return aio.Producer(connection, "orders", "publisher-1", window=10, batch=10, persistent=False)


def _pending(producer: aio.Producer, seq: int, body: bytes, headers: dict[str, str], persistent: bool) -> None:
    future: asyncio.Future[aio.Outcome] = asyncio.get_running_loop().create_future()
    producer._unconfirmed[seq] = aio._Pending(body, headers, persistent, future)


def test_a_request_holds_the_unconfirmed_messages_of_its_batch_as_given() -> None:
    async def scenario() -> None:
        producer = _producer()
        _pending(producer, 1, b"a", {}, False)
        _pending(producer, 2, b"b", {"k": "v"}, True)
        _pending(producer, 4, b"d", {}, True)
        request = producer._request([1, 2, 3, 4])  # 3 was settled meanwhile
        assert (request.queue.queue, request.publisher) == ("orders", "publisher-1")
        assert [(m.seq, m.body, m.persistent, dict(m.headers)) for m in request.messages] == [
            (1, b"a", False, {}),
            (2, b"b", True, {"k": "v"}),
            (4, b"d", True, {}),
        ]
        assert not producer._request([3, 5]).messages

    asyncio.run(scenario())
