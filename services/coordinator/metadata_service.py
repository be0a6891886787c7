"""The coordinator's metadata RPCs: nodes and liveness, cluster status, policies,
queue records, leases and Watch (mixed into server.CoordinatorServicer). Cluster
status, draining, policies and the listings of queues and leases are AdminService
methods; the rest are CoordinatorService's.

Responsible for: validating requests, running the metadata rules
(metadata.py, records.py) in a worker thread, and mapping their outcomes to
gRPC statuses: unknown records NOT_FOUND, bad policies or names
INVALID_ARGUMENT naming the key, a redeclaration that differs or a lease held
by someone else FAILED_PRECONDITION, a lost compare-and-set ABORTED (re-read
and retry), no live node to place a queue on or an unreachable store
UNAVAILABLE. Liveness: a node is alive if its last heartbeat is younger than
the liveness timeout, by the coordinator's clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, ParamSpec, TypeVar

import grpc

from ringq.internal.v1 import coordinator_pb2
from ringq.v1 import cluster_pb2
from services.coordinator import access_records, metadata, queue_arguments, records, stream_records
from services.coordinator.convert import (
    disk_report_from_heartbeat,
    group_to_proto,
    lease_to_proto,
    memory_report_from_heartbeat,
    node_to_proto,
    policy_from_proto,
    policy_to_proto,
    queue_from_proto,
    queue_to_proto,
)
from services.coordinator.forget import NodeAlive, forget_node
from services.coordinator.leases import LeaseRefused
from services.coordinator.metadata import Conflict, NotFound, QueueLimit, QueueMismatch, QueueRecord
from services.coordinator.placement import NoLiveNodes
from services.coordinator.placement_passes import PlacementPasses
from services.coordinator.policies import Policy, PolicyError
from services.coordinator.store import Change, Store, StoreUnavailable
from services.coordinator.watch import ChangeFeed, Resync
from services.tls import acting_for_problem

COORDINATOR = "coordinator"
WATCHABLE = frozenset(
    {
        records.GROUP,
        records.NODE,
        metadata.QUEUE,
        metadata.POLICY,
        metadata.LEASE,
        stream_records.STREAM,
        *access_records.KINDS,
    }
)
_Context = grpc.aio.ServicerContext[Any, Any]
_P = ParamSpec("_P")
_T = TypeVar("_T")


def now_ms() -> int:
    return int(time.time() * 1000)


async def run_store(context: _Context, call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`call` in a worker thread, its failures mapped to gRPC statuses (see the module docstring)."""
    return await mapped(context, asyncio.to_thread(call, *args, **kwargs))


async def mapped(context: _Context, work: Awaitable[_T]) -> _T:
    """`work`, its failures mapped to gRPC statuses (see the module docstring)."""
    try:
        return await work
    except StoreUnavailable as error:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"the coordinator's store is unavailable: {error}")
    except NotFound as error:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
    except PolicyError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    except (QueueMismatch, LeaseRefused, access_records.InUse, NodeAlive) as error:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
    except Conflict as error:
        await context.abort(grpc.StatusCode.ABORTED, str(error))
    except QueueLimit as error:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
    except NoLiveNodes:
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "no node can take the queue now: none is live and not draining "
            "(start or undrain a node: ringqctl cluster_status shows them)",
        )
    except ValueError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    raise AssertionError("unreachable: abort raises")


async def require(context: _Context, **fields: str) -> None:
    for name, value in fields.items():
        if not value:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must not be empty")


async def act_for(context: _Context, node: str) -> None:
    """Over TLS, a node acts only for itself and the members it hosts (PERMISSION_DENIED otherwise)."""
    if (problem := acting_for_problem(context, node)) is not None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)


# The coordinator's placement passes: a policy pass returns every queue as the pass left it.
PolicyPasses = PlacementPasses[Mapping[str, QueueRecord]]


