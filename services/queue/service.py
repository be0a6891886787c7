"""QueueService on a node: mirrored queues for applications.

Responsible for: validating client requests, serving those for queues whose
master runs on this node, and forwarding the others to the master's node
(unary calls relayed, publish and consume streams proxied), so any node
accepts any call (active-active front, single master per queue). Errors are
gRPC statuses with a clear message: NOT_FOUND for an unknown queue,
INVALID_ARGUMENT for bad input, FAILED_PRECONDITION for a redeclaration that
differs or an unknown delivery tag, UNAVAILABLE (retry) while a queue has no
master, e.g. during a promotion.
Guarantees: a publish stream answers its batches in order; each message is
answered exactly once, after the master's replicas hold it; a consume stream
sends its deliveries in order, each response carrying those ready when it is
sent (it never waits for more to fill one); a consume stream that ends
(client gone) cancels its consumer, requeuing what it had not acknowledged;
a consume stream the client half-closes has every settlement it carried
applied before the consumer is cancelled and the stream ends with OK.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc

from ringq import tracing
from ringq.names import name_problem
from ringq.security import with_metadata
from ringq.v1 import queue_pb2, queue_pb2_grpc
from services.access import Operation
from services.access_guard import OPEN, AccessGuard, Principal, scoped_publisher
from services.coordinator import queue_arguments
from services.coordinator.client import CoordinatorClient
from services.coordinator.metadata import QueueRecord
from services.coordinator.policies import MAX_TTL_MS
from services.coordinator.stream_groups import STREAM_QUEUE_PREFIX, is_stream_group
from services.event_waits import event_or_timeout
from services.queue.manager import QueueManager
from services.queue.master import Delivery, PublishOutcome, QueueError, Settlement
from services.queue.master import Publish as Outgoing
from services.queue.replica import QueueReplica
from services.queue.replica_host import Consumer
from services.request_guard import Refused

MAX_BODY_BYTES = 16 * 1024 * 1024
# One PublishRequest carries at most this many messages (a batch; larger ones are several requests),
# and each message at most MAX_HEADER_BYTES of header names and values together.
MAX_MESSAGES_PER_PUBLISH = 10_000
MAX_HEADER_BYTES = 64 * 1024
# A publisher id is kept with every message of its publisher: an AMQP short string at most.
MAX_PUBLISHER_BYTES = 255
# A Consume response carries the deliveries ready when it is sent: at most this many, of at most this
# many body bytes in all unless it is a single delivery (a larger one goes alone, as it did before
# responses carried batches), so a batch is never larger than one delivery may be.
MAX_DELIVERIES_PER_RESPONSE = 256
MAX_RESPONSE_BODY_BYTES = 1024 * 1024
# How long a call waits for a master replica of this node that is starting (a queue just declared) to serve.
MASTER_STARTING_WAIT_S = 5.0
# How long a call for a queue whose master's node is known dead (its port refuses) waits here for the records
# to name the promoted master, instead of sending the client away to try another node later.
FAILOVER_WAIT_S = 2.0
_Context = grpc.aio.ServicerContext[Any, Any]
_Answer = TypeVar("_Answer")
_T = TypeVar("_T")
_OUTCOMES = {
    PublishOutcome.ACCEPTED: queue_pb2.PUBLISH_OUTCOME_CONFIRMED,
    PublishOutcome.DUPLICATE: queue_pb2.PUBLISH_OUTCOME_DUPLICATE,
    PublishOutcome.REJECTED: queue_pb2.PUBLISH_OUTCOME_REJECTED,
}
_STREAM_GROUP_REFUSAL = (
    "queue {!r} is a broker group of an ordered stream: publish to and consume the stream with StreamService"
)
_SETTLE = {
    queue_pb2.SETTLE_KIND_ACK: "ack",
    queue_pb2.SETTLE_KIND_REQUEUE: "requeue",
    queue_pb2.SETTLE_KIND_REJECT: "reject",
}


def _trace_forward(request: queue_pb2.PublishRequest, node: str) -> None:
    for message in request.messages:
        if tracing.TRACEPARENT in message.headers:
            attributes = {
                "ringq.queue": request.queue.queue,
                "ringq.node": node,
                "ringq.publisher": request.publisher,
                "ringq.seq": message.seq,
            }
            tracing.event_span("ringq.forward", message.headers, attributes)


def _settlement(settlement: queue_pb2.Settlement) -> Settlement:
    kind = _SETTLE.get(settlement.kind)
    if kind is None:
        raise QueueError("INVALID_ARGUMENT", "a settlement's kind must be ACK, REQUEUE or REJECT")
    return Settlement(settlement.delivery_tag, settlement.multiple, kind)


def _vhost(ref: queue_pb2.QueueRef) -> str:
    return ref.vhost or "/"


def _ref_problem(ref: queue_pb2.QueueRef) -> str:
    """Why `ref` names no queue (ringq.names), or "" if it does."""
    for field, value in (("vhost", _vhost(ref)), ("queue", ref.queue)):
        problem = name_problem(value)
        if problem is not None:
            return f"{field} {problem}"
    return ""


def _fill_delivery(out: queue_pb2.QueueDelivery, delivery: Delivery) -> None:
    """Set `out`'s fields from `delivery` in place, only those that differ from their defaults: one per
    delivered message; building a QueueDelivery from keyword arguments (headers copied through the
    Mapping protocol) and copying it into the response took four times as long."""
    message = delivery.message
    out.consumer_tag = delivery.consumer
    out.delivery_tag = delivery.delivery_tag
    out.body = message.body
    if delivery.redelivered:
        out.redelivered = True
    out.delivery_count = message.delivery_count
    headers = message.headers
    if headers:
        out.headers.update(headers)
    if message.publisher:
        out.publisher = message.publisher
    if message.publisher_seq:
        out.seq = message.publisher_seq
    out.message_id = message.id


def _consume_response(batch: list[Delivery]) -> queue_pb2.ConsumeResponse:
    response = queue_pb2.ConsumeResponse()
    add = response.deliveries.add
    for delivery in batch:
        _fill_delivery(add(), delivery)
    return response


class _ReadyBatches:
    """A consumer's deliveries taken one Consume response at a time: the first ready one (waited for) and
    whatever else is already queued behind it (never waited for), within the caps of one response. The
    queue holds them a step's run at a time (services/queue/replica_host.py `Consumer`)."""

    def __init__(self, consumer: Consumer) -> None:
        self.deliveries = consumer.deliveries
        self.taken = consumer.taken  # off the queue, not sent yet (cleared when the replica stops)
        self.ended = False  # the end marker (None) was taken

    async def next(self) -> list[Delivery]:
        """The next batch, in delivery order; empty once the end marker is reached (what came before it
        was in earlier batches)."""
        taken = self.taken
        while not taken:
            if self.ended:
                return []
            run = await self.deliveries.get()
            if run is None:
                self.ended = True
                return []
            taken.extend(run)
        first = taken.popleft()
        batch = [first]
        size = len(first.message.body)
        while len(batch) < MAX_DELIVERIES_PER_RESPONSE:
            if not taken:
                if self.ended or self.deliveries.empty():
                    break
                run = self.deliveries.get_nowait()
                if run is None:
                    self.ended = True
                    break
                taken.extend(run)
                continue
            size += len(taken[0].message.body)
            if size > MAX_RESPONSE_BODY_BYTES:
                break  # it opens the next batch
            batch.append(taken.popleft())
        return batch


