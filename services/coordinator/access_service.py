"""Users, vhosts and permissions on the coordinator (access_records.py): AdminService's access methods,
and CoordinatorService's ReadAccess.

Responsible for: validating each request (INVALID_ARGUMENT names the field), hashing passwords with
Argon2id in a worker thread before anything is stored, and answering nodes' ReadAccess with every
user (hash included), vhost and permission. Guarantees: no response but ReadAccess, which only
cluster members can call, carries a password hash; no password is stored or logged.
"""

from __future__ import annotations

from typing import Any

import grpc

from ringq.internal.v1 import coordinator_pb2
from ringq.v1 import access_pb2
from services.access import Permission
from services.coordinator import access_records
from services.coordinator.metadata_service import require, run_store
from services.coordinator.store import Store
from services.passwords import hash_password, password_problem

_Context = grpc.aio.ServicerContext[Any, Any]


def permission_to_proto(permission: Permission) -> access_pb2.Permission:
    return access_pb2.Permission(
        user=permission.user,
        vhost=permission.vhost,
        configure=permission.configure,
        write=permission.write,
        read=permission.read,
    )


async def _password(context: _Context, password: str) -> str:
    """The hash of a valid `password` (INVALID_ARGUMENT otherwise); "" for no password, with which the
    user can log in only with a client certificate (RabbitMQ's passwordless users)."""
    if not password:
        return ""
    if (problem := password_problem(password)) is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    return await run_store(context, hash_password, password)


class AccessRpcs:
    """Needs `_store`."""

    _store: Store

    async def AddUser(self, request: access_pb2.AddUserRequest, context: _Context) -> access_pb2.AddUserResponse:
        await require(context, name=request.name)
        password_hash = await _password(context, request.password)
        await run_store(context, access_records.add_user, self._store, request.name, password_hash, request.tags)
        return access_pb2.AddUserResponse()

    async def DeleteUser(
        self, request: access_pb2.DeleteUserRequest, context: _Context
    ) -> access_pb2.DeleteUserResponse:
        await require(context, name=request.name)
        await run_store(context, access_records.delete_user, self._store, request.name)
        return access_pb2.DeleteUserResponse()

    async def ChangePassword(
        self, request: access_pb2.ChangePasswordRequest, context: _Context
    ) -> access_pb2.ChangePasswordResponse:
        await require(context, name=request.name)
        password_hash = await _password(context, request.password)
        await run_store(context, access_records.change_password, self._store, request.name, password_hash)
        return access_pb2.ChangePasswordResponse()

    async def ListUsers(self, request: access_pb2.ListUsersRequest, context: _Context) -> access_pb2.ListUsersResponse:
        users = await run_store(context, access_records.list_users, self._store)
        return access_pb2.ListUsersResponse(
            users=[access_pb2.UserInfo(name=user.name, tags=sorted(user.tags)) for user in users]
        )

    async def AddVhost(self, request: access_pb2.AddVhostRequest, context: _Context) -> access_pb2.AddVhostResponse:
        await require(context, name=request.name)
        await run_store(context, access_records.add_vhost, self._store, request.name)
        return access_pb2.AddVhostResponse()

    async def DeleteVhost(
        self, request: access_pb2.DeleteVhostRequest, context: _Context
    ) -> access_pb2.DeleteVhostResponse:
        await require(context, name=request.name)
        await run_store(context, access_records.delete_vhost, self._store, request.name)
        return access_pb2.DeleteVhostResponse()

    async def ListVhosts(
        self, request: access_pb2.ListVhostsRequest, context: _Context
    ) -> access_pb2.ListVhostsResponse:
        return access_pb2.ListVhostsResponse(vhosts=await run_store(context, access_records.list_vhosts, self._store))

    async def SetPermissions(
        self, request: access_pb2.SetPermissionsRequest, context: _Context
    ) -> access_pb2.SetPermissionsResponse:
        given = request.permission
        await require(context, user=given.user, vhost=given.vhost)
        permission = Permission(given.user, given.vhost, given.configure, given.write, given.read)
        await run_store(context, access_records.set_permissions, self._store, permission)
        return access_pb2.SetPermissionsResponse()

    async def ClearPermissions(
        self, request: access_pb2.ClearPermissionsRequest, context: _Context
    ) -> access_pb2.ClearPermissionsResponse:
        await require(context, user=request.user, vhost=request.vhost)
        await run_store(context, access_records.clear_permissions, self._store, request.user, request.vhost)
        return access_pb2.ClearPermissionsResponse()

    async def ListPermissions(
        self, request: access_pb2.ListPermissionsRequest, context: _Context
    ) -> access_pb2.ListPermissionsResponse:
        found = await run_store(
            context, access_records.list_permissions, self._store, vhost=request.vhost, user=request.user
        )
        return access_pb2.ListPermissionsResponse(permissions=[permission_to_proto(p) for p in found])

    async def ReadAccess(
        self, request: coordinator_pb2.ReadAccessRequest, context: _Context
    ) -> coordinator_pb2.ReadAccessResponse:
        def read() -> tuple[list[Any], list[str], list[Permission]]:
            store = self._store
            users = access_records.list_users(store)
            return users, access_records.list_vhosts(store), access_records.list_permissions(store)

        users, vhosts, permissions = await run_store(context, read)
        return coordinator_pb2.ReadAccessResponse(
            users=[
                coordinator_pb2.StoredUser(name=u.name, password_hash=u.password_hash, tags=sorted(u.tags))
                for u in users
            ],
            vhosts=vhosts,
            permissions=[permission_to_proto(p) for p in permissions],
        )