class MetadataRpcs:
    """The metadata RPCs of CoordinatorService and AdminService; needs `_store`, `_feed`, `_liveness_ms`,
    `_load_cache` and `_passes`."""

    _store: Store
    _feed: ChangeFeed
    _liveness_ms: int
    _load_cache: metadata.ReplicaLoadCache
    _passes: PolicyPasses
    _max_queues_per_vhost: int

    # ------------------------------------------------------------------ nodes

    def _alive(self, last_heartbeat_unix_ms: int | None) -> bool:
        """Heard from within the liveness timeout, by this coordinator's clock."""
        return last_heartbeat_unix_ms is not None and now_ms() - last_heartbeat_unix_ms < self._liveness_ms

    def _live_nodes(self) -> list[str]:
        """Alive and not draining: where new replicas may go."""
        return records.placeable_nodes(self._store, self._liveness_ms, now_ms())

    async def NodeHeartbeat(
        self, request: coordinator_pb2.NodeHeartbeatRequest, context: _Context
    ) -> coordinator_pb2.NodeHeartbeatResponse:
        await require(context, node=request.node)
        await act_for(context, request.node)
        disk, memory = disk_report_from_heartbeat(request), memory_report_from_heartbeat(request)
        await run_store(context, records.node_heartbeat, self._store, request.node, now_ms(), disk, memory)
        draining = await run_store(context, records.node_draining, self._store, request.node)
        return coordinator_pb2.NodeHeartbeatResponse(draining=draining)

    async def SetNodeDraining(
        self, request: cluster_pb2.SetNodeDrainingRequest, context: _Context
    ) -> cluster_pb2.SetNodeDrainingResponse:
        await require(context, node=request.node)
        if not await run_store(context, records.set_node_draining, self._store, request.node, request.draining):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no node {request.node!r} is registered")
        return cluster_pb2.SetNodeDrainingResponse()

    async def ForgetNode(
        self, request: cluster_pb2.ForgetNodeRequest, context: _Context
    ) -> cluster_pb2.ForgetNodeResponse:
        await require(context, node=request.node)
        deleted = await run_store(context, forget_node, self._store, request.node, self._liveness_ms, now_ms())
        return cluster_pb2.ForgetNodeResponse(deleted_queues=[queue_to_proto(queue) for queue in deleted])

    async def ClusterStatus(
        self, request: cluster_pb2.ClusterStatusRequest, context: _Context
    ) -> cluster_pb2.ClusterStatusResponse:
        nodes = await run_store(context, records.list_nodes, self._store)
        coordinators = await run_store(context, self._store.list, COORDINATOR)
        return cluster_pb2.ClusterStatusResponse(
            nodes=[node_to_proto(n, self._alive(n.last_heartbeat_unix_ms)) for n in nodes],
            coordinators=[
                cluster_pb2.CoordinatorEndpoint(address=r.key, alive=self._alive(int(r.value["at_unix_ms"])))
                for r in coordinators
            ],
            store_kind=self._store.kind_name,
        )

    # --------------------------------------------------------------- policies

    async def SetPolicy(
        self, request: cluster_pb2.SetPolicyRequest, context: _Context
    ) -> cluster_pb2.SetPolicyResponse:
        def save() -> tuple[Policy, metadata.PolicyOutcomes]:
            before = metadata.policy_outcomes(self._store)
            return metadata.save_policy(self._store, policy_from_proto(request.policy)), before  # may refuse it

        policy, before = await run_store(context, save)
        changed = await self._apply_policies(context, before)
        return cluster_pb2.SetPolicyResponse(policy=policy_to_proto(policy), queues_changed=changed)

    async def _apply_policies(self, context: _Context, before: metadata.PolicyOutcomes) -> int:
        """Re-apply the policies in a placement pass, shared with concurrent changes (so over every
        vhost: the changes sharing it may be of several); returns how many queues stand changed since
        `before`, read before this call stored its change: the placement loop may have applied it first."""

        def apply() -> Mapping[str, QueueRecord]:
            return metadata.place_queues(self._store, "", self._live_nodes()).queues

        return metadata.queues_changed(before, await mapped(context, self._passes.apply_policies(apply)))

    async def ClearPolicy(
        self, request: cluster_pb2.ClearPolicyRequest, context: _Context
    ) -> cluster_pb2.ClearPolicyResponse:
        await require(context, name=request.name)

        vhost = request.vhost or "/"

        def delete() -> metadata.PolicyOutcomes:
            before = metadata.policy_outcomes(self._store)
            metadata.delete_policy(self._store, vhost, request.name)
            return before

        before = await run_store(context, delete)
        return cluster_pb2.ClearPolicyResponse(queues_changed=await self._apply_policies(context, before))

    async def ListPolicies(
        self, request: cluster_pb2.ListPoliciesRequest, context: _Context
    ) -> cluster_pb2.ListPoliciesResponse:
        found = await run_store(context, metadata.list_policies, self._store, request.vhost)
        return cluster_pb2.ListPoliciesResponse(policies=[policy_to_proto(p) for p in found])

    # ----------------------------------------------------------------- queues

    async def DeclareQueue(
        self, request: coordinator_pb2.DeclareQueueRequest, context: _Context
    ) -> coordinator_pb2.DeclareQueueResponse:
        await require(context, name=request.name)
        try:
            queue_arguments.validate(request.arguments)
        except queue_arguments.ArgumentError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        declared = QueueRecord(
            vhost=request.vhost or "/",
            name=request.name,
            durable=request.durable,
            auto_delete=request.auto_delete,
            exclusive_owner=request.exclusive_owner,
            arguments=dict(request.arguments),
        )

        def declare() -> QueueRecord:
            return metadata.declare_queue(
                self._store,
                declared,
                self._live_nodes(),
                request.preferred_master,
                self._load_cache,
                self._max_queues_per_vhost,
            )

        return coordinator_pb2.DeclareQueueResponse(queue=queue_to_proto(await run_store(context, declare)))

    async def GetQueue(
        self, request: coordinator_pb2.GetQueueRequest, context: _Context
    ) -> coordinator_pb2.GetQueueResponse:
        await require(context, name=request.name)
        queue = await run_store(context, metadata.get_queue, self._store, request.vhost or "/", request.name)
        return coordinator_pb2.GetQueueResponse(queue=queue_to_proto(queue))

    async def ListQueues(
        self, request: cluster_pb2.ListQueuesRequest, context: _Context
    ) -> cluster_pb2.ListQueuesResponse:
        queues = await run_store(context, metadata.list_queues, self._store, request.vhost)
        return cluster_pb2.ListQueuesResponse(queues=[queue_to_proto(q) for q in queues])

    async def UpdateQueue(
        self, request: coordinator_pb2.UpdateQueueRequest, context: _Context
    ) -> coordinator_pb2.UpdateQueueResponse:
        await require(context, name=request.queue.name)
        queue = await run_store(context, queue_from_proto, request.queue)
        updated = await run_store(context, metadata.update_queue, self._store, queue, request.expected_version)
        return coordinator_pb2.UpdateQueueResponse(queue=queue_to_proto(updated))

    async def DeleteQueue(
        self, request: coordinator_pb2.DeleteQueueRequest, context: _Context
    ) -> coordinator_pb2.DeleteQueueResponse:
        await require(context, name=request.name)
        vhost = request.vhost or "/"
        await run_store(context, metadata.delete_queue, self._store, vhost, request.name, request.expected_version)
        return coordinator_pb2.DeleteQueueResponse()

    # ----------------------------------------------------------------- leases

    async def AcquireLease(
        self, request: coordinator_pb2.AcquireLeaseRequest, context: _Context
    ) -> coordinator_pb2.AcquireLeaseResponse:
        await require(context, name=request.name, holder=request.holder)
        lease = await run_store(
            context, metadata.acquire_lease, self._store, request.name, request.holder, request.ttl_ms, now_ms()
        )
        return coordinator_pb2.AcquireLeaseResponse(lease=lease_to_proto(lease))

    async def RenewLease(
        self, request: coordinator_pb2.RenewLeaseRequest, context: _Context
    ) -> coordinator_pb2.RenewLeaseResponse:
        await require(context, name=request.name, holder=request.holder)
        lease = await run_store(
            context,
            metadata.renew_lease,
            self._store,
            request.name,
            request.holder,
            request.token,
            request.ttl_ms,
            now_ms(),
        )
        return coordinator_pb2.RenewLeaseResponse(lease=lease_to_proto(lease))

    async def ReleaseLease(
        self, request: coordinator_pb2.ReleaseLeaseRequest, context: _Context
    ) -> coordinator_pb2.ReleaseLeaseResponse:
        await require(context, name=request.name, holder=request.holder)
        lease = await run_store(
            context, metadata.release_lease, self._store, request.name, request.holder, request.token, now_ms()
        )
        return coordinator_pb2.ReleaseLeaseResponse(lease=lease_to_proto(lease))

    async def CheckLease(
        self, request: coordinator_pb2.CheckLeaseRequest, context: _Context
    ) -> coordinator_pb2.CheckLeaseResponse:
        await require(context, name=request.name, holder=request.holder)
        lease = await run_store(context, metadata.get_lease, self._store, request.name)
        now = now_ms()
        valid = lease.holder == request.holder and lease.token == request.token and lease.held_at(now)
        remaining = max(0, lease.expires_at_ms - now) if lease.held_at(now) else 0
        return coordinator_pb2.CheckLeaseResponse(valid=valid, lease=lease_to_proto(lease), remaining_ms=remaining)

    async def ListLeases(
        self, request: cluster_pb2.ListLeasesRequest, context: _Context
    ) -> cluster_pb2.ListLeasesResponse:
        found = await run_store(context, metadata.list_leases, self._store)
        return cluster_pb2.ListLeasesResponse(leases=[lease_to_proto(lease) for lease in found])

    # ------------------------------------------------------------------ watch

    async def Watch(
        self, request: coordinator_pb2.WatchRequest, context: _Context
    ) -> AsyncIterator[coordinator_pb2.WatchResponse]:
        unknown = sorted(set(request.kinds) - WATCHABLE)
        if unknown:
            known = ", ".join(sorted(WATCHABLE))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kinds: unknown {unknown[0]!r} (known: {known})")
        kinds = frozenset(request.kinds)
        async for item in self._feed.watch(kinds, request.after_revision):
            yield watch_response(item)


def watch_response(item: Change | Resync) -> coordinator_pb2.WatchResponse:
    if isinstance(item, Resync):
        return coordinator_pb2.WatchResponse(revision=item.revision, resync=True)
    event = coordinator_pb2.WatchResponse(
        revision=item.revision, kind=item.kind, key=item.key, deleted=item.record is None
    )
    record = item.record
    if record is None:
        return event
    if item.kind == records.GROUP:
        event.group.CopyFrom(group_to_proto(records.group_from_record(item.key, record)))
    elif item.kind == records.NODE:
        node = records.NodeRecord(item.key, str(record.value["address"]), bool(record.value.get("draining", False)))
        event.node.CopyFrom(node_to_proto(node, alive=False))
    elif item.kind == metadata.QUEUE:
        event.queue.CopyFrom(queue_to_proto(metadata.queue_from_record(record)))
    elif item.kind == metadata.POLICY:
        event.policy.CopyFrom(policy_to_proto(metadata.policy_from_record(record)))
    elif item.kind == metadata.LEASE:
        lease = metadata.lease_from_record(record, item.key)
        if lease is not None:
            event.lease.CopyFrom(lease_to_proto(lease))
    return event