class QueueServicer(queue_pb2_grpc.QueueServiceServicer):
    """QueueService over this node's QueueManager."""

    def __init__(
        self,
        node_id: str,
        manager: QueueManager,
        coordinator: CoordinatorClient,
        address_of: Callable[[str], Awaitable[str | None]],
        channel_to: Callable[[str, str], grpc.aio.Channel],
        memory_clear: Callable[[], Awaitable[None]] | None = None,
        address: str = "",
        access: AccessGuard = OPEN,
        node_down: Callable[[str], bool] = lambda node: False,
    ) -> None:
        self.node_id = node_id
        # Whether a node is known dead here (this node's link to it found its port refusing connections).
        self.node_down = node_down
        # Who may do what (enforced with TLS): every call is authenticated and authorised first.
        self.access = access
        # Where clients reach this node (QueueInfo.master_address of the queues it masters).
        self.address = address
        # Returns once the node's memory alarm is off: publish streams are read only then.
        self.memory_clear = memory_clear
        self.manager = manager
        self.coordinator = coordinator
        self.address_of = address_of
        self.channel_to = channel_to
        manager.forward_publish = self._forward_dead_letters

    # -------------------------------------------------------------- routing

    async def _record(self, ref: queue_pb2.QueueRef) -> QueueRecord:
        problem = _ref_problem(ref)
        if problem:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            return await self.coordinator.get_queue(_vhost(ref), ref.queue)
        except grpc.aio.AioRpcError as error:
            raise Refused(error.code(), error.details() or "") from None

    async def _find(self, ref: queue_pb2.QueueRef) -> tuple[QueueReplica | None, Any, QueueRecord]:
        """The local master replica, or a stub to the master's node; Refused if neither."""
        local = self.manager.local(_vhost(ref), ref.queue)
        if local is not None and local.is_master:
            return local, None, local.record  # no coordinator round trip on the hot path
        record = await self._record(ref)
        if record.master and record.master != self.node_id and self.node_down(record.master):
            record = await self._after_failover(ref, record)
        if record.master == self.node_id:
            replica = self.manager.local(record.vhost, record.name) or await self.manager.ensure(record)
            if replica is not None and not replica.is_master:
                # A new queue's master serves once it has joined its group and claimed its first term.
                await event_or_timeout(replica.serving, MASTER_STARTING_WAIT_S)
            if replica is None or not replica.is_master:
                raise Refused(grpc.StatusCode.UNAVAILABLE, f"queue {record.name!r}: its master is starting; retry")
            return replica, None, record
        address = await self.address_of(record.master) if record.master else None
        if address is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"queue {record.name!r} has no master now; retry")
        return None, queue_pb2_grpc.QueueServiceStub(self.channel_to(record.master, address)), record

    async def _after_failover(self, ref: queue_pb2.QueueRef, record: QueueRecord) -> QueueRecord:
        """The record's master is on a node known dead: a mirror is being promoted. Wait (FAILOVER_WAIT_S at
        most) for the records to name the new master and route to it. Answering UNAVAILABLE at once sent the
        client to try node after node, 50 ms apart, dead ones included: deliveries resumed 0.18 s after a
        master's SIGKILL where the promotion took 0.06 s."""
        with contextlib.suppress(TimeoutError):
            moved = self.manager.master_moved(record.vhost, record.name, record.master, record.version)
            await asyncio.wait_for(moved, FAILOVER_WAIT_S)
            return await self._record(ref)
        return record

    async def _route(
        self, ref: queue_pb2.QueueRef, context: _Context, operation: Operation, *, stream_group_ok: bool = False
    ) -> tuple[QueueReplica | None, Any, QueueRecord]:
        """The local master or a stub to the master's node (relaying the caller's user), once the caller
        may `operation` the queue; the call is aborted otherwise. (Names are checked where a queue is looked
        up, as before: not again on the hot path of a local master.) A group of an ordered stream is read
        and written through StreamService only (its fencing and lists): refused here unless
        `stream_group_ok` (status and sync)."""
        if not stream_group_ok and is_stream_group(ref.queue):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _STREAM_GROUP_REFUSAL.format(ref.queue))
        principal = await self._allow(context, ref, operation)
        return await self._route_for(principal, ref, context)

    async def _allow(self, context: _Context, ref: queue_pb2.QueueRef, operation: Operation) -> Principal:
        """The call's principal, once it may `operation` the queue `ref` names (as `_permit`); the call is
        aborted otherwise."""
        try:
            principal = await self.access.principal(context)
            await self._permit(principal, ref, operation)
        except Refused as refused:
            await context.abort(refused.code, refused.details)
        return principal

    async def _permit(self, principal: Principal, ref: queue_pb2.QueueRef, operation: Operation) -> None:
        """Refused unless `principal` may `operation` the queue `ref` names. A name no queue can have
        (ringq.names) is refused as INVALID_ARGUMENT naming the field, not as the missing vhost or permission
        it also is: as DeclareQueue and a node without TLS refuse it (the name is looked at only once the
        access check has failed, so not on the hot path)."""
        try:
            await self.access.permit(principal, _vhost(ref), operation, ref.queue)
        except Refused as refused:
            problem = _ref_problem(ref) if refused.code == grpc.StatusCode.PERMISSION_DENIED else ""
            if problem:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, problem) from None
            raise

    async def _route_for(
        self, principal: Principal, ref: queue_pb2.QueueRef, context: _Context
    ) -> tuple[QueueReplica | None, Any, QueueRecord]:
        """`_route` for a caller already authorised."""
        try:
            replica, stub, record = await self._find(ref)
        except Refused as refused:
            await context.abort(refused.code, refused.details)
        return replica, with_metadata(stub, principal.relay_metadata()) if stub is not None else None, record

    async def _relay(self, context: _Context, call: Awaitable[Any], answer: type[_Answer]) -> _Answer:
        """Relay a call to the master's node; its failure becomes ours."""
        try:
            response = await call
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
        if not isinstance(response, answer):
            raise TypeError(f"expected {answer.__name__}, got {type(response).__name__}")
        return response

    async def _delete(self, context: _Context, record: QueueRecord) -> None:
        try:
            await self.coordinator.delete_queue(record.vhost, record.name)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")

    async def _queue_error(self, context: _Context, error: QueueError) -> None:
        await context.abort(getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNKNOWN), str(error))

    def _info(self, replica: QueueReplica, record: QueueRecord, address: str) -> queue_pb2.QueueInfo:
        master = replica.master
        contents = master.contents if master is not None else None
        return queue_pb2.QueueInfo(
            queue=queue_pb2.QueueRef(vhost=record.vhost, queue=record.name),
            master_node=record.master,
            master_address=address,
            mirrors=record.mirrors,
            synchronised_mirrors=record.synchronised_mirrors,
            depth=contents.depth if contents is not None else 0,
            ready=len(contents) if contents is not None else 0,
            unacked=len(contents.unacked) if contents is not None else 0,
            consumers=len(master.consumer_tags) if master else 0,
            policy=record.policy,
            syncing=master.syncing if master else [],
            status=replica.status,
            events=[
                queue_pb2.QueueEvent(time_unix_ms=e.time_ms, kind=e.kind, node=e.node, detail=e.detail)
                for e in replica.events
            ],
        )

    # -------------------------------------------------------------- wiring

    async def DeclareQueue(
        self, request: queue_pb2.DeclareQueueRequest, context: _Context
    ) -> queue_pb2.DeclareQueueResponse:
        ref = request.queue
        problem = _ref_problem(ref)
        if not problem and is_stream_group(ref.queue):
            problem = f"queue names starting {STREAM_QUEUE_PREFIX!r} are reserved for the groups of ordered streams"
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        principal = await self.access.allow(context, _vhost(ref), Operation.CONFIGURE, ref.queue)
        try:
            queue_arguments.validate(request.arguments)
        except queue_arguments.ArgumentError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        declared = QueueRecord(
            _vhost(ref),
            ref.queue,
            durable=request.durable,
            auto_delete=request.auto_delete,
            exclusive_owner=request.exclusive_owner,
            arguments=dict(request.arguments),
        )
        try:
            record = await self.coordinator.declare_queue(declared, preferred_master=self.node_id)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
        replica, stub, record = await self._route_for(principal, ref, context)
        if stub is not None:
            status = stub.QueueStatus(queue_pb2.QueueStatusRequest(queue=ref))
            return queue_pb2.DeclareQueueResponse(
                queue=(await self._relay(context, status, queue_pb2.QueueStatusResponse)).queue
            )
        assert replica is not None
        return queue_pb2.DeclareQueueResponse(queue=self._info(replica, record, self.address))

    async def QueueStatus(
        self, request: queue_pb2.QueueStatusRequest, context: _Context
    ) -> queue_pb2.QueueStatusResponse:
        replica, stub, record = await self._route(request.queue, context, Operation.READ, stream_group_ok=True)
        if stub is not None:
            return await self._relay(context, stub.QueueStatus(request), queue_pb2.QueueStatusResponse)
        assert replica is not None
        return queue_pb2.QueueStatusResponse(queue=self._info(replica, record, self.address))

    async def DeleteQueue(
        self, request: queue_pb2.DeleteQueueRequest, context: _Context
    ) -> queue_pb2.DeleteQueueResponse:
        replica, stub, record = await self._route(request.queue, context, Operation.CONFIGURE)
        if stub is not None:
            return await self._relay(context, stub.DeleteQueue(request), queue_pb2.DeleteQueueResponse)
        assert replica is not None and replica.master is not None
        master = replica.master
        if request.if_unused and master.consumer_tags:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"queue {record.name!r} has consumers")
        if request.if_empty and master.contents.depth:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"queue {record.name!r} is not empty")
        depth = master.contents.depth
        await self._delete(context, record)
        # Stop serving it here before answering: once the caller hears "deleted", no publish is confirmed
        # and no message delivered (the other replicas stop as the coordinator's watch tells them).
        await self.manager.forget(record.key)
        return queue_pb2.DeleteQueueResponse(messages_deleted=depth)

    async def PurgeQueue(self, request: queue_pb2.PurgeQueueRequest, context: _Context) -> queue_pb2.PurgeQueueResponse:
        replica, stub, _ = await self._route(request.queue, context, Operation.READ)
        if stub is not None:
            return await self._relay(context, stub.PurgeQueue(request), queue_pb2.PurgeQueueResponse)
        assert replica is not None
        try:
            return queue_pb2.PurgeQueueResponse(messages_purged=await replica.purge())
        except ConnectionAbortedError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the queue's master went away: {error}; retry")
        raise AssertionError("unreachable")

    async def SyncQueue(self, request: queue_pb2.SyncQueueRequest, context: _Context) -> queue_pb2.SyncQueueResponse:
        replica, stub, record = await self._route(request.queue, context, Operation.CONFIGURE, stream_group_ok=True)
        if stub is not None:
            return await self._relay(context, stub.SyncQueue(request), queue_pb2.SyncQueueResponse)
        assert replica is not None
        replica.sync_unsynchronised()
        return queue_pb2.SyncQueueResponse(queue=self._info(replica, record, self.address))

    async def CancelSyncQueue(
        self, request: queue_pb2.CancelSyncQueueRequest, context: _Context
    ) -> queue_pb2.CancelSyncQueueResponse:
        replica, stub, record = await self._route(request.queue, context, Operation.CONFIGURE, stream_group_ok=True)
        if stub is not None:
            return await self._relay(context, stub.CancelSyncQueue(request), queue_pb2.CancelSyncQueueResponse)
        assert replica is not None
        replica.cancel_syncs()
        return queue_pb2.CancelSyncQueueResponse(queue=self._info(replica, record, self.address))

    # ----------------------------------------------------------- messaging

    async def Publish(
        self, request_iterator: AsyncIterator[queue_pb2.PublishRequest], context: _Context
    ) -> AsyncIterator[queue_pb2.PublishResponse]:
        try:
            principal = await self.access.principal(context)
        except Refused as refused:
            await context.abort(refused.code, refused.details)
        # In arrival order, what each request is answered from: the confirm of a request decided here (its
        # outcomes, made into a response when they come: no task per request), or a finished response.
        pending: asyncio.Queue[_PendingAnswer | None] = asyncio.Queue()
        routes: dict[tuple[str, str], tuple[QueueReplica | None, Any]] = {}
        forwarded = _ForwardedStream()

        def failed(error: Exception) -> _PendingAnswer:
            future: asyncio.Future[queue_pb2.PublishResponse] = asyncio.get_running_loop().create_future()
            future.set_exception(error)
            return None, future

        async def read() -> None:
            # Batches are routed and decided here, one after another, in the order
            # they came: a publisher's messages must reach the master in seq order.
            try:
                async for request in request_iterator:
                    if self.memory_clear is not None:
                        await self.memory_clear()  # the memory alarm: read no more (gRPC blocks the publisher)
                    problem = _publish_problem(request)
                    if problem:
                        pending.put_nowait(failed(ValueError(problem)))
                        break
                    key = (_vhost(request.queue), request.queue.queue)
                    if key not in routes:
                        try:
                            await self._permit(principal, request.queue, Operation.WRITE)
                            replica, stub, record = await self._find(request.queue)
                        except Refused as refused:
                            pending.put_nowait(failed(refused))
                            break
                        if stub is not None:
                            stub = with_metadata(stub, principal.relay_metadata())
                        routes[key] = (replica, stub)
                        if stub is not None and forwarded.moved is None:
                            forwarded.moved = self._watch_master(record)
                    replica, stub = routes[key]
                    if stub is not None:
                        if tracing.enabled():
                            _trace_forward(request, self.node_id)
                        pending.put_nowait(
                            (None, asyncio.ensure_future(self._forward_publish(stub, request, forwarded)))
                        )
                        continue
                    assert replica is not None
                    items = _outgoing(scoped_publisher(principal, request.publisher), request.messages)
                    await replica.room_to_publish()
                    try:
                        confirmed = replica.publish_in_order(items)
                    except QueueError as error:
                        pending.put_nowait(failed(error))
                        break
                    pending.put_nowait(([item.seq for item in items], confirmed))
            finally:
                pending.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await pending.get()) is not None:
                seqs, answered = item
                try:
                    result = await answered
                    yield result if seqs is None else _publish_response(seqs, result)
                except Refused as refused:
                    await context.abort(refused.code, refused.details)
                except ValueError as error:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
                except QueueError as error:
                    await self._queue_error(context, error)
                except ConnectionAbortedError as error:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"the queue's master went away: {error}; retry")
        finally:
            reader.cancel()
            while not pending.empty():
                leftover = pending.get_nowait()
                if leftover is not None:
                    answer = leftover[1]
                    if answer.done() and not answer.cancelled():
                        answer.exception()  # retrieved: the stream ended, nobody else will look
                    answer.cancel()
            if forwarded.call is not None:
                forwarded.call.cancel()
            if forwarded.moved is not None:
                forwarded.moved.cancel()

    async def _forward_publish(
        self, stub: Any, request: queue_pb2.PublishRequest, forwarded: _ForwardedStream
    ) -> queue_pb2.PublishResponse:
        if forwarded.call is None:
            forwarded.call = stub.Publish()
        call = forwarded.call
        async with forwarded.lock:  # one request, one response: keep them paired
            try:
                await call.write(request)
                assert forwarded.moved is not None
                response = await _unless_master_moves(call.read(), forwarded.moved, request.queue.queue)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
                code = error.code() if isinstance(error, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
                if code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                    code = grpc.StatusCode.UNAVAILABLE  # the master's node failed us: retry elsewhere
                raise Refused(
                    code, f"the queue's master cannot be reached now (it may be moving); retry: {error!r}"
                ) from None
        if response is grpc.aio.EOF:  # type: ignore[attr-defined]
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the queue's master closed the stream; retry")
        return response  # type: ignore[no-any-return]

    def _watch_master(self, record: QueueRecord) -> asyncio.Future[str]:
        """Completes (with the new master) once the records say `record`'s master moved: a stream
        relayed to the old one must end then (its node may be cut off and never answer)."""
        moved = self.manager.master_moved(record.vhost, record.name, record.master, record.version)
        return asyncio.ensure_future(moved)

    async def _forward_dead_letters(self, record: QueueRecord, items: list[Outgoing]) -> None:
        address = await self.address_of(record.master)
        if address is None:
            raise ConnectionError(f"no address for {record.master}")
        stub: Any = queue_pb2_grpc.QueueServiceStub(self.channel_to(record.master, address))
        request = queue_pb2.PublishRequest(
            queue=queue_pb2.QueueRef(vhost=record.vhost, queue=record.name),
            messages=[queue_pb2.OutgoingMessage(body=i.body, headers=i.headers) for i in items],
        )
        call: Any = stub.Publish()
        await call.write(request)
        await call.read()
        await call.done_writing()

    async def Consume(
        self, requests: AsyncIterator[queue_pb2.ConsumeRequest], context: _Context
    ) -> AsyncIterator[queue_pb2.ConsumeResponse]:
        first = await anext(aiter(requests), None)
        if first is None:
            return
        if first.settlements:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first consume request attaches: no settlements")
        replica, stub, record = await self._route(first.queue, context, Operation.READ)
        if stub is not None:
            async for response in self._forward_consume(first, requests, stub, record, context):
                yield response
            return
        assert replica is not None
        tag = first.consumer_tag or f"{self.node_id}.{uuid.uuid4().hex[:12]}"
        try:
            consumer = await replica.consume(tag, first.prefetch, first.priority)
        except QueueError as error:
            await self._queue_error(context, error)
        refused: list[QueueError] = []
        half_closed = asyncio.Event()

        async def settle_from_stream() -> None:
            async for request in requests:
                try:
                    error = replica.settle_now(tag, [_settlement(s) for s in request.settlements])
                except QueueError as bad:
                    error = bad
                if error is not None:
                    refused.append(error)
                    consumer.deliveries.put_nowait(None)
                    return
            # The client half-closed: its settlements are decided; cancel the consumer, end the stream (OK).
            half_closed.set()
            consumer.deliveries.put_nowait(None)

        settler = asyncio.ensure_future(settle_from_stream())
        batches = _ReadyBatches(consumer)
        try:
            while (batch := await batches.next()) and not half_closed.is_set():
                yield _consume_response(batch)
            if half_closed.is_set():
                await replica.cancel(tag)  # after the settlements, in decision order
                return
            if refused:
                await self._queue_error(context, refused[0])
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"queue {record.name!r}: its master moved; resume")
        finally:
            settler.cancel()
            with contextlib.suppress(Exception):
                await replica.cancel(tag)

    async def _forward_consume(
        self,
        first: queue_pb2.ConsumeRequest,
        requests: AsyncIterator[queue_pb2.ConsumeRequest],
        stub: Any,
        record: QueueRecord,
        context: _Context,
    ) -> AsyncIterator[queue_pb2.ConsumeResponse]:
        """Proxy a consume stream to the master's node, settlements included (responses as they come);
        if the queue's master moves meanwhile, the client is told to resume (at the new master)."""
        call = stub.Consume()
        moved = self._watch_master(record)

        async def pump() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(first)
                async for request in requests:
                    await call.write(request)
                await call.done_writing()  # the client half-closed: so do we

        pumping = asyncio.ensure_future(pump())
        try:
            while (response := await _unless_master_moves(call.read(), moved, first.queue.queue)) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                yield response
        except Refused as refused:
            await context.abort(refused.code, refused.details)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")
        finally:
            moved.cancel()
            pumping.cancel()
            call.cancel()

    async def Settle(self, request: queue_pb2.SettleRequest, context: _Context) -> queue_pb2.SettleResponse:
        kind = _SETTLE.get(request.kind)
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kind must be ACK, REQUEUE or REJECT")
        replica, stub, _ = await self._route(request.queue, context, Operation.READ)
        if stub is not None:
            return await self._relay(context, stub.Settle(request), queue_pb2.SettleResponse)
        assert replica is not None and kind is not None
        try:
            await replica.settle(request.consumer_tag, request.delivery_tag, request.multiple, kind)
        except QueueError as error:
            await self._queue_error(context, error)
        except ConnectionAbortedError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the queue's master went away: {error}; retry")
        return queue_pb2.SettleResponse()

    async def Commit(self, request: queue_pb2.CommitRequest, context: _Context) -> queue_pb2.CommitResponse:
        problem = _commit_problem(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.settlements and request.messages:  # settling needs read, publishing write: both here
            await self._allow(context, request.queue, Operation.READ)
        operation = Operation.WRITE if request.messages else Operation.READ
        replica, stub, _ = await self._route(request.queue, context, operation)
        if stub is not None:
            return await self._relay(context, stub.Commit(request), queue_pb2.CommitResponse)
        assert replica is not None
        principal = await self.access.principal(context)
        items = _outgoing(scoped_publisher(principal, request.publisher), request.messages)
        settlements = [Settlement(s.delivery_tag, s.multiple, _SETTLE[s.kind]) for s in request.settlements]
        try:
            outcomes = await replica.commit(request.consumer_tag, settlements, items)
        except QueueError as error:
            await self._queue_error(context, error)
        except ConnectionAbortedError as error:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the queue's master went away: {error}; the transaction was applied whole or not at all: retry it "
                "(its messages are not added twice)",
            )
        return queue_pb2.CommitResponse(
            seqs=[m.seq for m in request.messages], outcomes=[_OUTCOMES[o] for o in outcomes]
        )

    async def Get(self, request: queue_pb2.GetRequest, context: _Context) -> queue_pb2.GetResponse:
        replica, stub, _ = await self._route(request.queue, context, Operation.READ)
        if stub is not None:
            return await self._relay(context, stub.Get(request), queue_pb2.GetResponse)
        assert replica is not None
        try:
            delivery = await replica.get(request.no_ack)
        except ConnectionAbortedError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the queue's master went away: {error}; retry")
        if delivery is None:
            return queue_pb2.GetResponse(found=False)
        response = queue_pb2.GetResponse(found=True)
        _fill_delivery(response.delivery, delivery)
        return response


