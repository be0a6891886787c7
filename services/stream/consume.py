"""A stream's consume stream on a node: the consume list read head first, group after group.

Responsible for: following the stream's consume list for one consumer. For the head group it serves the
group where its master runs (here, or relayed once to the master's node, acknowledgements included);
when the group holds nothing more and is not the send group, it seals the group's generation here
(gates.py), waits for that generation's batches in flight, checks once more that nothing is left, and
reports the group drained to the coordinator, which takes it off the consume list; then it goes on with
the next head. With no head (nothing to read) or a head none of whose replicas can be reached, it says
why (`waiting`) and waits; it never reads a later group first.

Guarantees: deliveries go out in stream order (one group at a time, each in queue order); a group is
reported drained only with nothing left in it and nothing more able to arrive (sealed, in-flight batches
done); the consumer's fencing token is checked when the call starts and again at least every
TOKEN_RECHECK_S, and a stale one ends the call FAILED_PRECONDITION; deliveries not acknowledged when the
call ends go back to their group and come again, flagged redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from ringq.internal.v1 import coordinator_pb2
from ringq.v1 import stream_pb2
from services.access import Operation
from services.queue.master import Delivery, QueueError, Settlement
from services.queue.replica import QueueReplica
from services.queue.service import _ReadyBatches
from services.stream.fencing import CONSUMER, StaleToken, lease_name
from services.stream.publish import highest_stored, stream_seq
from services.stream.shell import Context, StreamShell, abort, relayed, stream_names

DEFAULT_PREFETCH = 100
MAX_PREFETCH = 10_000
POLL_S = 0.1  # how often an empty head, or a stalled one, is looked at again
TOKEN_RECHECK_S = 0.5
# The client half-closed and its acks are settled: the group's reading ends, and so does the call.
_CLIENT_DONE = stream_pb2.ConsumeStreamResponse(waiting="the consumer closed")


class _Ended(Exception):
    """The call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _Acks:
    """Acknowledgements from the client, routed to the group being read (others are dropped: a group
    is left only once everything in it was acknowledged)."""

    def __init__(self) -> None:
        self.group = ""
        self.sink: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self.client_done = asyncio.Event()

    def route(self, acks: list[stream_pb2.StreamAck]) -> None:
        tags = [a.delivery_tag for a in acks if a.group == self.group]
        if tags:
            self.sink.put_nowait(tags)

    def switch(self, group: str) -> None:
        self.group = group
        self.sink = asyncio.Queue()
        if self.client_done.is_set():
            self.sink.put_nowait(None)


def delivery(group: str, ready: Delivery) -> stream_pb2.StreamDelivery:
    message = ready.message
    return stream_pb2.StreamDelivery(
        stream_seq=stream_seq(message.publisher, message.publisher_seq),
        body=message.body,
        headers=message.headers,
        group=group,
        delivery_tag=ready.delivery_tag,
        redelivered=ready.redelivered,
    )


