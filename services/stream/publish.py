"""A stream's publish stream on a node: batches fenced, then appended to the stream's send group.

Responsible for: checking each batch (one stream per call, at most MAX_MESSAGES messages, stream_seq
strictly increasing and carrying the producer's fencing token in its high 32 bits), the fencing check of
every batch, asking the coordinator for the send group once per call (stored in the consume list before
it is answered), and appending the batches to that group where its master runs: here, or by relaying
the whole call to the master's node (once; a relayed call is served or refused there).

Guarantees: a batch is answered only once both replicas of the group hold it (the group refuses sends
without its synchronised mirror, replica_core.py); a batch with a stale or missing token is refused with
FAILED_PRECONDITION and nothing of it is stored; batches are appended in the order they came; once the
group has left the send list (seen within SEND_LIST_CHECK_S) or its generation is sealed here (gates.py:
consumers are about to report it drained) no batch of it is appended any more: the call ends UNAVAILABLE
and the producer resends to the next send group. In the
queue, a message's publisher is "stream:TOKEN" and its seq the low 32 bits of its stream_seq, so a
producer's resend to the same group is stored once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc

from ringq.internal.v1 import coordinator_pb2
from ringq.v1 import stream_pb2
from services.access import Operation
from services.queue.contents import PublisherSeqs
from services.queue.master import Publish as Outgoing
from services.queue.master import PublishOutcome, QueueError
from services.queue.replica import QueueReplica
from services.queue.service import MAX_BODY_BYTES, MAX_HEADER_BYTES
from services.stream.fencing import PRODUCER, StaleToken, lease_name
from services.stream.shell import Context, StreamShell, abort, relayed, stream_names

MAX_MESSAGES = 1000
PUBLISHER_PREFIX = "stream:"
RESERVED_HEADER_PREFIX = "x-stream-"
TOKEN_SHIFT = 32
# How often a publish stream looks at the send list: a group struck from it (a replica lost, even if
# replaced since) takes no batch after the next look; the producer resends to the new head.
SEND_LIST_CHECK_S = 0.2


def batch_problem(request: stream_pb2.PublishStreamRequest, after_seq: int) -> str | None:
    """What is wrong with a batch (None if nothing), given the last stream_seq before it in the call."""
    if not request.messages:
        return "messages must not be empty"
    if len(request.messages) > MAX_MESSAGES:
        return f"a batch carries {len(request.messages)} messages; at most {MAX_MESSAGES} are allowed"
    previous = after_seq
    for index, message in enumerate(request.messages):
        if message.stream_seq >> TOKEN_SHIFT != request.fencing_token:
            return (
                f"messages[{index}].stream_seq {message.stream_seq} does not carry the fencing token "
                f"{request.fencing_token} in its high 32 bits"
            )
        if message.stream_seq & 0xFFFFFFFF == 0:
            return f"messages[{index}].stream_seq counts a producer's messages from 1, not 0"
        if message.stream_seq <= previous:
            return f"messages[{index}].stream_seq {message.stream_seq} is not above {previous}: it must increase"
        previous = message.stream_seq
        if len(message.body) > MAX_BODY_BYTES:
            return f"messages[{index}].body has {len(message.body)} bytes; at most {MAX_BODY_BYTES} are allowed"
        header_bytes = sum(len(k.encode()) + len(v.encode()) for k, v in message.headers.items())
        if header_bytes > MAX_HEADER_BYTES:
            return f"messages[{index}].headers have {header_bytes} bytes; at most {MAX_HEADER_BYTES} are allowed"
        if any(k.startswith(RESERVED_HEADER_PREFIX) for k in message.headers):
            return f"messages[{index}].headers: names starting {RESERVED_HEADER_PREFIX!r} are reserved"
    return None


def outgoing(request: stream_pb2.PublishStreamRequest) -> list[Outgoing]:
    """The batch as the group's queue keeps it: publisher "stream:TOKEN", seq the low 32 bits of the
    stream_seq (which the two give back: `stream_seq`), so nothing is added to a message."""
    publisher = f"{PUBLISHER_PREFIX}{request.fencing_token}"
    return [
        Outgoing(m.body, publisher, m.stream_seq & 0xFFFFFFFF, m.persistent, dict(m.headers) if m.headers else {})
        for m in request.messages
    ]


def highest_stored(publishers: Mapping[str, PublisherSeqs]) -> int:
    """The highest stream_seq a group's queue ever took (its publisher seqs outlive its messages)."""
    highest = 0
    for publisher, seqs in publishers.items():
        if publisher.startswith(PUBLISHER_PREFIX):
            highest = max(highest, stream_seq(publisher, max(seqs.above, default=seqs.through)))
    return highest