# A publish request's answer to come: (its seqs, its outcomes when confirmed) for one decided on this
# node, (None, the response) for one relayed or refused.
_PendingAnswer = tuple[list[int] | None, asyncio.Future[Any]]


def _publish_response(seqs: list[int], outcomes: list[PublishOutcome]) -> queue_pb2.PublishResponse:
    """The answer to a request decided here: its messages' seqs (as the request gave them) and outcomes."""
    response = queue_pb2.PublishResponse()
    response.seqs.extend(seqs)
    response.outcomes.extend([_OUTCOMES[outcome] for outcome in outcomes])
    return response


class _ForwardedStream:
    """The stream a publish stream is relayed on to the master's node."""

    def __init__(self) -> None:
        self.call: Any = None
        self.moved: asyncio.Future[str] | None = None  # completes when the master relayed to moves
        self.lock = asyncio.Lock()


async def _unless_master_moves(reply: Awaitable[_T], moved: asyncio.Future[str], queue: str) -> _T:
    """`reply` from the master's node, unless its master moves first: then the client is told to retry,
    and resends to the new master."""
    answered = asyncio.ensure_future(reply)
    racing: set[asyncio.Future[Any]] = {answered, moved}
    await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
    if answered.done():
        return answered.result()
    answered.cancel()
    raise Refused(grpc.StatusCode.UNAVAILABLE, f"queue {queue!r}: its master moved to {moved.result()}; retry")


