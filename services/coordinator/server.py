"""The coordinator's gRPC service: CoordinatorService over a `Store`.

Validates every request (INVALID_ARGUMENT names the offending field), then runs
the store call in a worker thread so the event loop never blocks on SQLite.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import re
import signal
from typing import Any

import grpc

from ringq.v1 import coordinator_pb2, coordinator_pb2_grpc, group_table_pb2
from services.coordinator.convert import ChangeRequest, change_from_request, group_to_proto, outcome_to_proto
from services.coordinator.store import SqliteStore, Store

log = logging.getLogger(__name__)

MAX_GROUP_NAME = 200
_GROUP_NAME = re.compile(r"[A-Za-z0-9._:-]+")
_SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name
_Context = grpc.aio.ServicerContext[Any, Any]


def group_name_problem(name: str) -> str | None:
    """Why `name` is not a valid group name, or None."""
    if not name:
        return "group must not be empty"
    if len(name) > MAX_GROUP_NAME:
        return f"group must be at most {MAX_GROUP_NAME} characters, got {len(name)}"
    if not _GROUP_NAME.fullmatch(name):
        return f"group may contain only letters, digits and . _ : - (got {name!r})"
    return None


def _empty(field: str, value: str) -> str | None:
    return f"{field} must not be empty" if not value else None


def _new_member(field: str, member: group_table_pb2.GroupMember) -> str | None:
    if not member.alive:
        return f"{field}.alive must be true"
    return _empty(f"{field}.id", member.id) or _empty(f"{field}.node", member.node)


def change_problem(request: ChangeRequest) -> str | None:
    """Why `request` is not a valid group change, or None."""
    if problem := group_name_problem(request.group):
        return problem
    if isinstance(request, coordinator_pb2.CreateGroupRequest):
        return _new_member("creator", request.creator)
    if isinstance(request, coordinator_pb2.AddMemberRequest):
        return _empty("left", request.left) or _new_member("newcomer", request.newcomer)
    if isinstance(request, coordinator_pb2.MarkMemberDeadRequest):
        return _empty("member", request.member)  # an empty actor is a joiner reporting its left
    if not request.members:
        return "members must name at least one member"
    return next((f"members[{i}] must not be empty" for i, m in enumerate(request.members) if not m), None)


async def _reject(context: _Context, problem: str | None) -> None:
    if problem is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Serves the group table and the node registry held by a `Store`."""

    def __init__(self, store: Store) -> None:
        self._store = store

    async def ReadGroup(
        self, request: coordinator_pb2.ReadGroupRequest, context: _Context
    ) -> coordinator_pb2.ReadGroupResponse:
        await _reject(context, group_name_problem(request.group))
        group = await asyncio.to_thread(self._store.read_group, request.group)
        return coordinator_pb2.ReadGroupResponse(group=group_to_proto(group))

    async def CreateGroup(
        self, request: coordinator_pb2.CreateGroupRequest, context: _Context
    ) -> coordinator_pb2.GroupChangeResponse:
        return await self._change(request, context)

    async def AddMember(
        self, request: coordinator_pb2.AddMemberRequest, context: _Context
    ) -> coordinator_pb2.GroupChangeResponse:
        return await self._change(request, context)

    async def MarkMemberDead(
        self, request: coordinator_pb2.MarkMemberDeadRequest, context: _Context
    ) -> coordinator_pb2.GroupChangeResponse:
        return await self._change(request, context)

    async def EraseMembers(
        self, request: coordinator_pb2.EraseMembersRequest, context: _Context
    ) -> coordinator_pb2.GroupChangeResponse:
        return await self._change(request, context)

    async def RegisterNode(
        self, request: coordinator_pb2.RegisterNodeRequest, context: _Context
    ) -> coordinator_pb2.RegisterNodeResponse:
        await _reject(context, _empty("node", request.node) or _empty("address", request.address))
        await asyncio.to_thread(self._store.register_node, request.node, request.address)
        return coordinator_pb2.RegisterNodeResponse()

    async def ListNodes(
        self, request: coordinator_pb2.ListNodesRequest, context: _Context
    ) -> coordinator_pb2.ListNodesResponse:
        nodes = await asyncio.to_thread(self._store.list_nodes)
        records = [coordinator_pb2.NodeRecord(node=node, address=address) for node, address in nodes]
        return coordinator_pb2.ListNodesResponse(nodes=records)

    async def _change(self, request: ChangeRequest, context: _Context) -> coordinator_pb2.GroupChangeResponse:
        await _reject(context, change_problem(request))
        name, change = change_from_request(request)
        outcome, group = await asyncio.to_thread(self._store.change_group, name, change)
        return coordinator_pb2.GroupChangeResponse(outcome=outcome_to_proto(outcome), group=group_to_proto(group))


async def create_server(address: str, store: Store) -> tuple[grpc.aio.Server, int]:
    """Start serving `store` on `address` (port 0 picks a free port); returns the server and its port."""
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(CoordinatorServicer(store), server)
    await _add_health_service(server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, port


async def _add_health_service(server: grpc.aio.Server) -> None:
    """Serve grpc.health.v1 when grpcio-health-checking is installed (it is optional)."""
    try:
        health = importlib.import_module("grpc_health.v1.health")
        health_pb2 = importlib.import_module("grpc_health.v1.health_pb2")
        health_pb2_grpc = importlib.import_module("grpc_health.v1.health_pb2_grpc")
    except ImportError:
        return
    servicer = health.aio.HealthServicer()
    for service in ("", _SERVICE):
        await servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


async def serve(listen: str, db_path: str, ready_file: str | None = None) -> None:
    """Serve the store at `db_path` on `listen` until SIGTERM or SIGINT, then stop with a 1 s grace."""
    store = SqliteStore(db_path)
    try:
        server, port = await create_server(listen, store)
        try:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            bound = f"{listen.rsplit(':', 1)[0]}:{port}"
            log.info("coordinator listening on %s (db %s)", bound, db_path)
            if ready_file is not None:
                _write_atomically(ready_file, bound)
            await stop.wait()
            log.info("coordinator stopping")
        finally:
            await server.stop(1.0)
    finally:
        store.close()


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
