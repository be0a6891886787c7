"""Malformed requests (services/request_guard.py): every kind of RPC answers INVALID_ARGUMENT naming
the problem, handlers never see the garbage, well-formed requests pass untouched, and the log gets
one line per client host per interval however fast the garbage comes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from ringq.internal.v1 import peer_pb2_grpc
from ringq.v1 import queue_pb2, queue_pb2_grpc
from services.request_guard import RequestGuard

GARBAGE = b"\xff\xff\xff\xff\x0f"  # a field key whose varint never ends: no message parses it


class _Queues(queue_pb2_grpc.QueueServiceServicer):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    async def DeclareQueue(self, request: Any, context: Any) -> queue_pb2.DeclareQueueResponse:
        self.seen.append(request)
        return queue_pb2.DeclareQueueResponse(queue=queue_pb2.QueueInfo(queue=request.queue))

    async def Publish(self, request_iterator: Any, context: Any) -> AsyncIterator[queue_pb2.PublishResponse]:
        async for request in request_iterator:  # responses yielded: an async generator
            self.seen.append(request)
            yield queue_pb2.PublishResponse()

    async def Consume(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        async for request in request_iterator:  # responses written: a coroutine
            self.seen.append(request)
            await context.write(queue_pb2.ConsumeResponse())


class _Peers(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    async def Link(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]  # reads as links do
        while (frame := await context.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            self.seen.append(frame)
            await context.write(frame)


async def _serve() -> tuple[grpc.aio.Server, str, _Queues, _Peers]:
    server = grpc.aio.server(interceptors=[RequestGuard()])
    queues, peers = _Queues(), _Peers()  # type: ignore[abstract]  # only the methods under test
    queue_pb2_grpc.add_QueueServiceServicer_to_server(queues, server)
    peer_pb2_grpc.add_PeerServiceServicer_to_server(peers, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", queues, peers


async def _refused(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    raise AssertionError("the call succeeded")


def test_each_kind_of_rpc_refuses_a_malformed_request_and_serves_a_good_one() -> None:
    async def scenario() -> None:
        server, address, queues, peers = await _serve()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                raw_unary = channel.unary_unary("/ringq.v1.QueueService/DeclareQueue", None, None)
                code, details = await _refused(raw_unary(GARBAGE))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed request" in details
                good = queue_pb2.DeclareQueueRequest(queue=queue_pb2.QueueRef(queue="q"))
                assert (await queue_pb2_grpc.QueueServiceStub(channel).DeclareQueue(good)).queue.queue.queue == "q"

                for method in ("Publish", "Consume"):
                    raw_stream = channel.stream_stream(f"/ringq.v1.QueueService/{method}", None, None)
                    call = raw_stream(iter([b"", GARBAGE]))  # one good (empty) message, then garbage
                    responses = []
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        async for response in call:
                            responses.append(response)
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
                    assert len(responses) == 1, f"{method}: the good message was served before the refusal"

                link = channel.stream_stream("/ringq.internal.v1.PeerService/Link", None, None)(iter([GARBAGE]))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in link:
                        pass
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert all(not isinstance(r, bytes) and type(r).__name__ != "_Malformed" for r in queues.seen)
            assert len(queues.seen) == 3 and peers.seen == []
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_a_flood_of_garbage_logs_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        server, address, _, _ = await _serve()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                raw = channel.unary_unary("/ringq.v1.QueueService/DeclareQueue", None, None)
                for _ in range(200):
                    code, _details = await _refused(raw(GARBAGE))
                    assert code == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await server.stop(None)

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    refusals = [r for r in caplog.records if r.name == "ringq.requests"]
    assert len(refusals) == 1 and "127.0.0.1" in refusals[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info], "no traceback logged"