def _outgoing(publisher: str, messages: Iterable[queue_pb2.OutgoingMessage]) -> list[Outgoing]:
    outgoing = []
    for m in messages:
        headers = m.headers
        outgoing.append(
            Outgoing(
                m.body,
                publisher,
                m.seq,
                m.persistent,
                dict(headers) if headers else {},
                m.priority,
                m.expiration_ms or None,
            )
        )
    return outgoing


def _publish_problem(request: queue_pb2.PublishRequest) -> str | None:
    if not request.messages:
        return "messages must not be empty"
    if is_stream_group(request.queue.queue):
        return _STREAM_GROUP_REFUSAL.format(request.queue.queue)
    return _messages_problem(request.queue, request.publisher, request.messages, request.ByteSize())


def _commit_problem(request: queue_pb2.CommitRequest) -> str | None:
    if len(request.settlements) > MAX_MESSAGES_PER_PUBLISH:
        count = len(request.settlements)
        return f"a commit carries {count} settlements; at most {MAX_MESSAGES_PER_PUBLISH} are allowed"
    for index, settlement in enumerate(request.settlements):
        if settlement.kind not in _SETTLE:
            return f"settlements[{index}].kind must be ACK, REQUEUE or REJECT"
    return _messages_problem(request.queue, request.publisher, request.messages, request.ByteSize())


