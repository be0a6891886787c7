"""The SDK's errors, without a cluster: gRPC statuses mapped to ringq.errors in one place (one-line messages,
`.code` and `.details` kept); against addresses where nothing listens, every API gives up within its
`connect_timeout` with ConnectionFailed naming every address and why; against nodes that answer (fake
QueueService servers in this process), UNAVAILABLE from one node is still a failover, and a cluster that
keeps answering UNAVAILABLE ends in Unavailable naming each node."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

import ringq
from ringq import aio, errors
from ringq.group import GroupMembership
from ringq.v1 import queue_pb2

CONNECT_TIMEOUT = 1.0
SLACK = 1.0  # scheduling on a busy 2-core machine, plus the probe that says why


def _dead_addresses(count: int) -> list[str]:
    """Loopback addresses where nothing listens (ports bound, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.PreconditionFailed),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.OUT_OF_RANGE, errors.InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.INTERNAL, errors.RingqError),
    ],
)
def test_statuses_map_to_one_class_each(code: grpc.StatusCode, kind: type[errors.RingqError]) -> None:
    error = errors.from_rpc_error(_rpc_error(code, "queue 'q' in vhost '/'\n  is not\there"), "127.0.0.1:7101")
    assert type(error) is kind
    assert (error.code, error.details, error.address) == (
        code,
        "queue 'q' in vhost '/'\n  is not\there",
        "127.0.0.1:7101",
    )
    assert str(error) == f"{code.name}: queue 'q' in vhost '/' is not here (node 127.0.0.1:7101)"
    assert not isinstance(error, grpc.RpcError), "RingqError is not a gRPC error"
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), str(again), again.code, again.details) == (kind, str(error), code, error.details)


def test_access_refusals_share_a_base() -> None:
    assert issubclass(errors.PermissionDenied, errors.AccessRefused)
    assert issubclass(errors.Unauthenticated, errors.AccessRefused)
    assert issubclass(errors.ConnectionFailed, errors.Unavailable), "an except Unavailable catches both"
    assert ringq.RingqError is errors.RingqError


def _fails_fast(what: Callable[[], Awaitable[Any]], addresses: list[str]) -> errors.ConnectionFailed:
    async def scenario() -> errors.ConnectionFailed:
        started = time.monotonic()
        with pytest.raises(errors.ConnectionFailed) as failed:
            await what()
        waited = time.monotonic() - started
        assert waited < CONNECT_TIMEOUT + SLACK, f"gave up after {waited:.1f} s, not within {CONNECT_TIMEOUT} s"
        return failed.value

    error = asyncio.run(scenario())
    assert error.addresses == addresses, "every address tried, in the order given"
    assert all("refused" in why.lower() for why in error.attempts.values()), error.attempts
    text = str(error)
    assert "\n" not in text and all(address in text for address in addresses), text
    assert error.code == grpc.StatusCode.UNAVAILABLE
    return error


def test_a_dead_cluster_fails_every_asyncio_call_within_connect_timeout() -> None:
    addresses = _dead_addresses(3)

    def connection() -> aio.Connection:
        return aio.Connection(addresses, connect_timeout=CONNECT_TIMEOUT)

    async def declare() -> None:
        async with connection() as c:
            await c.declare_queue("q")

    async def publish() -> None:
        async with connection() as c:
            await c.producer("q").publish(b"x")

    async def consume() -> None:
        async with connection() as c:
            async for _ in c.consumer("q"):
                pass

    async def admin() -> None:
        async with aio.Admin(addresses, connect_timeout=CONNECT_TIMEOUT) as a:
            await a.cluster_status()

    for what in (declare, publish, consume, admin):
        _fails_fast(what, addresses)


def test_a_dead_cluster_fails_the_blocking_api_within_connect_timeout() -> None:
    addresses = _dead_addresses(2)
    for call in (
        lambda: ringq.Connection(addresses, connect_timeout=CONNECT_TIMEOUT).queue_status("q"),
        lambda: ringq.Connection(addresses, connect_timeout=CONNECT_TIMEOUT).producer("q").publish(b"x"),
        lambda: ringq.Admin(addresses, connect_timeout=CONNECT_TIMEOUT).list_policies(),
    ):
        started = time.monotonic()
        with pytest.raises(errors.ConnectionFailed) as failed:
            call()
        assert time.monotonic() - started < CONNECT_TIMEOUT + SLACK
        assert failed.value.addresses == addresses


