"""AdminService on a broker node: administration for clients, answered from the coordinator.

Responsible for: serving ringqctl and the SDKs' Admin on the node's client port, passing each
request to the coordinator (with the node's own identity over the cluster's mutual TLS) and its
answer or failure back unchanged. Guarantees: a client administers the cluster without reaching
the coordinator, whose port serves only cluster members; a coordinator that cannot be reached
answers UNAVAILABLE (the node's CoordinatorClient retries across coordinators first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from ringq.v1 import admin_pb2_grpc, coordinator_pb2
from services.coordinator.client import CoordinatorClient

_Context = grpc.aio.ServicerContext[Any, Any]


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Each RPC is the coordinator's RPC of the same name, asked by this node."""

    def __init__(self, coordinator: CoordinatorClient) -> None:
        self.coordinator = coordinator

    async def _forward(self, method: Callable[[Any], Any], request: Any, context: _Context) -> Any:
        try:
            return await self.coordinator.call(method, request)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")

    async def ClusterStatus(
        self, request: coordinator_pb2.ClusterStatusRequest, context: _Context
    ) -> coordinator_pb2.ClusterStatusResponse:
        return await self._forward(lambda stub: stub.ClusterStatus, request, context)  # type: ignore[no-any-return]

    async def SetNodeDraining(
        self, request: coordinator_pb2.SetNodeDrainingRequest, context: _Context
    ) -> coordinator_pb2.SetNodeDrainingResponse:
        return await self._forward(lambda stub: stub.SetNodeDraining, request, context)  # type: ignore[no-any-return]

    async def SetPolicy(
        self, request: coordinator_pb2.SetPolicyRequest, context: _Context
    ) -> coordinator_pb2.SetPolicyResponse:
        return await self._forward(lambda stub: stub.SetPolicy, request, context)  # type: ignore[no-any-return]

    async def ClearPolicy(
        self, request: coordinator_pb2.ClearPolicyRequest, context: _Context
    ) -> coordinator_pb2.ClearPolicyResponse:
        return await self._forward(lambda stub: stub.ClearPolicy, request, context)  # type: ignore[no-any-return]

    async def ListPolicies(
        self, request: coordinator_pb2.ListPoliciesRequest, context: _Context
    ) -> coordinator_pb2.ListPoliciesResponse:
        return await self._forward(lambda stub: stub.ListPolicies, request, context)  # type: ignore[no-any-return]

    async def ListQueues(
        self, request: coordinator_pb2.ListQueuesRequest, context: _Context
    ) -> coordinator_pb2.ListQueuesResponse:
        return await self._forward(lambda stub: stub.ListQueues, request, context)  # type: ignore[no-any-return]

    async def ListLeases(
        self, request: coordinator_pb2.ListLeasesRequest, context: _Context
    ) -> coordinator_pb2.ListLeasesResponse:
        return await self._forward(lambda stub: stub.ListLeases, request, context)  # type: ignore[no-any-return]