def _messages_problem(
    queue: queue_pb2.QueueRef, publisher: str, messages: Sequence[queue_pb2.OutgoingMessage], request_bytes: int
) -> str | None:
    """What is wrong with a request's messages, if anything. A request of `request_bytes` within the header
    bound holds no body or headers over their bounds: only expirations are looked at one by one."""
    if not queue.queue:
        return "queue must not be empty"
    if len(publisher.encode()) > MAX_PUBLISHER_BYTES:
        return f"publisher must be at most {MAX_PUBLISHER_BYTES} bytes, got {len(publisher.encode())}"
    if len(messages) > MAX_MESSAGES_PER_PUBLISH:
        return f"a request carries {len(messages)} messages; at most {MAX_MESSAGES_PER_PUBLISH} are allowed"
    sizes_within_bounds = request_bytes <= min(MAX_BODY_BYTES, MAX_HEADER_BYTES)
    for index, message in enumerate(messages):
        if message.expiration_ms > MAX_TTL_MS:
            return f"messages[{index}].expiration_ms is {message.expiration_ms}; at most {MAX_TTL_MS} is allowed"
        if sizes_within_bounds:
            continue
        if len(message.body) > MAX_BODY_BYTES:
            return f"messages[{index}].body has {len(message.body)} bytes; at most {MAX_BODY_BYTES} are allowed"
        if message.headers:
            header_bytes = sum(len(k.encode()) + len(v.encode()) for k, v in message.headers.items())
            if header_bytes > MAX_HEADER_BYTES:
                return f"messages[{index}].headers have {header_bytes} bytes; at most {MAX_HEADER_BYTES} are allowed"
    return None
