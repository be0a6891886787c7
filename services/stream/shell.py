"""What the stream RPCs of a node share: the node's queues, the coordinator, access checks, fencing and
the group gates, and the small helpers that turn their failures into gRPC statuses.

Responsible for: authenticating and authorising a stream call (permissions name the stream), reading the
stream's record and its groups' queue records from the coordinator, finding where a group's master
runs (here, or a stub to its node with the caller's user relayed), and the fencing check.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc

from ringq.internal.v1 import coordinator_pb2
from ringq.names import name_problem
from ringq.security import with_metadata
from ringq.v1 import stream_pb2, stream_pb2_grpc
from services.access import Operation
from services.access_guard import AccessGuard, Principal
from services.coordinator.client import CoordinatorClient
from services.coordinator.metadata import QueueRecord
from services.queue.manager import QueueManager
from services.queue.replica import QueueReplica
from services.request_guard import Refused
from services.stream.fencing import FencingCheck, LeaseRead, StaleToken, lease_name
from services.stream.gates import GroupGates

Context = grpc.aio.ServicerContext[Any, Any]
# Set on a stream call one node relays to the node of a group's master: that node serves it or refuses
# it (UNAVAILABLE), never relays it again.
RELAYED_METADATA = "ringq-stream-relayed"
ROLES = {stream_pb2.STREAM_ROLE_PRODUCER: "producer", stream_pb2.STREAM_ROLE_CONSUMER: "consumer"}


def stream_names(ref: stream_pb2.StreamRef) -> tuple[str, str]:
    return ref.vhost or "/", ref.stream


def ref_problem(ref: stream_pb2.StreamRef) -> str | None:
    if not ref.stream:
        return "stream must not be empty"
    for field, value in (("stream", ref.stream), ("vhost", ref.vhost or "/")):
        problem = name_problem(value)
        if problem:
            return f"{field} {problem}"
    return None


def relayed(context: Context) -> bool:
    return any(key == RELAYED_METADATA for key, _ in (context.invocation_metadata() or ()))


async def abort(context: Context, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("unreachable: abort raises")


class StreamShell:
    """The node's parts a stream RPC uses."""

    def __init__(
        self,
        node_id: str,
        manager: QueueManager,
        coordinator: CoordinatorClient,
        address_of: Callable[[str], Awaitable[str | None]],
        channel_to: Callable[[str, str], grpc.aio.Channel],
        access: AccessGuard,
        forget_address: Callable[[str], None] = lambda node: None,
    ) -> None:
        self.node_id = node_id
        self.manager = manager
        self.coordinator = coordinator
        self.address_of = address_of
        self.channel_to = channel_to
        self.access = access
        # A node that did not answer at the address known for it: ask the coordinator again next time
        # (a restarted node may listen elsewhere).
        self.forget_address = forget_address
        self.fencing = FencingCheck(self._read_lease)
        self.gates = GroupGates()

    async def fencing_read(self, name: str) -> LeaseRead:
        """The lease `name` as the coordinator has it now."""
        return await self._read_lease(name)

    async def _read_lease(self, name: str) -> LeaseRead:
        response = await self.coordinator.call(
            lambda stub: stub.CheckLease, coordinator_pb2.CheckLeaseRequest(name=name, holder="-", token=0)
        )
        return LeaseRead(response.lease.token, response.lease.holder, response.remaining_ms)

    async def allow(self, context: Context, ref: stream_pb2.StreamRef, operation: Operation) -> Principal:
        """The caller, once the stream's name is well formed and the caller may `operation` it."""
        problem = ref_problem(ref)
        if problem:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        vhost, name = stream_names(ref)
        try:
            principal = await self.access.principal(context)
            await self.access.permit(principal, vhost, operation, name)
        except Refused as refused:
            await abort(context, refused.code, refused.details)
        return principal

    async def fence(self, context: Context, ref: stream_pb2.StreamRef, role: str, token: int) -> None:
        vhost, name = stream_names(ref)
        try:
            await self.fencing.check(lease_name(vhost, name, role), token)
        except StaleToken as stale:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"stream {name!r}: {stale}")

    async def coordinator_call(self, context: Context, method: Callable[[Any], Any], request: Any) -> Any:
        """A CoordinatorService call; its failure becomes the call's status."""
        try:
            return await self.coordinator.call(method, request)
        except grpc.aio.AioRpcError as error:
            await abort(context, error.code(), error.details() or "")

    async def record(self, context: Context, ref: stream_pb2.StreamRef) -> coordinator_pb2.StreamRecord:
        vhost, name = stream_names(ref)
        response = await self.coordinator_call(
            context, lambda stub: stub.GetStreamRecord, coordinator_pb2.GetStreamRecordRequest(vhost=vhost, name=name)
        )
        return response.stream  # type: ignore[no-any-return]

    async def read_record(self, vhost: str, name: str) -> coordinator_pb2.StreamRecord | None:
        """The stream's record as the coordinator has it now; None if it cannot say (background checks:
        they look again later)."""
        request = coordinator_pb2.GetStreamRecordRequest(vhost=vhost, name=name)
        try:
            return (await self.coordinator.call(lambda stub: stub.GetStreamRecord, request)).stream
        except grpc.aio.AioRpcError:
            return None

    async def group_queue(self, vhost: str, group: str) -> QueueRecord | None:
        try:
            return await self.coordinator.get_queue(vhost, group)
        except grpc.aio.AioRpcError:
            return None

    def local_master(self, vhost: str, group: str) -> QueueReplica | None:
        replica = self.manager.local(vhost, group)
        return replica if replica is not None and replica.is_master else None

    async def stub_to(self, node: str, principal: Principal) -> Any | None:
        """A StreamService stub to `node` relaying `principal` (None if its address is unknown)."""
        address = await self.address_of(node) if node else None
        if address is None:
            return None
        stub = stream_pb2_grpc.StreamServiceStub(self.channel_to(node, address))
        return with_metadata(stub, (*principal.relay_metadata(), (RELAYED_METADATA, "1")))