async def serve(
    shell: StreamShell, requests: AsyncIterator[stream_pb2.ConsumeStreamRequest], context: Context
) -> AsyncIterator[stream_pb2.ConsumeStreamResponse]:
    first = await anext(aiter(requests), None)
    if first is None:
        return
    principal = await shell.allow(context, first.stream, Operation.READ)
    if first.acks:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the first consume request attaches: no acks")
    if first.prefetch > MAX_PREFETCH:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"prefetch must be at most {MAX_PREFETCH}")
    await shell.fence(context, first.stream, CONSUMER, first.fencing_token)
    vhost, name = stream_names(first.stream)
    lease = lease_name(vhost, name, CONSUMER)
    acks = _Acks()

    async def read_acks() -> None:
        async for request in requests:
            acks.route(list(request.acks))
        acks.client_done.set()  # half-closed: its acks are settled, then the call ends (OK)
        acks.sink.put_nowait(None)

    reader = asyncio.ensure_future(read_acks())
    said = ""
    try:
        while not acks.client_done.is_set():
            record = await shell.record(context, first.stream)
            head = record.consume_list[0] if record.consume_list else ""
            if first.group and head != first.group:
                await abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"group {first.group} is not the head of stream {name!r}'s consume list (the head is "
                    f"{head or 'none: nothing to consume'}); consumers read the head only",
                )
            waiting = ""
            source: AsyncIterator[stream_pb2.ConsumeStreamResponse] | None = None
            if not head:
                waiting = "the stream holds nothing to consume"
            else:
                acks.switch(head)
                queue = await shell.group_queue(vhost, head)
                replica = shell.local_master(vhost, head)
                if replica is not None:
                    generation = record.generations.get(head, 0)
                    source = _read_group(shell, replica, head, generation, first, lease, acks, record.consumed_through)
                elif queue is not None and queue.master and not relayed(context):
                    stub = await shell.stub_to(queue.master, principal)
                    if stub is not None:
                        source = _relay_group(stub, head, first, acks)
                if source is None:
                    waiting = (
                        f"stalled: group {head}, the head of the consume list, has no replica that can be reached; "
                        "waiting for one to come back with its log (consumers never skip ahead)"
                    )
            if source is None:
                if relayed(context):
                    await abort(context, grpc.StatusCode.UNAVAILABLE, f"group {head}: not served here; retry")
                if waiting != said:
                    said = waiting
                    yield stream_pb2.ConsumeStreamResponse(waiting=waiting)
                await asyncio.sleep(POLL_S)
                await shell.fence(context, first.stream, CONSUMER, first.fencing_token)
                continue
            said = ""
            try:
                async for response in source:
                    yield response
                    if response.group_drained and first.group:
                        return  # a call for one group ends with it
            except _Ended as ended:
                if ended.code != grpc.StatusCode.UNAVAILABLE or relayed(context):
                    await abort(context, ended.code, ended.details)
                if queue is not None and queue.master and queue.master != shell.node_id:
                    shell.forget_address(queue.master)
                said = f"group {head}: {ended.details}; resuming"
                yield stream_pb2.ConsumeStreamResponse(waiting=said)
                await asyncio.sleep(POLL_S)
    finally:
        reader.cancel()


async def _read_group(
    shell: StreamShell,
    replica: QueueReplica,
    group: str,
    generation: int,
    first: stream_pb2.ConsumeStreamRequest,
    lease: str,
    acks: _Acks,
    consumed_through: int,
) -> AsyncIterator[stream_pb2.ConsumeStreamResponse]:
    """Deliver `group` from its master here until it is drained (then one response naming it). A message
    at or below `consumed_through` is a copy of one consumed in an earlier group: acknowledged here, not
    delivered (stream_lists.py rule 5)."""
    vhost, name = stream_names(first.stream)
    key = (vhost, group)
    tag = f"stream.{uuid.uuid4().hex[:12]}"
    try:
        consumer = await replica.consume(tag, first.prefetch or DEFAULT_PREFETCH, 0)
    except QueueError as error:
        raise _Ended(grpc.StatusCode.UNAVAILABLE, str(error)) from None
    events: asyncio.Queue[stream_pb2.ConsumeStreamResponse | _Ended] = asyncio.Queue()

    async def forward_deliveries() -> None:
        batches = _ReadyBatches(consumer)
        while batch := await batches.next():
            out = [delivery(group, d) for d in batch]
            copies = [d.delivery_tag for d in out if d.stream_seq <= consumed_through]
            if copies:
                replica.settle_now(tag, [Settlement(t, False, "ack") for t in copies])
                out = [d for d in out if d.stream_seq > consumed_through]
            if out or copies:
                events.put_nowait(stream_pb2.ConsumeStreamResponse(deliveries=out, copies_dropped=len(copies)))
        events.put_nowait(_Ended(grpc.StatusCode.UNAVAILABLE, "its master stopped serving it"))

    async def settle() -> None:
        while (tags := await acks.sink.get()) is not None:
            # An unknown tag (an ack of an earlier call's delivery, which came again) changes nothing.
            replica.settle_now(tag, [Settlement(t, False, "ack") for t in tags])
        events.put_nowait(_CLIENT_DONE)

    async def watch_drain() -> None:
        checked_token = time.monotonic()
        while True:
            await asyncio.sleep(POLL_S)
            if time.monotonic() - checked_token >= TOKEN_RECHECK_S:
                try:
                    await shell.fencing.check(lease, first.fencing_token)
                except StaleToken as stale:
                    events.put_nowait(_Ended(grpc.StatusCode.FAILED_PRECONDITION, f"stream {name!r}: {stale}"))
                    return
                checked_token = time.monotonic()
            if await _drained(shell, replica, key, name, group, generation):
                events.put_nowait(stream_pb2.ConsumeStreamResponse(group_drained=group))
                return

    tasks = [asyncio.ensure_future(work()) for work in (forward_deliveries, settle, watch_drain)]
    try:
        while True:
            event = await events.get()
            if isinstance(event, _Ended):
                raise event
            if event is _CLIENT_DONE:
                return
            yield event
            if event.group_drained:
                return
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await replica.cancel(tag)


