"""StreamService on a node: ordered streams for applications (protos/ringq/v1/stream.proto).

Responsible for: the stream calls' validation, authorisation (configure to declare and delete, write to
publish and hold the producer lease, read to consume, hold the consumer lease and ask for status), the
coordinator's records and leases behind them, and handing publish and consume streams to publish.py and
consume.py. Errors are clear statuses: NOT_FOUND for an unknown stream, INVALID_ARGUMENT for bad input
(fewer than two groups, fewer than two nodes for a group, a malformed batch), FAILED_PRECONDITION for a
stale or missing fencing token, a lease held by another, or a consume of a group that is not the head.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from ringq.internal.v1 import coordinator_pb2
from ringq.v1 import cluster_pb2, stream_pb2, stream_pb2_grpc
from services.access import Operation
from services.coordinator.stream_records import MAX_GROUPS, MIN_GROUPS
from services.request_guard import Refused
from services.stream import consume, publish
from services.stream.fencing import lease_name
from services.stream.shell import ROLES, Context, StreamShell, abort, stream_names
from services.stream.status import stream_info

_LEASE_OPERATION = {"producer": Operation.WRITE, "consumer": Operation.READ}


class StreamServicer(stream_pb2_grpc.StreamServiceServicer):
    def __init__(self, shell: StreamShell) -> None:
        self.shell = shell

    async def DeclareStream(
        self, request: stream_pb2.DeclareStreamRequest, context: Context
    ) -> stream_pb2.DeclareStreamResponse:
        await self.shell.allow(context, request.stream, Operation.CONFIGURE)
        if not MIN_GROUPS <= request.groups <= MAX_GROUPS:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"groups must be {MIN_GROUPS} to {MAX_GROUPS}, got {request.groups}: a stream needs at least "
                "two broker groups so that one takes sends while another fails or drains",
            )
        vhost, name = stream_names(request.stream)
        declared = coordinator_pb2.DeclareStreamRecordRequest(
            vhost=vhost, name=name, groups=request.groups, durable=request.durable
        )
        response = await self.shell.coordinator_call(context, lambda stub: stub.DeclareStreamRecord, declared)
        return stream_pb2.DeclareStreamResponse(stream=await stream_info(self.shell, response.stream))

    async def DeleteStream(
        self, request: stream_pb2.DeleteStreamRequest, context: Context
    ) -> stream_pb2.DeleteStreamResponse:
        await self.shell.allow(context, request.stream, Operation.CONFIGURE)
        vhost, name = stream_names(request.stream)
        deleted = coordinator_pb2.DeleteStreamRecordRequest(vhost=vhost, name=name)
        await self.shell.coordinator_call(context, lambda stub: stub.DeleteStreamRecord, deleted)
        return stream_pb2.DeleteStreamResponse()

    async def StreamStatus(
        self, request: stream_pb2.StreamStatusRequest, context: Context
    ) -> stream_pb2.StreamStatusResponse:
        await self.shell.allow(context, request.stream, Operation.READ)
        record = await self.shell.record(context, request.stream)
        return stream_pb2.StreamStatusResponse(stream=await stream_info(self.shell, record))

    async def ListStreams(
        self, request: stream_pb2.ListStreamsRequest, context: Context
    ) -> stream_pb2.ListStreamsResponse:
        listed = coordinator_pb2.ListStreamRecordsRequest(vhost=request.vhost)
        response = await self.shell.coordinator_call(context, lambda stub: stub.ListStreamRecords, listed)
        principal = await self.shell.access.principal(context)
        infos = []
        for record in response.streams:
            try:
                await self.shell.access.permit(principal, record.vhost, Operation.READ, record.name)
            except Refused:
                continue  # listed only to users who may read it
            infos.append(await stream_info(self.shell, record))
        return stream_pb2.ListStreamsResponse(streams=infos)

    # ------------------------------------------------------------ leases

    async def _lease_call(self, context: Context, ref: stream_pb2.StreamRef, role_value: int) -> tuple[str, str]:
        """The lease's name and role, once the caller may take it and the stream exists."""
        role = ROLES.get(role_value)  # type: ignore[call-overload]
        if role is None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "role must be STREAM_ROLE_PRODUCER or _CONSUMER")
        await self.shell.allow(context, ref, _LEASE_OPERATION[role])
        await self.shell.record(context, ref)  # NOT_FOUND for an unknown stream
        vhost, name = stream_names(ref)
        return lease_name(vhost, name, role), role

    async def AcquireStreamLease(
        self, request: stream_pb2.AcquireStreamLeaseRequest, context: Context
    ) -> stream_pb2.AcquireStreamLeaseResponse:
        if not request.holder:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "holder must not be empty")
        name, _ = await self._lease_call(context, request.stream, request.role)
        asked = coordinator_pb2.AcquireLeaseRequest(name=name, holder=request.holder, ttl_ms=request.ttl_ms)
        response = await self.shell.coordinator_call(context, lambda stub: stub.AcquireLease, asked)
        return stream_pb2.AcquireStreamLeaseResponse(lease=_lease(request.role, response.lease, request.ttl_ms))

    async def RenewStreamLease(
        self, request: stream_pb2.RenewStreamLeaseRequest, context: Context
    ) -> stream_pb2.RenewStreamLeaseResponse:
        name, _ = await self._lease_call(context, request.stream, request.role)
        asked = coordinator_pb2.RenewLeaseRequest(
            name=name, holder=request.holder, token=request.fencing_token, ttl_ms=request.ttl_ms
        )
        response = await self.shell.coordinator_call(context, lambda stub: stub.RenewLease, asked)
        return stream_pb2.RenewStreamLeaseResponse(lease=_lease(request.role, response.lease, request.ttl_ms))

    async def ReleaseStreamLease(
        self, request: stream_pb2.ReleaseStreamLeaseRequest, context: Context
    ) -> stream_pb2.ReleaseStreamLeaseResponse:
        name, _ = await self._lease_call(context, request.stream, request.role)
        asked = coordinator_pb2.ReleaseLeaseRequest(name=name, holder=request.holder, token=request.fencing_token)
        await self.shell.coordinator_call(context, lambda stub: stub.ReleaseLease, asked)
        return stream_pb2.ReleaseStreamLeaseResponse()

    # ------------------------------------------------------------ messages

    async def PublishStream(
        self, request_iterator: AsyncIterator[stream_pb2.PublishStreamRequest], context: Context
    ) -> AsyncIterator[stream_pb2.PublishStreamResponse]:
        async for response in publish.serve(self.shell, request_iterator, context):
            yield response

    async def ConsumeStream(
        self, request_iterator: AsyncIterator[stream_pb2.ConsumeStreamRequest], context: Context
    ) -> AsyncIterator[stream_pb2.ConsumeStreamResponse]:
        async for response in consume.serve(self.shell, request_iterator, context):
            yield response


def _lease(role: stream_pb2.StreamRole.ValueType, lease: cluster_pb2.Lease, ttl_ms: int) -> stream_pb2.StreamLease:
    return stream_pb2.StreamLease(role=role, holder=lease.holder, fencing_token=lease.token, expires_in_ms=ttl_ms)
