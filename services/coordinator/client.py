"""An async client of CoordinatorService that waits out coordinator outages.

UNAVAILABLE and DEADLINE_EXCEEDED are retried with exponential backoff (50 ms
doubling to 1 s) for up to `retry_seconds`; any other error is raised at once.
A retried group change is still a compare-and-set: if an earlier attempt did
land, the retry answers VERSION_CONFLICT with the group that already holds it.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self, TypeVar

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from ringq.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.convert import change_to_request, group_from_proto, outcome_from_proto
from services.coordinator.group_table import Group, GroupChange, Outcome

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


class CoordinatorClient:
    """Calls the coordinator at `address` (host:port); use from one event loop."""

    def __init__(self, address: str, *, timeout: float = 5.0, retry_seconds: float = 30.0) -> None:
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._timeout = timeout
        self._retry_seconds = retry_seconds

    async def read_group(self, name: str) -> Group:
        response = await self._call(self._stub.ReadGroup, coordinator_pb2.ReadGroupRequest(group=name))
        return group_from_proto(response.group)

    async def change_group(self, name: str, change: GroupChange) -> tuple[Outcome, Group]:
        request = change_to_request(name, change)
        if isinstance(request, coordinator_pb2.CreateGroupRequest):
            response = await self._call(self._stub.CreateGroup, request)
        elif isinstance(request, coordinator_pb2.AddMemberRequest):
            response = await self._call(self._stub.AddMember, request)
        elif isinstance(request, coordinator_pb2.MarkMemberDeadRequest):
            response = await self._call(self._stub.MarkMemberDead, request)
        else:
            response = await self._call(self._stub.EraseMembers, request)
        return outcome_from_proto(response.outcome), group_from_proto(response.group)

    async def register_node(self, node: str, address: str) -> None:
        request = coordinator_pb2.RegisterNodeRequest(node=node, address=address)
        await self._call(self._stub.RegisterNode, request)

    async def list_nodes(self) -> list[tuple[str, str]]:
        response = await self._call(self._stub.ListNodes, coordinator_pb2.ListNodesRequest())
        return [(record.node, record.address) for record in response.nodes]

    async def close(self) -> None:
        await self._channel.close(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _call(self, method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        async for attempt in _retry_policy(self._retry_seconds):
            with attempt:
                return await method(request, timeout=self._timeout)
        raise AssertionError("unreachable: the retry policy reraises the last error")
