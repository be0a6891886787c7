"""A node's enforcement of users and permissions (services/access.py) on every public call.

Responsible for: keeping the node's copy of the access table fresh (read from the coordinator at
start, again whenever its Watch reports a change of a user, vhost or permission, or a resync);
finding who makes a call; refusing calls that may not be made.

Who makes a call:
  - A client on the client port: the user of its `authorization: Basic base64(user:password)`
    metadata. Missing or wrong credentials are refused with UNAUTHENTICATED. guest is accepted only
    from a loopback address.
  - A client on the certificate port: the user its certificate (of the cluster CA) names, with no
    password (RabbitMQ's EXTERNAL mechanism); the user must exist, and guest only from loopback.
  - A node on the cluster port, proven by its certificate: it relays a client's call, naming the
    user it authenticated in `ringq-user` metadata. With no user named, the call is the node's own
    (e.g. dead-lettering) and is not restricted.

Guarantees: with TLS on, no public call reaches a queue, group or the coordinator unless its user
may make it; refusals carry PERMISSION_DENIED with the reason. A change an administrator has just
made counts at once on every node: before refusing, a node reads the table again (at most once per
RELOAD_ON_REFUSAL_SECONDS, one read shared by every call waiting on it), so a user created or granted
through one node is not refused by another whose watch has not caught up yet. Without TLS (plaintext, for
development), nothing can be proven, so nothing is enforced; the node's start-up warning says so.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from ringq.internal.v1 import coordinator_pb2
from services.access import AccessTable, Operation, Permission, User
from services.coordinator.access_records import KINDS
from services.coordinator.client import CoordinatorClient
from services.passwords import PasswordChecks
from services.request_guard import Refused
from services.tls import caller, certificate_user

log = logging.getLogger("ringq.access")

USER_METADATA = "ringq-user"  # names the user a relaying node authenticated
RELOAD_PAUSE_SECONDS = 0.2
# A refusal re-reads the table first, at most this often (a flood of bad credentials costs the
# coordinator one read per interval, not one per call).
RELOAD_ON_REFUSAL_SECONDS = 0.25
# The table is also read this often whatever the watch says: a change made between a read and the
# start of the watch that follows it (which reports changes from its start on) counts within this long.
REFRESH_SECONDS = 5.0


@dataclass(frozen=True)
class Principal:
    """Who a call acts for: a user, or (user None) the cluster itself, which is not restricted."""

    user: str | None

    def relay_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata for a call relayed on this principal's behalf to another node."""
        return ((USER_METADATA, self.user),) if self.user is not None else ()


UNRESTRICTED = Principal(None)


