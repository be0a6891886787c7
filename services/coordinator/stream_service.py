"""The coordinator's ordered-stream RPCs and the loop that keeps each stream's send list in step with
its groups (mixed into server.CoordinatorServicer).

Responsible for: declaring a stream (its record, then its groups' queues, each group's master on a
different node in turn so a stream's groups spread over the nodes), reading, listing and deleting
streams, picking the send group for a producer and taking a drained group off the consume list, all by
the pure rules of stream_lists.py applied by compare-and-set (stream_records.py); and, in
`keep_stream_lists`, striking a group from the send list as soon as the coordinator sees it not whole
(a replica missing, dead or out of step) and letting it back once whole.

Guarantees: a pick is stored before it is answered; a stream is declared only with two live nodes for
its groups (INVALID_ARGUMENT otherwise, saying so); a group is struck within one pass (a third of the
liveness timeout, sooner when a queue record changes) of the coordinator seeing it broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc

from ringq.internal.v1 import coordinator_pb2
from services.coordinator import metadata, records, stream_records
from services.coordinator.metadata import NotFound, QueueRecord
from services.coordinator.metadata_service import mapped, now_ms, require, run_store
from services.coordinator.store import Store, StoreUnavailable
from services.coordinator.stream_groups import group_whole
from services.coordinator.stream_records import StreamRecord
from services.coordinator.watch import ChangeFeed
from services.event_waits import event_or_timeout

log = logging.getLogger("ringq.coordinator.streams")
_Context = grpc.aio.ServicerContext[Any, Any]


def stream_to_proto(stream: StreamRecord) -> coordinator_pb2.StreamRecord:
    lists = stream.lists
    return coordinator_pb2.StreamRecord(
        vhost=stream.vhost,
        name=stream.name,
        durable=stream.durable,
        groups=lists.groups,
        send_list=lists.send,
        consume_list=lists.consume,
        down=sorted(lists.down),
        generations=dict(lists.generations),
        version=stream.version,
        consumed_through=lists.consumed_through,
    )


def alive_nodes(store: Store, liveness_ms: int) -> list[str]:
    """Nodes heard from within the liveness timeout (draining ones too: they still serve)."""
    now = now_ms()
    return [
        node.node
        for node in records.list_nodes(store)
        if node.last_heartbeat_unix_ms is not None and now - node.last_heartbeat_unix_ms < liveness_ms
    ]


def declare_stream(
    store: Store, vhost: str, name: str, groups: int, durable: bool, placeable: list[str], liveness_ms: int
) -> StreamRecord:
    """The stream's record and its groups' queues (ValueError, i.e. INVALID_ARGUMENT, with fewer than two
    placeable nodes: a group needs two)."""
    if len(placeable) < 2:
        raise ValueError(
            f"a stream's group needs two nodes for its two replicas; {len(placeable)} node(s) can take "
            f"replicas now ({', '.join(placeable) or 'none'})"
        )
    stream = stream_records.declare_stream(store, vhost, name, groups, durable)
    for number, group in enumerate(stream.groups):
        preferred = placeable[number % len(placeable)]
        metadata.declare_queue(store, QueueRecord(vhost=vhost, name=group, durable=durable), placeable, preferred)
    return stream


def delete_stream(store: Store, vhost: str, name: str) -> StreamRecord:
    """Delete the record, then its groups' queues (a group already gone is no matter)."""
    stream = stream_records.delete_stream(store, vhost, name)
    for group in stream.groups:
        with contextlib.suppress(NotFound):
            metadata.delete_queue(store, vhost, group)
    return stream


def observe_groups(store: Store, liveness_ms: int, only: tuple[str, str] | None = None) -> int:
    """One pass: every stream's lists (or only the stream (vhost, name) `only` names) updated with what the
    coordinator sees of its groups; returns how many streams changed."""
    live = alive_nodes(store, liveness_ms)
    changed = 0
    streams = [stream_records.get_stream(store, *only)] if only else stream_records.list_streams(store)
    for stream in streams:
        whole: dict[str, bool] = {}
        for group in stream.groups:
            try:
                whole[group] = group_whole(metadata.get_queue(store, stream.vhost, group), live)
            except NotFound:
                whole[group] = False
        seen = dict(whole)
        after = stream_records.change_lists(
            store,
            stream.vhost,
            stream.name,
            lambda lists, seen=seen: lists.observe(seen),  # type: ignore[misc]
        )
        if after.version != stream.version:
            changed += 1
            log.info(
                "stream %s/%s: send list %s, consume list %s, down %s",
                stream.vhost,
                stream.name,
                list(after.lists.send),
                list(after.lists.consume),
                sorted(after.lists.down),
            )
    return changed


