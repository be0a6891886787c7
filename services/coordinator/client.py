"""An async client of the coordinator's services (CoordinatorService, and AdminService on the same
channel) that waits out coordinator outages.

It knows one or more coordinator addresses (with the ZooKeeper store, any
coordinator serves any call). UNAVAILABLE (the coordinator, or the store
behind it, cannot be reached) and DEADLINE_EXCEEDED move the client to the
next address and are retried with exponential backoff (50 ms doubling to
1 s) for up to `retry_seconds`; any other error is raised at once.
A retried group change is still a compare-and-set: if an earlier attempt did
land, the retry answers VERSION_CONFLICT with the group that already holds it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Self, TypeVar

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from ringq.internal.v1 import coordinator_pb2, coordinator_pb2_grpc
from ringq.keepalive import CHANNEL_KEEPALIVE
from ringq.v1 import admin_pb2_grpc, cluster_pb2
from services.coordinator.convert import (
    ChangeResponse,
    change_to_request,
    group_from_proto,
    outcome_from_proto,
    queue_from_proto,
    queue_to_proto,
)
from services.coordinator.group_table import Group, GroupChange, Outcome
from services.coordinator.metadata import QueueRecord
from services.coordinator.records import NO_DISK_REPORT, NO_MEMORY_REPORT, DiskReport, MemoryReport
from services.tls import PLAINTEXT, Dialer

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")

# The whole retry policy.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
BACKOFF_FIRST_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 1.0
# gRPC's own reconnect backoff (default up to 120 s) would otherwise keep failing
# calls fast for minutes after a long outage; hold it to the same bounds.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", int(BACKOFF_FIRST_SECONDS * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(BACKOFF_MAX_SECONDS * 1000)),
    *CHANNEL_KEEPALIVE,  # a coordinator cut off by a partition is left for another within seconds
]


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE


def _retry_policy(retry_seconds: float) -> AsyncRetrying:
    return AsyncRetrying(
        retry=retry_if_exception(_retryable),
        wait=wait_exponential(multiplier=BACKOFF_FIRST_SECONDS, min=BACKOFF_FIRST_SECONDS, max=BACKOFF_MAX_SECONDS),
        stop=stop_after_delay(retry_seconds),
        reraise=True,
    )


if TYPE_CHECKING:
    from ringq.internal.v1.coordinator_pb2_grpc import CoordinatorServiceAsyncStub as Stub
    from ringq.v1.admin_pb2_grpc import AdminServiceAsyncStub as AdminStub


class CoordinatorClient:
    """Calls the coordinators at `addresses` ("host:port", a list, or a comma-separated
    string), sticking to one until it fails; use from one event loop."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        timeout: float = 5.0,
        retry_seconds: float = 30.0,
        dialer: Dialer = PLAINTEXT,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        if not addresses:
            raise ValueError("at least one coordinator address is needed")
        self.addresses = list(addresses)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._current = 0
        self._timeout = timeout
        self._retry_seconds = retry_seconds
        self._dialer = dialer  # with TLS: this member's certificate, and only a coordinator's accepted

    @property
    def current_address(self) -> str:
        """The coordinator the next call goes to."""
        return self.addresses[self._current]

    def _channel(self) -> grpc.aio.Channel:
        address = self.current_address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._dialer.to_coordinator(address, CHANNEL_OPTIONS)
        return channel

    def _stub(self) -> Stub:
        return coordinator_pb2_grpc.CoordinatorServiceStub(self._channel())

    def _admin_stub(self) -> AdminStub:
        return admin_pb2_grpc.AdminServiceStub(self._channel())

    async def read_group(self, name: str) -> Group:
        response = await self._call(lambda stub: stub.ReadGroup, coordinator_pb2.ReadGroupRequest(group=name))
        return group_from_proto(response.group)

    async def list_groups(self, node: str) -> list[Group]:
        """Every group with a member on `node`, in name order (a page per call)."""
        groups: list[Group] = []
        after = ""
        while True:
            request = coordinator_pb2.ListGroupsRequest(node=node, after=after)
            response = await self._call(lambda stub: stub.ListGroups, request)
            groups.extend(group_from_proto(group) for group in response.groups)
            if not response.next_after:
                return groups
            after = response.next_after

    async def change_group(self, name: str, change: GroupChange) -> tuple[Outcome, Group]:
        request = change_to_request(name, change)
        response: ChangeResponse
        if isinstance(request, coordinator_pb2.CreateGroupRequest):
            response = await self._call(lambda stub: stub.CreateGroup, request)
        elif isinstance(request, coordinator_pb2.AddMemberRequest):
            response = await self._call(lambda stub: stub.AddMember, request)
        elif isinstance(request, coordinator_pb2.MarkMemberDeadRequest):
            response = await self._call(lambda stub: stub.MarkMemberDead, request)
        else:
            response = await self._call(lambda stub: stub.EraseMembers, request)
        return outcome_from_proto(response.outcome), group_from_proto(response.group)

    async def register_node(
        self, node: str, address: str, cluster_address: str = "", certificate_address: str = ""
    ) -> None:
        request = coordinator_pb2.RegisterNodeRequest(
            node=node, address=address, cluster_address=cluster_address, certificate_address=certificate_address
        )
        await self._call(lambda stub: stub.RegisterNode, request)

    async def list_nodes(self) -> list[tuple[str, str]]:
        """(node, where other cluster members dial it), for every registered node."""
        response = await self._call(lambda stub: stub.ListNodes, coordinator_pb2.ListNodesRequest())
        return [(record.node, record.cluster_address or record.address) for record in response.nodes]

    async def node_heartbeat(
        self, node: str, disk: DiskReport = NO_DISK_REPORT, memory: MemoryReport = NO_MEMORY_REPORT
    ) -> bool:
        """Prove `node` alive and report its disk and memory (what a report leaves as None is not sent);
        returns whether the coordinator has `node` draining."""
        request = coordinator_pb2.NodeHeartbeatRequest(
            node=node,
            disk_free_bytes=disk.free_bytes,
            disk_free_limit_bytes=disk.limit_bytes,
            disk_alarm=disk.alarm,
            memory_used_bytes=memory.used_bytes,
            memory_high_watermark_bytes=memory.watermark_bytes,
            memory_alarm=memory.alarm,
        )
        response = await self._call(lambda stub: stub.NodeHeartbeat, request)
        return response.draining

    async def cluster_status(self) -> cluster_pb2.ClusterStatusResponse:
        return await self.call_admin(lambda stub: stub.ClusterStatus, cluster_pb2.ClusterStatusRequest())

    async def declare_queue(self, queue: QueueRecord, preferred_master: str = "") -> QueueRecord:
        request = coordinator_pb2.DeclareQueueRequest(
            vhost=queue.vhost,
            name=queue.name,
            durable=queue.durable,
            auto_delete=queue.auto_delete,
            exclusive_owner=queue.exclusive_owner,
            arguments=dict(queue.arguments),
            preferred_master=preferred_master,
        )
        response = await self._call(lambda stub: stub.DeclareQueue, request)
        return queue_from_proto(response.queue)

    async def get_queue(self, vhost: str, name: str) -> QueueRecord:
        """The queue record; grpc.aio.AioRpcError NOT_FOUND if absent."""
        response = await self._call(lambda stub: stub.GetQueue, coordinator_pb2.GetQueueRequest(vhost=vhost, name=name))
        return queue_from_proto(response.queue)

    async def list_queues(self, vhost: str = "") -> list[QueueRecord]:
        response = await self.call_admin(lambda stub: stub.ListQueues, cluster_pb2.ListQueuesRequest(vhost=vhost))
        return [queue_from_proto(q) for q in response.queues]

    async def update_queue(self, queue: QueueRecord, expected_version: int) -> QueueRecord:
        """Compare-and-set; grpc.aio.AioRpcError ABORTED on a conflict."""
        request = coordinator_pb2.UpdateQueueRequest(queue=queue_to_proto(queue), expected_version=expected_version)
        response = await self._call(lambda stub: stub.UpdateQueue, request)
        return queue_from_proto(response.queue)

    async def delete_queue(self, vhost: str, name: str, expected_version: int = 0) -> None:
        """Delete the record (only at `expected_version` unless 0: ABORTED on a conflict; NOT_FOUND if absent)."""
        request = coordinator_pb2.DeleteQueueRequest(vhost=vhost, name=name, expected_version=expected_version)
        await self._call(lambda stub: stub.DeleteQueue, request)

    async def watch(self, kinds: Sequence[str], after_revision: int) -> AsyncIterator[coordinator_pb2.WatchResponse]:
        """Changes of `kinds` after `after_revision`, from the current coordinator. The
        stream ends with an error if that coordinator goes; the next call goes elsewhere."""
        request = coordinator_pb2.WatchRequest(kinds=kinds, after_revision=after_revision)
        try:
            async for event in self._stub().Watch(request):
                yield event
        except grpc.aio.AioRpcError as error:
            if _retryable(error):
                self._current = (self._current + 1) % len(self.addresses)
            raise

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def call(
        self, method: Callable[[Stub], grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]], request: _Req
    ) -> _Resp:
        """Any unary CoordinatorService RPC (`lambda stub: stub.Method`), retried across coordinators
        like the rest."""
        return await self._call(method, request)

    async def call_admin(
        self, method: Callable[[AdminStub], grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]], request: _Req
    ) -> _Resp:
        """Any AdminService RPC of the coordinator (`lambda stub: stub.Method`), retried alike."""
        return await self._retried(lambda: method(self._admin_stub()), request)

    async def _call(
        self, method: Callable[[Stub], grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]], request: _Req
    ) -> _Resp:
        return await self._retried(lambda: method(self._stub()), request)

    async def _retried(
        self, method: Callable[[], grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp]], request: _Req
    ) -> _Resp:
        """`method()(request)`, `method` asked again on each attempt (for the stub of the coordinator
        the attempt goes to)."""
        async for attempt in _retry_policy(self._retry_seconds):
            with attempt:
                try:
                    return await method()(request, timeout=self._timeout)
                except grpc.aio.AioRpcError as error:
                    if _retryable(error):
                        self._current = (self._current + 1) % len(self.addresses)
                    raise
        raise AssertionError("unreachable: the retry policy reraises the last error")