class AccessGuard:
    """One per node. `enforced` is whether the node runs with TLS (else nothing can be proven)."""

    def __init__(self, coordinator: CoordinatorClient | None, enforced: bool) -> None:
        self.coordinator = coordinator
        self.enforced = enforced
        self.table = AccessTable()
        self.checks = PasswordChecks()
        self._refusal_reload_at = float("-inf")
        self._reloading: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ freshness

    async def load(self) -> None:
        """Read the table now (a node serves clients only after this, so none is refused for want of it)."""
        assert self.coordinator is not None
        response = await self.coordinator.call(lambda stub: stub.ReadAccess, coordinator_pb2.ReadAccessRequest())
        self.table = AccessTable.of(
            [User(u.name, u.password_hash, frozenset(u.tags)) for u in response.users],
            response.vhosts,
            [Permission(p.user, p.vhost, p.configure, p.write, p.read) for p in response.permissions],
        )

    async def _reload_before_refusing(self) -> None:
        """Read the table again, unless a refusal made it read within RELOAD_ON_REFUSAL_SECONDS (one read at
        a time, shared); a coordinator that cannot be reached leaves the table as it was."""
        if self.coordinator is None:
            return
        if self._reloading is None or self._reloading.done():
            if time.monotonic() - self._refusal_reload_at < RELOAD_ON_REFUSAL_SECONDS:
                return
            self._refusal_reload_at = time.monotonic()
            self._reloading = asyncio.ensure_future(self.load())
        with contextlib.suppress(grpc.aio.AioRpcError):
            await asyncio.shield(self._reloading)

    async def run(self) -> None:
        """Reload after every change the coordinator reports, and every REFRESH_SECONDS, for as long as
        the node runs."""
        refresher = asyncio.ensure_future(self._refresh())
        try:
            await self._follow()
        finally:
            refresher.cancel()

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.load()

    async def _follow(self) -> None:
        assert self.coordinator is not None
        revision = 0
        while True:
            try:
                async for event in self.coordinator.watch(list(KINDS), revision):
                    revision = event.revision
                    await self.load()
            except grpc.aio.AioRpcError as error:
                log.debug("access watch interrupted: %s", error.code().name)
            await asyncio.sleep(RELOAD_PAUSE_SECONDS)
            try:
                await self.load()  # what changed while the watch was down
            except grpc.aio.AioRpcError as error:
                log.warning("cannot read users and permissions from the coordinator: %s", error.code().name)

    # ------------------------------------------------------------------ decisions

    async def principal(self, context: Any) -> Principal:
        """Who makes this call; Refused (UNAUTHENTICATED) if a client cannot say who it is."""
        if not self.enforced:
            return UNRESTRICTED
        identity = caller(context)
        if identity is not None:  # a cluster member on the cluster port
            named = _metadata(context, USER_METADATA)
            return Principal(named) if named else UNRESTRICTED
        user = certificate_user(context)
        password = None  # proven by the certificate
        if user is None:
            user, password = _basic_credentials(context)
        problem = await self._login_problem(context, user, password)
        if problem is not None:
            await self._reload_before_refusing()  # the user or password may be new
            problem = await self._login_problem(context, user, password)
        if problem is not None:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, problem)
        return Principal(user)

    async def _login_problem(self, context: Any, user: str, password: str | None) -> str | None:
        """Why `user` may not log in: with `password`, or (None) proven by a client certificate."""
        problem = self.table.login_problem(user, _from_loopback(context.peer()))
        if problem is None and password is not None:
            password_hash = self.table.users[user].password_hash
            if not password_hash or not await self.checks.check(user, password_hash, password):
                problem = "unknown user or wrong password"
        return problem

    async def permit(self, principal: Principal, vhost: str, operation: Operation, name: str) -> None:
        """Refused (PERMISSION_DENIED) unless `principal` may `operation` `name` in `vhost`."""
        user = principal.user
        if user is not None:
            await self._refuse_unless(lambda: self.table.permission_problem(user, vhost, operation, name))

    async def permit_tags(self, principal: Principal, needed: frozenset[str], what: str) -> None:
        """Refused (PERMISSION_DENIED) unless `principal` has one of the tags `needed`."""
        user = principal.user
        if user is not None:
            await self._refuse_unless(lambda: self.table.tag_problem(user, needed, what))

    async def _refuse_unless(self, problem_now: Callable[[], str | None]) -> None:
        if problem_now() is None:
            return
        await self._reload_before_refusing()  # a permission or tag may just have been granted
        problem = problem_now()
        if problem is not None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, problem)

    async def allow(self, context: Any, vhost: str, operation: Operation, name: str) -> Principal:
        """The call's principal, once it may `operation` `name` in `vhost`; aborts the call otherwise."""
        try:
            principal = await self.principal(context)
            await self.permit(principal, vhost, operation, name)
        except Refused as refusal:
            await context.abort(refusal.code, refusal.details)
        return principal

    async def allow_tags(self, context: Any, needed: frozenset[str], what: str) -> Principal:
        try:
            principal = await self.principal(context)
            await self.permit_tags(principal, needed, what)
        except Refused as refusal:
            await context.abort(refusal.code, refusal.details)
        return principal


OPEN = AccessGuard(None, enforced=False)  # for a node without TLS, and for tests of other things


def scoped_publisher(principal: Principal, publisher: str) -> str:
    """A publisher id as the queue keeps it: scoped to the user who publishes, so no other user's
    publishes can make the queue take this publisher's messages for duplicates. The separator is a
    control character, which no user name may contain, so the scope cannot be forged."""
    return publisher if principal.user is None else f"{principal.user}\x1f{publisher}"


def _metadata(context: Any, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return str(value)
    return None


def _basic_credentials(context: Any) -> tuple[str, str]:
    header = _metadata(context, "authorization")
    if header is None or not header.lower().startswith("basic "):
        raise Refused(
            grpc.StatusCode.UNAUTHENTICATED,
            "credentials needed: send 'authorization: Basic base64(user:password)' metadata",
        )
    try:
        user, separator, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        raise Refused(grpc.StatusCode.UNAUTHENTICATED, "malformed Basic credentials") from None
    if not separator or not user:
        raise Refused(grpc.StatusCode.UNAUTHENTICATED, "malformed Basic credentials: expected user:password")
    return user, password


def _from_loopback(peer: str) -> bool:
    """Whether gRPC's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") is this machine."""
    if peer.startswith("unix:"):
        return True
    host = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]") if ":" in peer else ""
    host = host.removeprefix("::ffff:")  # an IPv4 client of an IPv6 socket
    return host == "::1" or host.startswith("127.")
