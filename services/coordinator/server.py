"""The coordinator's gRPC services over a `Store`: CoordinatorService and ringq.v1.AdminService.

One servicer serves both on the coordinator's port, which with TLS admits only cluster members:
nodes call CoordinatorService for themselves, and forward their clients' AdminService calls here
unchanged (services/admin_service.py). Validates every request (INVALID_ARGUMENT names the
offending field), then runs the store call (services/coordinator/records.py) in a worker thread so the
event loop never blocks on SQLite or ZooKeeper. A store that cannot be reached
(StoreUnavailable) answers UNAVAILABLE, which CoordinatorClient retries.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, TypeVar

import grpc

from ringq.internal.v1 import coordinator_pb2, coordinator_pb2_grpc, group_table_pb2
from ringq.keepalive import SERVER_KEEPALIVE
from ringq.v1 import admin_pb2, admin_pb2_grpc
from services.access import GUEST
from services.coordinator import access_records, metadata, records
from services.coordinator.access_service import AccessRpcs
from services.coordinator.convert import (
    ChangeRequest,
    change_from_request,
    group_to_proto,
    node_to_proto,
    outcome_to_proto,
)
from services.coordinator.group_table import CreateGroup, GroupChange, actor_of, member_node
from services.coordinator.metadata_service import COORDINATOR, MetadataRpcs, PolicyPasses, act_for, now_ms
from services.coordinator.placement_trigger import PlacementTrigger, RecordChange
from services.coordinator.sqlite_store import SqliteStore
from services.coordinator.store import MAX_KEY_LENGTH, Store, StoreUnavailable
from services.coordinator.stream_service import StreamRecordRpcs, keep_stream_lists
from services.coordinator.watch import ChangeFeed, NudgingStore, Resync
from services.event_waits import event_or_timeout
from services.health import Health
from services.passwords import hash_password
from services.request_guard import SERVER_OPTIONS as GUARDED_SERVER_OPTIONS
from services.request_guard import RequestGuard
from services.tls import ClusterTLS, member_problem

log = logging.getLogger(__name__)

MAX_GROUP_NAME = 200
_GROUP_NAME = re.compile(r"[A-Za-z0-9._:-]+")
_SERVICES = (
    coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
)
_Context = grpc.aio.ServicerContext[Any, Any]
_P = ParamSpec("_P")
_T = TypeVar("_T")
StoreKind = Literal["sqlite", "zookeeper"]
DEFAULT_LIVENESS_MS = 5000
# The most group tables a ListGroups answer holds (about 250 bytes each with three members).
GROUPS_PAGE = 1000
# Queues one vhost may have (RabbitMQ's max-queues vhost limit): each costs every replica's node memory.
DEFAULT_MAX_QUEUES_PER_VHOST = 20_000


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


def _key(field: str, value: str) -> str | None:
    """Why `value` cannot be a store key (node ids are keys), or None."""
    if problem := _empty(field, value):
        return problem
    if len(value) > MAX_KEY_LENGTH:
        return f"{field} must be at most {MAX_KEY_LENGTH} characters, got {len(value)}"
    if not value.isprintable():
        return f"{field} must be printable, got {value!r}"
    return None


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
        return _empty("member", request.member) or _empty("actor", request.actor)
    if problem := _empty("actor", request.actor):
        return problem
    if not request.members:
        return "members must name at least one member"
    return next((f"members[{i}] must not be empty" for i, m in enumerate(request.members) if not m), None)


async def _reject(context: _Context, problem: str | None) -> None:
    if problem is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)


def _acting_node(change: GroupChange) -> str:
    """The node a group change speaks for: the creator's, or the node hosting the acting member."""
    if isinstance(change, CreateGroup):
        return change.creator.node
    return member_node(actor_of(change))