def test_the_default_connect_timeout_is_a_few_seconds() -> None:
    assert aio.Connection("127.0.0.1:1").nodes.connect_timeout == 5.0
    assert aio.Admin("127.0.0.1:1").nodes.connect_timeout == 5.0
    with pytest.raises(ValueError, match="connect_timeout"):
        aio.Connection("127.0.0.1:1", connect_timeout=0)


def test_joining_a_group_on_a_dead_node_is_a_ringq_error() -> None:
    (address,) = _dead_addresses(1)
    with pytest.raises(errors.Unavailable):
        asyncio.run(GroupMembership.join(address, "g", timeout=5))


# --------------------------------------------------------------------------- nodes that answer


class _FakeQueueService:
    """Answers QueueStatus with UNAVAILABLE `refusals` times (a node whose queue has no master yet), then
    with a status naming itself."""

    def __init__(self, name: str, refusals: int) -> None:
        self.name = name
        self.refusals = refusals
        self.calls = 0

    async def QueueStatus(self, request: Any, context: Any) -> queue_pb2.QueueStatusResponse:
        self.calls += 1
        if self.calls <= self.refusals:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: the queue has no master yet, retry")
        return queue_pb2.QueueStatusResponse(queue=queue_pb2.QueueInfo(queue=request.queue, master_node=self.name))


@contextlib.asynccontextmanager
async def _serve(services: list[_FakeQueueService]) -> AsyncIterator[list[str]]:
    servers, addresses = [], []
    for service in services:
        server = grpc.aio.server()
        status = grpc.unary_unary_rpc_method_handler(
            service.QueueStatus,
            request_deserializer=queue_pb2.QueueStatusRequest.FromString,
            response_serializer=queue_pb2.QueueStatusResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("ringq.v1.QueueService", {"QueueStatus": status}),)
        )
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    try:
        yield addresses
    finally:
        for server in servers:
            await server.stop(None)


def test_unavailable_from_one_node_is_a_failover_to_another() -> None:
    async def scenario() -> None:
        services = [_FakeQueueService("a", refusals=1_000), _FakeQueueService("b", refusals=0)]
        async with _serve(services) as addresses, aio.Connection(addresses, retry_for=10) as connection:
            status = await connection.queue_status("q")
            assert status.master_node == "b"
            assert services[0].calls == 1, "the first address first (the list is a preference), then the next node"

    asyncio.run(scenario())


def test_a_node_that_refuses_for_a_while_is_retried() -> None:
    async def scenario() -> None:
        async with _serve([_FakeQueueService("a", refusals=3)]) as addresses, aio.Connection(addresses) as connection:
            assert (await connection.queue_status("q")).master_node == "a"

    asyncio.run(scenario())


def test_a_cluster_that_keeps_answering_unavailable_ends_in_unavailable_naming_each_node() -> None:
    async def scenario() -> errors.Unavailable:
        services = [_FakeQueueService(name, refusals=1_000) for name in ("a", "b")]
        async with _serve(services) as addresses:
            async with aio.Connection(addresses, retry_for=1.0) as connection:
                with pytest.raises(errors.Unavailable) as failed:
                    await connection.queue_status("q")
            error = failed.value
            assert not isinstance(error, errors.ConnectionFailed), "the nodes answered"
            assert error.addresses == addresses
            assert "retry" in error.attempts[addresses[0]] and "retry" in error.attempts[addresses[1]]
            assert "\n" not in str(error)
            return error

    asyncio.run(scenario())


def test_a_failed_call_is_retried_every_50_ms_for_half_a_second_then_backs_off_to_a_second() -> None:
    """A failover takes tens of milliseconds (issue 13, W3): a client that waited 50, 100, 200 ms ... after
    its first failures found the new master late. The waits tenacity gives, attempt by attempt."""

    async def waits() -> list[float]:
        connection = aio.Connection(["127.0.0.1:1"], retry_for=60)
        try:
            policy = connection.retrying()
            out = []
            for attempt in range(1, 18):
                state = type("State", (), {"attempt_number": attempt, "outcome": None})()
                out.append(round(policy.wait(state), 3))
            return out
        finally:
            await connection.close()

    assert asyncio.run(waits()) == [0.05] * 10 + [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
