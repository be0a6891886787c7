"""A stream's status as clients see it (StreamInfo): its lists, each group's replicas, depth and state,
the lease holders, and why consumption waits if it does.

Responsible for: describing, never deciding: every figure is read when asked (a group's depth from its
master, -1 if the master cannot be reached) and nothing here changes a record.
"""

from __future__ import annotations

import contextlib

import grpc

from ringq.internal.v1 import coordinator_pb2
from ringq.v1 import queue_pb2, queue_pb2_grpc, stream_pb2
from services.coordinator.metadata import QueueRecord
from services.stream.fencing import CONSUMER, PRODUCER, lease_name
from services.stream.shell import StreamShell

_ROLE_OF = {PRODUCER: stream_pb2.STREAM_ROLE_PRODUCER, CONSUMER: stream_pb2.STREAM_ROLE_CONSUMER}
DEPTH_TIMEOUT_S = 2.0


async def group_depth(shell: StreamShell, queue: QueueRecord | None) -> int:
    """Messages in the group not yet acknowledged, from its master; -1 if it cannot be reached."""
    if queue is None or not queue.master:
        return -1
    local = shell.local_master(queue.vhost, queue.name)
    if local is not None:
        master = local.master
        return master.contents.depth if master is not None else -1
    address = await shell.address_of(queue.master)
    if address is None:
        return -1
    stub = queue_pb2_grpc.QueueServiceStub(shell.channel_to(queue.master, address))
    request = queue_pb2.QueueStatusRequest(queue=queue_pb2.QueueRef(vhost=queue.vhost, queue=queue.name))
    with contextlib.suppress(grpc.aio.AioRpcError):
        response = await stub.QueueStatus(request, timeout=DEPTH_TIMEOUT_S)
        return int(response.queue.depth)
    return -1


def group_state(record: coordinator_pb2.StreamRecord, group: str, depth: int) -> str:
    sending = bool(record.send_list) and record.send_list[0] == group and bool(record.consume_list)
    sending = sending and record.consume_list[-1] == group
    if sending:
        return "sending"
    if group in record.down:
        what = "both replicas unreachable" if depth < 0 else "a replica missing or not in step"
        return f"down: {what}; takes no sends until both replicas are back"
    if group in record.consume_list:
        return "draining: consumers read it before the groups after it"
    return "ready: may take sends"


def consume_state(record: coordinator_pb2.StreamRecord, depths: dict[str, int]) -> str:
    """Why consumption waits, or "" if it does not."""
    if not record.consume_list:
        return ""
    head = record.consume_list[0]
    if depths.get(head, -1) < 0:
        return (
            f"stalled: the head of the consume list, group {head}, has no replica that can be reached; "
            "consumers wait for one to come back with its log and never skip ahead to later groups"
        )
    return ""


async def stream_info(shell: StreamShell, record: coordinator_pb2.StreamRecord) -> stream_pb2.StreamInfo:
    groups = []
    depths: dict[str, int] = {}
    for group in record.groups:
        queue = await shell.group_queue(record.vhost, group)
        depth = depths[group] = await group_depth(shell, queue)
        groups.append(
            stream_pb2.StreamGroupInfo(
                group=group,
                master_node=queue.master if queue else "",
                mirrors=list(queue.mirrors) if queue else [],
                synchronised_mirrors=list(queue.synchronised_mirrors) if queue else [],
                depth=depth,
                whole=group not in record.down,
                state=group_state(record, group, depth),
                generation=record.generations.get(group, 0),
            )
        )
    leases = []
    for role, value in _ROLE_OF.items():
        read = await shell.fencing_read(lease_name(record.vhost, record.name, role))
        leases.append(
            stream_pb2.StreamLease(
                role=value,
                holder=read.holder if read.remaining_ms else "",
                fencing_token=read.token,
                expires_in_ms=read.remaining_ms,
            )
        )
    return stream_pb2.StreamInfo(
        stream=stream_pb2.StreamRef(vhost=record.vhost, stream=record.name),
        durable=record.durable,
        send_list=list(record.send_list),
        consume_list=list(record.consume_list),
        groups=groups,
        leases=leases,
        consume_state=consume_state(record, depths),
    )