class CoordinatorServicer(
    MetadataRpcs,
    AccessRpcs,
    StreamRecordRpcs,
    coordinator_pb2_grpc.CoordinatorServiceServicer,
    admin_pb2_grpc.AdminServiceServicer,
):
    """Serves everything held by a `Store`, as CoordinatorService and AdminService (no method name is
    in both): group tables and nodes here, users, vhosts and permissions in AccessRpcs, the rest in
    MetadataRpcs."""

    def __init__(
        self,
        store: Store,
        feed: ChangeFeed,
        liveness_ms: int = DEFAULT_LIVENESS_MS,
        passes: PolicyPasses | None = None,
        max_queues_per_vhost: int = DEFAULT_MAX_QUEUES_PER_VHOST,
    ) -> None:
        self._max_queues_per_vhost = max_queues_per_vhost
        self._load_cache = metadata.ReplicaLoadCache()
        self._passes = passes if passes is not None else PolicyPasses()
        self._store = store
        self._feed = feed
        self._liveness_ms = liveness_ms

    async def ReadGroup(
        self, request: coordinator_pb2.ReadGroupRequest, context: _Context
    ) -> coordinator_pb2.ReadGroupResponse:
        await _reject(context, group_name_problem(request.group))
        group = await _run(context, records.read_group, self._store, request.group)
        return coordinator_pb2.ReadGroupResponse(group=group_to_proto(group))

    async def ListGroups(
        self, request: coordinator_pb2.ListGroupsRequest, context: _Context
    ) -> coordinator_pb2.ListGroupsResponse:
        await _reject(
            context,
            (_key("node", request.node) if request.node else None)
            or (f"after: {problem}" if request.after and (problem := group_name_problem(request.after)) else None),
        )
        limit = min(request.limit or GROUPS_PAGE, GROUPS_PAGE)
        groups, next_after = await _run(context, records.list_groups, self._store, request.node, request.after, limit)
        return coordinator_pb2.ListGroupsResponse(groups=[group_to_proto(g) for g in groups], next_after=next_after)

    async def CreateGroup(
        self, request: coordinator_pb2.CreateGroupRequest, context: _Context
    ) -> coordinator_pb2.CreateGroupResponse:
        outcome, group = await self._change(request, context)
        return coordinator_pb2.CreateGroupResponse(outcome=outcome, group=group)

    async def AddMember(
        self, request: coordinator_pb2.AddMemberRequest, context: _Context
    ) -> coordinator_pb2.AddMemberResponse:
        outcome, group = await self._change(request, context)
        return coordinator_pb2.AddMemberResponse(outcome=outcome, group=group)

    async def MarkMemberDead(
        self, request: coordinator_pb2.MarkMemberDeadRequest, context: _Context
    ) -> coordinator_pb2.MarkMemberDeadResponse:
        outcome, group = await self._change(request, context)
        return coordinator_pb2.MarkMemberDeadResponse(outcome=outcome, group=group)

    async def EraseMembers(
        self, request: coordinator_pb2.EraseMembersRequest, context: _Context
    ) -> coordinator_pb2.EraseMembersResponse:
        outcome, group = await self._change(request, context)
        return coordinator_pb2.EraseMembersResponse(outcome=outcome, group=group)

    async def RegisterNode(
        self, request: coordinator_pb2.RegisterNodeRequest, context: _Context
    ) -> coordinator_pb2.RegisterNodeResponse:
        await act_for(context, request.node)
        await _reject(
            context,
            _key("node", request.node)
            or _key("address", request.address)
            or (_key("cluster_address", request.cluster_address) if request.cluster_address else None)
            or (_key("certificate_address", request.certificate_address) if request.certificate_address else None),
        )
        await _run(
            context,
            records.register_node,
            self._store,
            request.node,
            request.address,
            request.cluster_address,
            request.certificate_address,
        )
        return coordinator_pb2.RegisterNodeResponse()

    async def ListNodes(
        self, request: coordinator_pb2.ListNodesRequest, context: _Context
    ) -> coordinator_pb2.ListNodesResponse:
        nodes = await _run(context, records.list_nodes, self._store)
        return coordinator_pb2.ListNodesResponse(
            nodes=[node_to_proto(n, self._alive(n.last_heartbeat_unix_ms)) for n in nodes]
        )

    async def _change(
        self, request: ChangeRequest, context: _Context
    ) -> tuple[coordinator_pb2.GroupChangeOutcome.ValueType, group_table_pb2.Group]:
        """The outcome of a group change and the group after it, as every group change answers them."""
        await _reject(context, change_problem(request))
        name, change = change_from_request(request)
        await act_for(context, _acting_node(change))
        outcome, group = await _run(context, records.change_group, self._store, name, change)
        return outcome_to_proto(outcome), group_to_proto(group)