async def keep_stream_lists(store: Store, feed: ChangeFeed, liveness_ms: int) -> None:
    """Run `observe_groups` a few times per liveness timeout, and at once when a queue record changes."""
    woken = asyncio.Event()

    async def follow() -> None:
        while True:
            try:
                async for _ in feed.watch(frozenset({metadata.QUEUE, stream_records.STREAM})):
                    woken.set()
            except Exception as error:  # StoreUnavailable: keep the periodic passes
                log.debug("following records for streams: %r", error)
                await asyncio.sleep(liveness_ms / 3000)

    follower = asyncio.ensure_future(follow())
    try:
        while True:
            await event_or_timeout(woken, liveness_ms / 3000)
            woken.clear()
            try:
                await asyncio.to_thread(observe_groups, store, liveness_ms)
            except (StoreUnavailable, metadata.Conflict) as error:
                log.warning("cannot update stream lists yet: %s", error)
            except Exception:  # a bug must not stop the streams' upkeep for good: say so, try again
                log.exception("stream lists pass failed")
    finally:
        follower.cancel()


class StreamRecordRpcs:
    """CoordinatorService's stream RPCs; needs `_store` and `_liveness_ms`."""

    _store: Store
    _liveness_ms: int

    async def DeclareStreamRecord(
        self, request: coordinator_pb2.DeclareStreamRecordRequest, context: _Context
    ) -> coordinator_pb2.DeclareStreamRecordResponse:
        await require(context, name=request.name)
        placeable = records.placeable_nodes(self._store, self._liveness_ms, now_ms())
        vhost = request.vhost or "/"
        stream = await run_store(
            context,
            declare_stream,
            self._store,
            vhost,
            request.name,
            request.groups,
            request.durable,
            placeable,
            self._liveness_ms,
        )
        return coordinator_pb2.DeclareStreamRecordResponse(stream=stream_to_proto(stream))

    async def GetStreamRecord(
        self, request: coordinator_pb2.GetStreamRecordRequest, context: _Context
    ) -> coordinator_pb2.GetStreamRecordResponse:
        await require(context, name=request.name)
        stream = await run_store(context, stream_records.get_stream, self._store, request.vhost or "/", request.name)
        return coordinator_pb2.GetStreamRecordResponse(stream=stream_to_proto(stream))

    async def ListStreamRecords(
        self, request: coordinator_pb2.ListStreamRecordsRequest, context: _Context
    ) -> coordinator_pb2.ListStreamRecordsResponse:
        streams = await run_store(context, stream_records.list_streams, self._store, request.vhost)
        return coordinator_pb2.ListStreamRecordsResponse(streams=[stream_to_proto(s) for s in streams])

    async def DeleteStreamRecord(
        self, request: coordinator_pb2.DeleteStreamRecordRequest, context: _Context
    ) -> coordinator_pb2.DeleteStreamRecordResponse:
        await require(context, name=request.name)
        stream = await run_store(context, delete_stream, self._store, request.vhost or "/", request.name)
        return coordinator_pb2.DeleteStreamRecordResponse(stream=stream_to_proto(stream))

    async def PickSendGroup(
        self, request: coordinator_pb2.PickSendGroupRequest, context: _Context
    ) -> coordinator_pb2.PickSendGroupResponse:
        await require(context, name=request.name)
        vhost = request.vhost or "/"
        # What the coordinator sees first: a pick never hands out a group it already knows is broken.
        await mapped(context, asyncio.to_thread(observe_groups, self._store, self._liveness_ms, (vhost, request.name)))
        stream, group = await run_store(context, stream_records.pick, self._store, vhost, request.name)
        return coordinator_pb2.PickSendGroupResponse(group=group or "", stream=stream_to_proto(stream))

    async def ReportGroupDrained(
        self, request: coordinator_pb2.ReportGroupDrainedRequest, context: _Context
    ) -> coordinator_pb2.ReportGroupDrainedResponse:
        await require(context, name=request.name, group=request.group)
        vhost, group, generation, through = (
            request.vhost or "/",
            request.group,
            request.generation,
            request.consumed_through,
        )

        def report() -> StreamRecord:
            return stream_records.change_lists(
                self._store, vhost, request.name, lambda lists: lists.drained(group, generation, through)
            )

        try:
            stream = await run_store(context, report)
        except KeyError as error:  # not a group of this stream
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return coordinator_pb2.ReportGroupDrainedResponse(stream=stream_to_proto(stream))