async def _drained(
    shell: StreamShell, replica: QueueReplica, key: tuple[str, str], name: str, group: str, generation: int
) -> bool:
    """True once `group` is reported drained (sealed, empty, acknowledged, and not the send group)."""
    master = replica.master
    if master is None or master.contents.depth:
        return False
    vhost = key[0]
    record = await shell.read_record(vhost, name)
    if record is None:
        return False
    if not record.consume_list or record.consume_list[0] != group:
        return group not in record.consume_list  # drained already (by an earlier reader)
    if record.send_list and record.send_list[0] == group:
        return False  # it still takes sends
    generation = record.generations.get(group, generation)
    await shell.gates.seal(key, generation)
    if master.contents.depth:
        return False  # a batch sent before the seal landed: read it first
    report = coordinator_pb2.ReportGroupDrainedRequest(
        vhost=vhost,
        name=name,
        group=group,
        generation=generation,
        consumed_through=highest_stored(master.contents.publishers),
    )
    try:
        after = await shell.coordinator.call(lambda stub: stub.ReportGroupDrained, report)
    except grpc.aio.AioRpcError:
        return False
    return group not in after.stream.consume_list


async def _relay_group(
    stub: Any, group: str, first: stream_pb2.ConsumeStreamRequest, acks: _Acks
) -> AsyncIterator[stream_pb2.ConsumeStreamResponse]:
    """`group` read through its master's node, acknowledgements relayed, until it is drained."""
    call = stub.ConsumeStream()
    attach = stream_pb2.ConsumeStreamRequest()
    attach.CopyFrom(first)
    attach.group = group

    async def pump() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await call.write(attach)
            while (tags := await acks.sink.get()) is not None:
                settled = [stream_pb2.StreamAck(group=group, delivery_tag=t) for t in tags]
                await call.write(stream_pb2.ConsumeStreamRequest(acks=settled))
            await call.done_writing()

    pumping = asyncio.ensure_future(pump())
    try:
        async for response in call:
            if response.waiting and not response.deliveries and not response.copies_dropped:
                continue  # the master's node waits: this node says its own waiting
            yield response
            if response.group_drained:
                return
        if acks.client_done.is_set():
            return  # we half-closed it, as the client did ours
        raise _Ended(grpc.StatusCode.UNAVAILABLE, "its master's node ended the stream")
    except grpc.aio.AioRpcError as error:
        code = error.code()
        if code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
            code = grpc.StatusCode.UNAVAILABLE
        raise _Ended(code, error.details() or "its master's node failed us") from None
    finally:
        pumping.cancel()
        call.cancel()