async def _run(context: _Context, call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`call` in a worker thread; a store that cannot be reached answers UNAVAILABLE."""
    try:
        return await asyncio.to_thread(call, *args, **kwargs)
    except StoreUnavailable as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"the coordinator's store is unavailable: {exc}")
        raise  # abort raises; this keeps type checkers informed


def open_store(
    kind: StoreKind = "sqlite",
    *,
    db_path: str | None = None,
    zookeeper_hosts: str | None = None,
    zookeeper_root: str = "/ringq",
) -> Store:
    """Open the store the coordinator serves (blocking; ZooKeeper: StoreUnavailable if unreachable)."""
    if kind == "sqlite":
        if db_path is None:
            raise ValueError("the sqlite store needs db_path")
        return SqliteStore(db_path)
    if kind == "zookeeper":
        if zookeeper_hosts is None:
            raise ValueError("the zookeeper store needs zookeeper_hosts")
        from services.coordinator.zookeeper_store import ZooKeeperStore  # kazoo is needed only here

        return ZooKeeperStore(zookeeper_hosts, zookeeper_root)
    raise ValueError(f"unknown store kind {kind!r}")


async def create_server(
    address: str,
    store: Store,
    *,
    liveness_ms: int = DEFAULT_LIVENESS_MS,
    tls: ClusterTLS | None = None,
    default_user: tuple[str, str] = (GUEST, GUEST),
    max_queues_per_vhost: int = DEFAULT_MAX_QUEUES_PER_VHOST,
    health: Health | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start serving `store` on `address` (port 0 picks a free port); returns the server and its port.

    With `tls`, only cluster members (nodes and coordinators with certificates of the cluster CA)
    are served, whichever the service, and a node acts only for itself; the gRPC health service
    (`health`, or one of its own) answers anyone.

    Also starts, for the life of the event loop, the change feed behind Watch
    and this coordinator's registration (so cluster_status lists it), whose outcome is the health
    status: SERVING while the registration reaches the store, NOT_SERVING while it cannot.
    """
    server = grpc.aio.server(
        options=[*SERVER_KEEPALIVE, *GUARDED_SERVER_OPTIONS], interceptors=[RequestGuard(admit=member_problem)]
    )
    user, password = default_user
    if await asyncio.to_thread(access_records.seed, store, hash_password, user, password):
        only = " (accepted from loopback only)" if user == GUEST else ""
        log.info("first start: made the vhost / and the administrator %r%s", user, only)
    feed = ChangeFeed(store)
    await feed.start()
    store = NudgingStore(store, feed, asyncio.get_running_loop())  # writes made here are watched at once
    passes = PolicyPasses()
    servicer = CoordinatorServicer(store, feed, liveness_ms, passes, max_queues_per_vhost)
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(servicer, server)
    health = health if health is not None else await Health.create(_SERVICES)
    health.add_to(server)
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.cluster_server_credentials())
    except RuntimeError as error:  # grpc's way of saying the port is taken
        raise OSError(f"cannot listen on {address}: {error}") from None
    await server.start()
    advertised = f"{address.rsplit(':', 1)[0]}:{port}"
    feed.watch_peers(COORDINATOR, advertised, liveness_ms / 1000)  # registrations refresh 3 times in it
    _background.add(asyncio.ensure_future(_register_coordinator(store, advertised, liveness_ms, health)))
    _background.add(asyncio.ensure_future(_keep_queues_placed(store, feed, liveness_ms, passes)))
    _background.add(asyncio.ensure_future(keep_stream_lists(store, feed, liveness_ms)))
    return server, port


