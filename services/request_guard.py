"""Malformed requests refused in one place, for every gRPC service a process serves.

Responsible for: answering a request that does not parse as its method's protobuf message with
INVALID_ARGUMENT ("malformed <Message>: <why>"), for unary requests and for every message of a
request stream (read through the iterator or through `context.read()`), and logging such refusals at
most once per client host per LOG_INTERVAL_SECONDS, with a count of the ones not logged.
Guarantees: a handler never sees a request that failed to parse; a fuzzer sending garbage gets a
status naming the problem instead of UNKNOWN, and cannot fill the log; requests that parse are
passed on untouched (the guard adds one isinstance check per message).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger("ringq.requests")

LOG_INTERVAL_SECONDS = 10.0
# Concurrent streams (calls) one client connection may have open on a ringq server (HTTP/2's
# SETTINGS_MAX_CONCURRENT_STREAMS): a client opening more waits for one to end, so one connection
# cannot pile up unbounded per-call state on a node.
MAX_STREAMS_PER_CONNECTION = 1024
STREAM_LIMIT_OPTION = ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)
# gRPC binds with SO_REUSEPORT unless told not to: a second process on a port already taken would start,
# say it listens, and take a share of the first one's clients (two coordinators with different databases
# answered on one port). Without it, the second one fails to bind and says so.
EXCLUSIVE_PORT_OPTION = ("grpc.so_reuseport", 0)
SERVER_OPTIONS = [STREAM_LIMIT_OPTION, EXCLUSIVE_PORT_OPTION]
# The standard health service (services/health.py) answers anyone on every port, like RabbitMQ's health
# checks: it reveals only SERVING or NOT_SERVING. `admit` is not asked for these methods.
HEALTH_METHODS = frozenset(f"/grpc.health.v1.Health/{method}" for method in ("Check", "List", "Watch"))
_MAX_HOSTS_REMEMBERED = 1024


class Refused(Exception):
    """A request to answer with `code` and `details`, raised where there is no servicer context to abort."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True)
class _Malformed:
    """What a request that failed to parse turns into: never handed to a handler."""

    problem: str


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_note(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as error:  # protobuf's DecodeError, or anything a parser may raise on garbage
            return _Malformed(f"{error}".strip() or type(error).__name__)

    return parse_or_note


class _RefusalLog:
    """One log line per client host per interval; the rest are counted and reported with the next."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._hosts: dict[str, tuple[float, int]] = {}  # host -> (last logged at, refusals not logged)

    def note(self, peer: str, method: str, problem: str) -> None:
        host = peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer
        now = self.clock()
        last, unlogged = self._hosts.get(host, (float("-inf"), 0))
        if now - last < LOG_INTERVAL_SECONDS:
            self._hosts[host] = (last, unlogged + 1)
            return
        if len(self._hosts) >= _MAX_HOSTS_REMEMBERED:
            self._hosts.clear()
        self._hosts[host] = (now, 0)
        more = f" ({unlogged} more refused since the last line)" if unlogged else ""
        log.warning("refused a malformed request to %s from %s: %s%s", method, host, problem, more)


class _GuardedContext:
    """The handler's context, whose read() refuses a malformed message like the iterator does."""

    def __init__(self, context: Any, refuse: Callable[[Any, _Malformed], Awaitable[None]]) -> None:
        self._context = context
        self._refuse = refuse

    async def read(self) -> Any:
        message = await self._context.read()
        if isinstance(message, _Malformed):
            await self._refuse(self._context, message)
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class RequestGuard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # not generic at run time
    """The server interceptor: `grpc.aio.server(interceptors=[RequestGuard()])`.

    `admit`, if given, says why a call may not be served at all (e.g. a cluster port called without a
    member certificate: services/tls.py); such calls get PERMISSION_DENIED before any handler runs. The
    health service (HEALTH_METHODS) is admitted whoever calls.
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, admit: Callable[[Any], str | None] | None = None
    ) -> None:
        self._log = _RefusalLog(clock)
        self._admit = admit

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        parse = _tolerant(handler.request_deserializer)
        serialize = handler.response_serializer

        admit = self._admit if method not in HEALTH_METHODS else None

        async def gate(context: Any, request: Any) -> None:
            """Refuse a caller not admitted, then a malformed first request."""
            if admit is not None and (problem := admit(context)) is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
            if isinstance(request, _Malformed):
                await refuse(context, request)

        async def refuse(context: Any, malformed: _Malformed) -> None:
            self._log.note(context.peer(), method, malformed.problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {malformed.problem}"[:1024])

        def guarded_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async def checked() -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, _Malformed):
                        await refuse(context, request)
                    yield request

            return checked()

        if handler.unary_unary is not None:
            unary_unary: Any = handler.unary_unary

            async def unary_unary_behaviour(request: Any, context: Any) -> Any:
                await gate(context, request)
                return await unary_unary(request, _GuardedContext(context, refuse))

            return grpc.unary_unary_rpc_method_handler(unary_unary_behaviour, parse, serialize)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, lambda request, context: request, refuse, gate), parse, serialize
            )
        if handler.stream_unary is not None:
            stream_unary: Any = handler.stream_unary

            async def stream_unary_behaviour(requests: AsyncIterator[Any], context: Any) -> Any:
                await gate(context, None)
                return await stream_unary(guarded_stream(requests, context), _GuardedContext(context, refuse))

            return grpc.stream_unary_rpc_method_handler(stream_unary_behaviour, parse, serialize)
        assert handler.stream_stream is not None
        return grpc.stream_stream_rpc_method_handler(
            _streaming(handler.stream_stream, guarded_stream, refuse, gate), parse, serialize
        )


def _streaming(
    behaviour: Callable[..., Any],
    guard_request: Callable[[Any, Any], Any],
    refuse: Callable[[Any, _Malformed], Awaitable[None]],
    gate: Callable[[Any, Any], Awaitable[None]],
) -> Callable[..., Any]:
    """A response-streaming behaviour wrapped alike whether it yields its responses (an async generator)
    or writes them with context.write() (a coroutine): gRPC treats the two differently."""
    if inspect.isasyncgenfunction(behaviour):

        async def yielding(request: Any, context: Any) -> AsyncIterator[Any]:
            await gate(context, request)
            async for response in behaviour(guard_request(request, context), _GuardedContext(context, refuse)):
                yield response

        return yielding

    async def writing(request: Any, context: Any) -> None:
        await gate(context, request)
        await behaviour(guard_request(request, context), _GuardedContext(context, refuse))

    return writing