def stream_seq(publisher: str, publisher_seq: int) -> int:
    """The stream_seq of a message the group's queue keeps as published by `publisher` with `publisher_seq`
    (0 if it was not published to a stream)."""
    if not publisher.startswith(PUBLISHER_PREFIX):
        return 0
    return (int(publisher[len(PUBLISHER_PREFIX) :]) << TOKEN_SHIFT) | publisher_seq


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


async def serve(
    shell: StreamShell, requests: AsyncIterator[stream_pb2.PublishStreamRequest], context: Context
) -> AsyncIterator[stream_pb2.PublishStreamResponse]:
    first = await anext(aiter(requests), None)
    if first is None:
        return
    principal = await shell.allow(context, first.stream, Operation.WRITE)
    await shell.fence(context, first.stream, PRODUCER, first.fencing_token)
    vhost, name = stream_names(first.stream)
    picked = await shell.coordinator_call(
        context, lambda stub: stub.PickSendGroup, coordinator_pb2.PickSendGroupRequest(vhost=vhost, name=name)
    )
    group = picked.group
    if not group:
        down = ", ".join(picked.stream.down) or "none"
        await abort(
            context,
            grpc.StatusCode.UNAVAILABLE,
            f"stream {name!r}: no group can take sends now (groups with a replica missing: {down}; the others "
            "still hold messages consumers have not read); retry",
        )
    replica = shell.local_master(vhost, group)
    if replica is None:
        async for response in _relay(shell, principal, vhost, group, first, requests, context):
            yield response
        return
    generation = picked.stream.generations.get(group, 0)
    async for response in _append(shell, replica, (vhost, group), generation, first, requests, context):
        yield response


async def _relay(
    shell: StreamShell,
    principal: Any,
    vhost: str,
    group: str,
    first: stream_pb2.PublishStreamRequest,
    requests: AsyncIterator[stream_pb2.PublishStreamRequest],
    context: Context,
) -> AsyncIterator[stream_pb2.PublishStreamResponse]:
    queue = await shell.group_queue(vhost, group)
    stub = await shell.stub_to(queue.master, principal) if queue is not None and not relayed(context) else None
    if stub is None:
        await abort(context, grpc.StatusCode.UNAVAILABLE, f"group {group}: its master is moving; retry")
    call = stub.PublishStream()

    async def pump() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await call.write(first)
            async for request in requests:
                await call.write(request)
            await call.done_writing()

    pumping = asyncio.ensure_future(pump())
    try:
        async for response in call:
            yield response
    except grpc.aio.AioRpcError as error:
        code = error.code()
        if code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            code = grpc.StatusCode.UNAVAILABLE
            if queue is not None:
                shell.forget_address(queue.master)
        await abort(context, code, error.details() or f"group {group}: its master's node failed us; retry")
    finally:
        pumping.cancel()
        call.cancel()