_background: set[asyncio.Future[None]] = set()


async def stop_upkeep() -> None:
    """Stop the upkeep `create_server` started in this event loop (registration, placement, stream
    lists) and wait until it has: after the server stops, before its store closes (else the loops
    meet a closed store and log errors until the loop ends)."""
    loop = asyncio.get_running_loop()
    tasks = [task for task in _background if task.get_loop() is loop]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    _background.difference_update(tasks)


async def _register_coordinator(store: Store, address: str, liveness_ms: int, health: Health) -> None:
    """Refresh this coordinator's registration a few times per liveness timeout; report SERVING while
    that reaches the store and NOT_SERVING while it cannot (ZooKeeper unreachable or without quorum)."""
    while True:
        try:
            await asyncio.to_thread(_refresh_registration, store, address)
        except StoreUnavailable as error:
            log.warning("cannot refresh the coordinator's registration: %s", error)
            await health.set_serving(False)
        else:
            await health.set_serving(True)
        await asyncio.sleep(liveness_ms / 3000)


async def _keep_queues_placed(store: Store, feed: ChangeFeed, liveness_ms: int, passes: PolicyPasses) -> None:
    """Policies applied live: re-place every queue when the placeable nodes change (a node joins,
    comes back, dies or drains), when queue records change (a master struck a mirror, a mirror was
    promoted), and when a struck node proves itself alive: services/coordinator/placement_trigger.py
    decides when. So ha-mode all gains a new node, exactly-N replaces a lost mirror on another node,
    and a mirror struck from a node that stayed alive comes back. Masters are left to the queues
    (metadata.place_queues). The placeable nodes are checked a few times per liveness timeout;
    queue record changes wake the loop at once. The next pass waits at least as long as the last
    one took, so passes take at most half of the coordinator's time however fast records change."""
    trigger = PlacementTrigger()
    woken = asyncio.Event()
    _background.add(asyncio.ensure_future(_follow_queue_records(feed, trigger, woken, liveness_ms)))
    tick_seconds = liveness_ms / 3000
    while True:
        await event_or_timeout(woken, tick_seconds)
        woken.clear()
        try:
            elapsed_seconds = await _place_if_due(store, trigger, liveness_ms, passes)
        except (StoreUnavailable, metadata.Conflict) as error:
            trigger.pass_failed()
            log.warning("cannot re-place queues yet: %s", error)
        except Exception:  # a bug must not stop placement for good: say so, and try again
            trigger.pass_failed()
            log.exception("placement pass failed")
        else:
            await asyncio.sleep(min(elapsed_seconds, tick_seconds))


async def _place_if_due(store: Store, trigger: PlacementTrigger, liveness_ms: int, passes: PolicyPasses) -> float:
    """One placement pass if `trigger` says one is due; returns how long it took (0: none ran)."""
    nodes = await asyncio.to_thread(records.list_nodes, store)
    live = records.placeable(nodes, liveness_ms, now_ms())
    heartbeats = {n.node: n.last_heartbeat_unix_ms for n in nodes if n.last_heartbeat_unix_ms is not None}
    if not trigger.due(live, heartbeats):
        return 0.0
    start = trigger.pass_starting(live, heartbeats)
    unproven = start.unproven
    started, started_unix_ms = time.monotonic(), now_ms()
    strikes_seen: set[str] = set()  # filled on the pass's thread, read once the pass is over

    def unseen_strikes(queue: metadata.QueueRecord) -> frozenset[str]:
        struck = start.unseen_strikes(queue.key, queue.version, queue.replicas)
        strikes_seen.update(struck)
        return struck

    done = await passes.run(lambda: metadata.place_queues(store, "", live, unproven, unseen_strikes))
    trigger.strikes_seen_by_pass(strikes_seen, started_unix_ms)
    trigger.pass_finished(live, {key: (queue.version, queue.replicas) for key, queue in done.queues.items()})
    if done.written:
        struck = sorted({*unproven, *strikes_seen})
        waiting = f" ({', '.join(struck)} not heard from since struck)" if struck else ""
        log.info("nodes %s%s: %d queue(s) re-placed", ", ".join(live), waiting, len(done.written))
    return time.monotonic() - started


