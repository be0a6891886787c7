"""AdminService on a broker node: administration for clients, answered from the coordinator.

Responsible for: serving ringqctl and the SDKs' Admin on the node's client port, passing each
request to the same method of the coordinator's AdminService (asked by this node, with its identity
over the cluster's mutual TLS) and the answer or failure back unchanged. Every AdminService method is
served this way, with the service's own request and response types, so what a node serves cannot
drift from what the coordinator answers.
Guarantees: a client administers the cluster without reaching the coordinator, whose port serves only
cluster members; a coordinator that cannot be reached answers UNAVAILABLE once the node's
CoordinatorClient has tried every coordinator.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import message_factory

from ringq.v1 import admin_pb2
from services.access import ADMINISTRATION, LISTING, POLICIES
from services.access_guard import OPEN, AccessGuard
from services.coordinator.client import CoordinatorClient

ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]


# The tags a user needs for each method (services/access.py); methods not listed need administrator.
NEEDED_TAGS = {
    "ClusterStatus": LISTING,
    "ListQueues": LISTING,
    "ListPolicies": LISTING,
    "ListLeases": LISTING,
    "ListUsers": LISTING,
    "ListVhosts": LISTING,
    "ListPermissions": LISTING,
    "SetPolicy": POLICIES,
    "ClearPolicy": POLICIES,
}


def admin_handler(coordinator: CoordinatorClient, access: AccessGuard = OPEN) -> grpc.GenericRpcHandler[Any, Any]:
    """AdminService's handlers for `server.add_generic_rpc_handlers`; each checks the caller's tags first."""
    handlers = {}
    for method in ADMIN_SERVICE.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _forwarder(coordinator, access, method.name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(ADMIN_SERVICE.full_name, handlers)


def _forwarder(coordinator: CoordinatorClient, access: AccessGuard, name: str) -> Callable[[Any, Any], Awaitable[Any]]:
    needed = NEEDED_TAGS.get(name, ADMINISTRATION)

    async def forward(request: Any, context: Any) -> Any:
        await access.allow_tags(context, needed, f"call AdminService.{name}")
        try:
            return await coordinator.call_admin(lambda stub: getattr(stub, name), request)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), error.details() or "")

    return forward