async def _append(
    shell: StreamShell,
    replica: QueueReplica,
    key: tuple[str, str],
    generation: int,
    first: stream_pb2.PublishStreamRequest,
    requests: AsyncIterator[stream_pb2.PublishStreamRequest],
    context: Context,
) -> AsyncIterator[stream_pb2.PublishStreamResponse]:
    vhost, group = key
    _, name = stream_names(first.stream)
    lease = lease_name(vhost, name, PRODUCER)
    pending: asyncio.Queue[asyncio.Future[stream_pb2.PublishStreamResponse] | None] = asyncio.Queue()

    def failed(code: grpc.StatusCode, details: str) -> None:
        future: asyncio.Future[stream_pb2.PublishStreamResponse] = asyncio.get_running_loop().create_future()
        future.set_exception(_Refusal(code, details))
        pending.put_nowait(future)

    async def answer(
        request: stream_pb2.PublishStreamRequest, confirmed: asyncio.Future[list[PublishOutcome]]
    ) -> stream_pb2.PublishStreamResponse:
        try:
            outcomes = await confirmed
        except QueueError as error:
            raise _Refusal(getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNAVAILABLE), str(error)) from None
        except ConnectionAbortedError as error:
            raise _Refusal(
                grpc.StatusCode.UNAVAILABLE, f"group {group}: its master went away ({error}); resend"
            ) from None
        if PublishOutcome.REJECTED in outcomes:
            raise _Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"group {group} is full (its length limit): the batch from stream_seq "
                f"{request.messages[0].stream_seq} was not stored; consumers must catch up",
            )
        return stream_pb2.PublishStreamResponse(confirmed_through=request.messages[-1].stream_seq, group=group)

    async def read() -> None:
        last_seq = 0
        try:
            async for request in _chain(first, requests):
                problem = batch_problem(request, last_seq)
                if not problem and request.stream != first.stream:
                    problem = "one publish call carries one stream: stream differs from the first request's"
                if problem:
                    failed(grpc.StatusCode.INVALID_ARGUMENT, problem)
                    return
                await replica.room_to_publish()  # the publish window (services/queue/replica_core.py)
                if not shell.fencing.current(lease, request.fencing_token):
                    try:
                        await shell.fencing.check(lease, request.fencing_token)
                    except StaleToken as stale:
                        failed(grpc.StatusCode.FAILED_PRECONDITION, f"stream {name!r}: {stale}")
                        return
                # From here to publish_in_order: one event loop step (no await), so the checks still hold.
                if not shell.fencing.current(lease, request.fencing_token):
                    failed(grpc.StatusCode.FAILED_PRECONDITION, f"stream {name!r}: the fencing token expired")
                    return
                if left_send_list.is_set():
                    failed(
                        grpc.StatusCode.UNAVAILABLE,
                        f"group {group} left the send list (a replica was lost); resend to the stream",
                    )
                    return
                if not shell.gates.open_for(key, generation):
                    failed(
                        grpc.StatusCode.UNAVAILABLE,
                        f"group {group} takes no more sends (it left the send list and is being drained); resend",
                    )
                    return
                if not replica.is_master:
                    failed(grpc.StatusCode.UNAVAILABLE, f"group {group}: its master moved; resend")
                    return
                try:
                    confirmed = replica.publish_in_order(outgoing(request))
                except QueueError as error:
                    failed(getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNAVAILABLE), str(error))
                    return
                shell.gates.batch_started(key, generation)
                confirmed.add_done_callback(lambda _: shell.gates.batch_ended(key, generation))
                last_seq = request.messages[-1].stream_seq
                pending.put_nowait(asyncio.ensure_future(answer(request, confirmed)))
        finally:
            pending.put_nowait(None)

    async def follow_send_list() -> None:
        """Note when the group stops being the send list's head (struck, even if whole again since)."""
        while True:
            await asyncio.sleep(SEND_LIST_CHECK_S)
            record = await shell.read_record(vhost, name)
            if record is None:
                continue
            if not record.send_list or record.send_list[0] != group or record.generations.get(group) != generation:
                left_send_list.set()
                return

    left_send_list = asyncio.Event()
    follower = asyncio.ensure_future(follow_send_list())
    reader = asyncio.ensure_future(read())
    try:
        while (item := await pending.get()) is not None:
            try:
                yield await item
            except _Refusal as refusal:
                await abort(context, refusal.code, refusal.details)
    finally:
        reader.cancel()
        follower.cancel()
        while not pending.empty():
            leftover = pending.get_nowait()
            if leftover is not None:
                leftover.cancel()


async def _chain(
    first: stream_pb2.PublishStreamRequest, rest: AsyncIterator[stream_pb2.PublishStreamRequest]
) -> AsyncIterator[stream_pb2.PublishStreamRequest]:
    yield first
    async for request in rest:
        yield request