async def _follow_queue_records(
    feed: ChangeFeed, trigger: PlacementTrigger, woken: asyncio.Event, liveness_ms: int
) -> None:
    """Hand every queue record change of the store's change log to `trigger`, and wake the placer."""
    while True:
        try:
            async for item in feed.watch(frozenset({metadata.QUEUE})):
                if isinstance(item, Resync):
                    trigger.records_missed()
                elif item.record is None:
                    trigger.record_changed(RecordChange(item.key, 0, None, now_ms()))
                else:
                    replicas = metadata.queue_from_record(item.record).replicas
                    trigger.record_changed(RecordChange(item.key, item.record.version, replicas, now_ms()))
                woken.set()
        except Exception as error:  # StoreUnavailable, or a record this coordinator cannot read
            log.warning("following queue record changes: %r; re-placing every queue", error)
            trigger.records_missed()
            woken.set()
            await asyncio.sleep(liveness_ms / 3000)


def _refresh_registration(store: Store, address: str) -> None:
    current = store.get(COORDINATOR, address)
    store.put(COORDINATOR, address, {"at_unix_ms": now_ms()}, current.version if current else 0)


async def serve(
    listen: str,
    db_path: str | None = None,
    ready_file: str | None = None,
    *,
    store_kind: StoreKind = "sqlite",
    zookeeper_hosts: str | None = None,
    zookeeper_root: str = "/ringq",
    tls: ClusterTLS | None = None,
    default_user: tuple[str, str] = (GUEST, GUEST),
    max_queues_per_vhost: int = DEFAULT_MAX_QUEUES_PER_VHOST,
    health_listen: str | None = None,
) -> None:
    """Serve a store on `listen` until SIGTERM or SIGINT, then stop with a 1 s grace.

    The store is the SQLite file `db_path` (store_kind "sqlite") or the znodes under
    `zookeeper_root` of the ensemble `zookeeper_hosts` (store_kind "zookeeper"). With `health_listen`,
    the gRPC health service alone is served there in plaintext from the start (NOT_SERVING until the
    store is open and the coordinator serves).
    """
    health = await Health.create(_SERVICES)
    health_server: grpc.aio.Server | None = None
    if health_listen is not None:
        health_server, health_port = await health.listen(health_listen)
        bound_health = f"{health_listen.rsplit(':', 1)[0]}:{health_port}"
        log.info("coordinator serving its health alone, in plaintext, on %s", bound_health)
    try:
        store = await asyncio.to_thread(
            open_store, store_kind, db_path=db_path, zookeeper_hosts=zookeeper_hosts, zookeeper_root=zookeeper_root
        )
        where = f"db {db_path}" if store_kind == "sqlite" else f"zookeeper {zookeeper_hosts} {zookeeper_root}"
        try:
            server, port = await create_server(
                listen,
                store,
                tls=tls,
                default_user=default_user,
                max_queues_per_vhost=max_queues_per_vhost,
                health=health,
            )
            try:
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, stop.set)
                bound = f"{listen.rsplit(':', 1)[0]}:{port}"
                log.info("coordinator listening on %s (%s, %s)", bound, where, "mutual TLS" if tls else "plaintext")
                if ready_file is not None:
                    _write_atomically(ready_file, bound)
                await stop.wait()
                log.info("coordinator stopping")
                await health.shutting_down()
            finally:
                await server.stop(1.0)
                await stop_upkeep()
        finally:
            store.close()
    finally:
        if health_server is not None:
            await health_server.stop(None)


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
