"""A broker node: one process hosting GM ring members and queue replicas.

Responsible for: serving PeerService (links to other nodes, AddOnRight) and
GroupService (applications joining groups) on one gRPC port, routing ring
messages to the member of their group, registering with the coordinator, and
detecting failed members: a neighbour's node silent for the failure timeout,
or whose link broke and whose port then refused a new connection (its process
is gone: no need to wait out the timeout), and still so after a short grace
(a partial partition may heal in between), is reported to the member, which
records the death in the group table. The member a joiner asks to add it (its
join target) is watched the same way, over a link kept up to its node for the
purpose: a failed AddOnRight is only a suspicion. It is reported once its node
has been silent for the failure timeout, counted from its last sign of life
but never from before the request began, and still is after the grace; a
refused port does not shorten that for a join target (a channel still backing
off from an outage reports the old refusal after the node is back). Any answer
ends the suspicion; only "not hosted here" (the member is gone) records it dead
at once.
Guarantees: a node hosts at most one member per group; ring messages for a
member this node does not host are dropped; SIGTERM makes every member leave
gracefully before the process exits.
"""

from __future__ import annotations

import services.grpc_io  # noqa: F401 (first: it chooses gRPC's I/O path, which must precede grpc's import)

# isort: split
import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

import ringq
from ringq import tracing
from ringq.internal.v1 import peer_pb2, peer_pb2_grpc
from ringq.keepalive import SERVER_KEEPALIVE
from ringq.v1 import admin_pb2, group_pb2, group_pb2_grpc, queue_pb2, queue_pb2_grpc, stream_pb2, stream_pb2_grpc
from services import config, event_loop, memory_report, telemetry
from services import tls as tls_flags
from services.access import DEFAULT_VHOST, Operation
from services.access_guard import OPEN, AccessGuard
from services.admin_service import admin_handler
from services.arguments import OneLineParser, address_argument, addresses_argument, node_id_argument
from services.coordinator.client import CoordinatorClient
from services.coordinator.convert import group_from_proto, group_to_proto
from services.coordinator.group_table import Group, GroupChange, Outcome, member_node
from services.coordinator.metadata import QUEUE_GROUP_PREFIX
from services.coordinator.records import DiskReport, MemoryReport
from services.coordinator.server import group_name_problem
from services.disk_monitor import MEBIBYTE, DiskMonitor
from services.gm import wire
from services.gm.links import LinkManager, channel_options
from services.gm.member import MemberEvent, MemberShell, NotHosted, Watched
from services.gm.messages import Deliver, Joined, MembersChanged, RingMessage, Stopped
from services.gm.ring import NotJoined, RingMember
from services.health import Health
from services.memory_monitor import DEFAULT_WATERMARK_SHARE, MemoryMonitor, default_watermark_bytes
from services.queue.manager import QueueManager
from services.queue.metrics import node_gauges
from services.queue.service import QueueServicer
from services.request_guard import SERVER_OPTIONS as GUARDED_SERVER_OPTIONS
from services.request_guard import RequestGuard
from services.stream.service import StreamServicer
from services.stream.shell import StreamShell
from services.tls import PLAINTEXT, ClusterTLS, Dialer, acting_for_problem, member_problem

if TYPE_CHECKING:
    from services.prometheus import Scrape

log = logging.getLogger("ringq.node")

MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
COORDINATOR_RETRY_SECONDS = 7 * 24 * 3600.0
# A third of the coordinator's default liveness timeout (5 s).
HEARTBEAT_TO_COORDINATOR_SECONDS = 1.5
GROUP_KIND = "group"
# The fallback to the group watch (Node._verify_groups) lists this node's groups every check period while
# the watch is down, and every this many check periods (2 min by default) while it is up: the watch brings
# new views at once; the listing is there for what it might miss.
CHECKS_PER_VERIFY_WHILE_WATCHING = 60
# gRPC refuses a message over its limits before any handler sees it, so the
# server's limits leave room for several payloads of the largest size: larger
# requests get RESOURCE_EXHAUSTED from gRPC itself.
MAX_GRPC_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    *GUARDED_SERVER_OPTIONS,
    *SERVER_KEEPALIVE,
]
_MESSAGE_LIMITS = ("grpc.max_send_message_length", "grpc.max_receive_message_length")
# Channels to other nodes for what is not a ring link (queue calls relayed to a master, AddOnRight):
# they carry whole client messages, so the server's limits, not the ring's fragment-sized ones; and
# they reconnect as quickly as ring links after a peer restarts (gRPC's default backoff reaches minutes).


def peer_channel_options(failure_timeout: float) -> list[tuple[str, int]]:
    """Channels for peer calls other than links (AddOnRight, relayed queue calls): the links' reconnect
    options, with the larger message limit of relayed queue calls."""
    return [
        *((name, value) for name, value in channel_options(failure_timeout) if name not in _MESSAGE_LIMITS),
        *((name, MAX_GRPC_MESSAGE_BYTES) for name in _MESSAGE_LIMITS),
    ]


# AddOnRight statuses that are no answer from the node (its channel could not reach it in time):
# the request is asked again; anything else came from the node, which therefore lives.
NO_ANSWER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
JOIN_RETRY_PAUSE_SECONDS = 0.05
# How often a join that gets no answer is noted in the log.
SLOW_JOIN_NOTE_SECONDS = 5.0
# A Delivery event carries at most this many payload bytes (but always at
# least one payload), so one flush of many large payloads becomes several events.
MAX_DELIVERY_EVENT_BYTES = 4 * 1024 * 1024
JOIN_ATTEMPTS = 5
# How long a starting node waits for an answer at the address its id was registered at (a twin there
# answers at once; a node that crashed does not answer at all).
TWIN_PROBE_SECONDS = 2.0
# How long a client's call (a declare, an administration call...) waits for the coordinator to answer
# or to be able to: then the client gets the coordinator's last status (e.g. UNAVAILABLE: no node can
# take the queue) rather than a call that hangs.
CLIENT_CALL_RETRY_SECONDS = 5.0
# A node sending ring messages in another's name is logged at most this often.
IMPOSTOR_NOTE_SECONDS = 60.0
# RabbitMQ's default disk_free_limit: enough room to write a few more batches and the logs.
DEFAULT_DISK_FREE_LIMIT_MB = 50
# A limit up to 1 PiB: anything larger is a typo (and still fits the heartbeat's uint64).
MAX_DISK_FREE_LIMIT_MB = 1024**3
# The services a node serves; its health service answers for each as for the node ("").
NODE_SERVICES = tuple(
    descriptor.full_name
    for descriptor in (
        queue_pb2.DESCRIPTOR.services_by_name["QueueService"],
        stream_pb2.DESCRIPTOR.services_by_name["StreamService"],
        group_pb2.DESCRIPTOR.services_by_name["GroupService"],
        admin_pb2.DESCRIPTOR.services_by_name["AdminService"],
        peer_pb2.DESCRIPTOR.services_by_name["PeerService"],
    )
)


# The least a member listed in its group waits for its joining Catchup (see Node.join_timeout). A loaded
# 2-core machine (the parallel test suite) once took over 1.2 s to deliver one from a live adder.
JOIN_TIMEOUT_FLOOR_SECONDS = 3.0


@dataclass(frozen=True)
class NodeSettings:
    """Timers of a node; every one is a flag of `ringq node`."""

    flush_interval: float = 0.002
    # An idle link carries a heartbeat each way this often: four in a failure timeout (each costs both
    # nodes a gRPC message, which is most of what an idle node does).
    heartbeat_interval: float = 0.5
    failure_timeout: float = 2.0
    grace: float = 0.1
    # How often the node lists its groups while its group watch is down, to tell members of views they
    # missed (None: the failure timeout; while the watch is up, CHECKS_PER_VERIFY_WHILE_WATCHING times
    # less often). Only a fallback: the group watch normally brings every new view at once.
    membership_check: float | None = None
    # Where durable queues keep their messages (a directory per queue).
    data_dir: str = "data"
    # How long a replica that came back with a log waits for its queue's master
    # before the replica that knows most recovers the queue (services/queue/durability.py).
    recovery_wait: float = 30.0
    # Below this many free bytes on data_dir's disk the node raises its disk alarm and blocks
    # persistent publishes (0: never; services/disk_monitor.py).
    disk_free_limit_bytes: int = DEFAULT_DISK_FREE_LIMIT_MB * MEBIBYTE
    # At or above this much resident memory the node raises its memory alarm and stops reading publish
    # streams, which blocks publishers (0: never; services/memory_monitor.py).
    memory_high_watermark_bytes: int = default_watermark_bytes()


class Node:
    """The state of one broker node process."""

    def __init__(
        self,
        node_id: str,
        address: str,
        coordinator: CoordinatorClient,
        settings: NodeSettings,
        *,
        dialer: Dialer = PLAINTEXT,
        cluster_address: str = "",
        certificate_address: str = "",
    ) -> None:
        self.id = node_id
        self.address = address
        # Where other members dial this node ("": at `address`); with TLS, its own port.
        self.cluster_address = cluster_address
        # Where clients with a user certificate reach this node ("": it serves none).
        self.certificate_address = certificate_address
        self.dialer = dialer
        self.coordinator = coordinator
        self.settings = settings
        self.flush_interval = settings.flush_interval
        # A joining Catchup comes within milliseconds; one lost with a stale link never comes (ring.py,
        # hard case 9). Giving up early costs more than waiting: the member records itself dead and joins
        # again, a view change on every member, while a Catchup is lost only in that rare case. So twice the
        # failure timeout, and never less than the floor, however short the failure timeout is set.
        self.join_timeout = max(JOIN_TIMEOUT_FLOOR_SECONDS, 2 * settings.failure_timeout)
        self.incarnation = uuid.uuid4().hex
        self.links = LinkManager(
            node_id,
            self.incarnation,
            self.address_of,
            self._on_ring_message,
            self._on_reconnect,
            heartbeat_interval=settings.heartbeat_interval,
            forget_address=self.forget_address,
            on_refused=lambda peer: self._detect_failures_once(),
            options=channel_options(settings.failure_timeout),
            dialer=dialer,
        )
        self.members: dict[str, MemberShell] = {}  # by group
        self._addresses: dict[str, str] = {}
        # By (node, address): with TLS a channel checks the name of the node it was opened for.
        self._peer_channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._reported: set[tuple[str, str]] = set()
        self._verify_now = asyncio.Event()  # set: list this node's groups now (_verify_groups)
        self._impostor_noted: dict[str, float] = {}
        self._detector: asyncio.Task[None] | None = None
        self.watching_groups = False
        self._tasks: set[asyncio.Future[None]] = set()
        # The disk-free alarm: the queue service blocks persistent publishes while disk.alarm is on.
        self.disk = DiskMonitor(node_id, settings.data_dir, settings.disk_free_limit_bytes)
        # The memory alarm: the queue service stops reading publish streams while memory.alarm is on.
        self.memory = MemoryMonitor(node_id, settings.memory_high_watermark_bytes)
        # This node's draining flag as the coordinator last answered a heartbeat (None: no answer yet);
        # `on_draining` is awaited with each new value.
        self.draining: bool | None = None
        self.on_draining: Callable[[bool], Awaitable[None]] | None = None

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await self._refuse_a_twin()
        await self.coordinator.register_node(self.id, self.address, self.cluster_address, self.certificate_address)
        self._detector = asyncio.ensure_future(self._detect_failures())
        await self.disk.measure()  # so the first heartbeat reports the disk
        self._tasks.add(asyncio.ensure_future(self.disk.run()))
        self.memory.measure()
        self._tasks.add(asyncio.ensure_future(self.memory.run()))
        self._tasks.add(asyncio.ensure_future(self._heartbeat()))
        self._tasks.add(asyncio.ensure_future(self._watch_groups()))
        self._tasks.add(asyncio.ensure_future(self._verify_groups()))

    async def _refuse_a_twin(self) -> None:
        """OSError if another process runs as this node id (at the address the coordinator has for it):
        registering would take its identity, and its ring members would be recorded dead."""
        known = dict(await self.coordinator.list_nodes()).get(self.id)
        own = self.cluster_address or self.address
        if known and known != own and await self.links.running_elsewhere(known, TWIN_PROBE_SECONDS):
            raise OSError(f"node id {self.id!r} is already running at {known}: stop it first, or pick another id")

    async def _watch_groups(self) -> None:
        """Hand every new view of a group this node hosts to its member at once, so a
        member learns of changes (its own recorded death included) without polling."""
        revision = 0
        while True:
            try:
                async for event in self.coordinator.watch([GROUP_KIND], revision):
                    self.watching_groups = True
                    revision = event.revision
                    if event.resync:  # changes were missed: every member's group is listed at once
                        self._verify_now.set()
                    elif not event.deleted:
                        self._new_view(event.key, group_from_proto(event.group))
            except grpc.aio.AioRpcError as error:
                log.debug("group watch interrupted: %s", error.code().name)
            self.watching_groups = False
            await asyncio.sleep(0.2)

    def _new_view(self, group_name: str, group: Group) -> None:
        member = self.members.get(group_name)
        if member is not None and member.stopped is None:
            member.post(lambda core: core.on_group_watched(group))

    async def _heartbeat(self) -> None:
        """Tell the coordinator this node is alive (it places replicas on live nodes only) and how
        its disk and memory are (ringqctl cluster_status shows them); learn from its answer whether
        this node is draining (ringqctl drain_node), which its health service reports."""
        while True:
            disk = DiskReport(self.disk.free_bytes, self.disk.limit_bytes, self.disk.alarm)
            memory = MemoryReport(self.memory.used_bytes, self.memory.watermark_bytes, self.memory.alarm)
            try:
                draining = await self.coordinator.node_heartbeat(self.id, disk, memory)
            except grpc.aio.AioRpcError as error:
                log.warning("heartbeat to the coordinator failed: %s", error.code().name)
            else:
                await self._draining_is(bool(draining))
            await asyncio.sleep(HEARTBEAT_TO_COORDINATOR_SECONDS)

    async def _draining_is(self, draining: bool) -> None:
        if draining == self.draining:
            return
        if self.draining is not None or draining:
            log.info("node %s %s", self.id, "is draining" if draining else "is no longer draining")
        self.draining = draining
        if self.on_draining is not None:
            await self.on_draining(draining)

    async def stop(self, timeout: float = 3.0) -> None:
        for member in list(self.members.values()):
            member.leave()
        waits = [m.wait_stopped() for m in self.members.values()]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=timeout)
        if self._detector is not None:
            self._detector.cancel()
        for task in self._tasks:
            task.cancel()
        await self.links.close()
        for channel in self._peer_channels.values():
            await channel.close(grace=None)
        await self.coordinator.close()

    def new_member(self, group: str, events: Callable[[MemberEvent], None]) -> MemberShell:
        member_id = f"{self.id}.{uuid.uuid4().hex[:12]}"
        member = MemberShell(self, RingMember(group, member_id, self.id), events)
        self.members[group] = member
        # A stopped member is forgotten at once: nothing routes to it, and what its events reach (a
        # deleted queue's replica and its messages) can be freed.
        member.add_finished_callback(lambda: self.forget(member))
        member.start()
        return member

    def forget(self, member: MemberShell) -> None:
        if self.members.get(member.core.group_name) is member:
            del self.members[member.core.group_name]
        self.neighbours_changed()

    def member_by_id(self, member_id: str) -> MemberShell | None:
        for member in self.members.values():
            if member.id == member_id:
                return member
        return None

    # ------------------------------------------------------------- MemberHost

    async def read_group(self, group: str) -> Group:
        return await self.coordinator.read_group(group)

    async def change_group(self, group: str, change: GroupChange) -> tuple[Outcome, Group]:
        return await self.coordinator.change_group(group, change)

    def send_ring_message(self, node: str, message: RingMessage) -> None:
        self.links.send(node, wire.to_proto(message))

    def link_idle(self, node: str) -> bool:
        return self.links.is_idle(node)

    async def add_on_right(self, group: str, left: str, node: str, newcomer: str) -> Group | None:
        """MemberHost.add_on_right: asks until `node` answers. Each attempt waits through the
        channel's reconnect backoff for up to the failure timeout; whether `left` is down is
        the failure detector's call (the member watches its join target), never this one's."""
        request = peer_pb2.AddOnRightRequest(group=group, left=left, newcomer=newcomer, newcomer_node=self.id)
        started = time.monotonic()
        note_at, last = started + SLOW_JOIN_NOTE_SECONDS, "no address for its node yet"
        while True:
            if time.monotonic() >= note_at:  # an operator can tell a slow join from a stuck one
                waited = time.monotonic() - started
                log.info(
                    "member %s: %s on %s has not answered AddOnRight in %.0f s (last: %s)",
                    newcomer,
                    left,
                    node,
                    waited,
                    last,
                )
                note_at += SLOW_JOIN_NOTE_SECONDS
            address = await self.address_of(node)
            if address is not None:
                stub = peer_pb2_grpc.PeerServiceStub(self.peer_channel(node, address))
                try:
                    response = await stub.AddOnRight(
                        request, timeout=self.settings.failure_timeout, wait_for_ready=True
                    )
                    return group_from_proto(response.group)
                except grpc.aio.AioRpcError as error:
                    code = error.code()
                    if code == grpc.StatusCode.NOT_FOUND:
                        # Its node does not host it (the node restarted): it is gone.
                        raise NotHosted("its node answered that it does not host it") from error
                    last = f"{code.name} {error.details()}"
                    if code not in NO_ANSWER_CODES:
                        if code != grpc.StatusCode.FAILED_PRECONDITION:  # not "still joining itself"
                            log.warning("AddOnRight to %s on %s: %s %s", left, node, code.name, error.details())
                        return None  # the member will choose again
                    self.forget_address(node)  # it may have restarted on another port
            await asyncio.sleep(JOIN_RETRY_PAUSE_SECONDS)

    def neighbours_changed(self) -> None:
        """Keep links up to every node hosting a member ours watch (neighbours, join targets)."""
        self.links.want({watched.node for member in self.members.values() for watched in member.watched()})

    # ------------------------------------------------------------------ links

    async def address_of(self, node: str) -> str | None:
        if node not in self._addresses:
            try:
                self._addresses.update(await self.coordinator.list_nodes())
            except grpc.aio.AioRpcError:
                return None
        return self._addresses.get(node)

    def forget_address(self, node: str) -> None:
        """`node` did not answer at the address we knew: ask the coordinator again next time."""
        self._addresses.pop(node, None)

    def peer_channel(self, node: str, address: str) -> grpc.aio.Channel:
        """A channel to node `node` at `address` (with TLS, it completes only if `node` answers)."""
        channel = self._peer_channels.get((node, address))
        if channel is None:
            channel = self._peer_channels[node, address] = self.dialer.to_node(
                node, address, peer_channel_options(self.settings.failure_timeout)
            )
        return channel

    def _on_ring_message(self, peer: str, message: Any) -> None:
        member = self.members.get(message.group)
        if member is None or member.id != message.receiver:
            return
        try:
            ring_message = wire.from_proto(message)
        except ValueError as error:
            log.warning("dropping a malformed ring message from %s: %s", peer, error)
            return
        if member_node(message.sender) != peer:
            # A node speaks only for the members it hosts: with TLS, `peer` is what its certificate proves.
            self._note_impostor(peer, message.sender)
            return
        if member.ring_observer is not None:
            member.ring_observer(ring_message, peer)
        member.offer(lambda core: core.on_message(ring_message))

    def _note_impostor(self, peer: str, sender: str) -> None:
        """Log a ring message a node sent in the name of a member it does not host, once per peer per minute."""
        now = time.monotonic()
        if now - self._impostor_noted.get(peer, float("-inf")) >= IMPOSTOR_NOTE_SECONDS:
            self._impostor_noted[peer] = now
            log.warning("dropped a ring message from node %s in the name of %r, not a member of its own", peer, sender)

    def _on_reconnect(self, peer: str) -> None:
        for member in self.members.values():
            if member.neighbours is not None and member.neighbours.right_node == peer:
                member.post(lambda core: core.resend_catchup())

    async def _detect_failures(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval / 2)
            self._detect_failures_once()  # a function of its own: no member outlives a pass in its locals

    def _detect_failures_once(self) -> None:
        suspects: set[tuple[str, str]] = set()
        troubled = self.links.troubled_peers(self.settings.failure_timeout)
        if troubled:  # else no watched member can be suspect: the members are not scanned
            for member in list(self.members.values()):
                for watched in member.watched():
                    if watched.node in troubled and watched.node != self.id and self._suspicion(watched) is not None:
                        suspects.add((member.id, watched.member))
        self._reported &= suspects
        for member_id, suspect in suspects - self._reported:
            self._reported.add((member_id, suspect))
            self._report_down(member_id, suspect)

    async def _verify_groups(self) -> None:
        """The fallback to the group watch, for when it is down or missed something: list the groups with
        a member on this node (one call a page, not a read per member) every check period while the watch
        is down, every CHECKS_PER_VERIFY_WHILE_WATCHING periods while it is up, and at once after the watch
        reports missed changes; each member whose view is older than its listed group takes that group as
        if the watch had brought it (a member recorded dead learns so and stops)."""
        check_every = self.settings.membership_check or self.settings.failure_timeout
        periods = 0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._verify_now.wait(), check_every)
            periods += 1
            if self._verify_now.is_set() or not self.watching_groups or periods >= CHECKS_PER_VERIFY_WHILE_WATCHING:
                self._verify_now.clear()
                periods = 0
                try:
                    self._verify_members(await self.coordinator.list_groups(self.id))
                except grpc.aio.AioRpcError as error:
                    if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                        log.debug("listing this node's groups failed: %s", error.code().name)
                    else:  # a coordinator older than ListGroups: each member reads its own group
                        self._verify_members(())

    def _verify_members(self, groups: Iterable[Group]) -> None:
        """Hand each joined member its group from `groups` (a listing) if that is newer than its view; a
        member whose group the listing lacks (the table no longer lists it on this node) re-reads it."""
        listed = {group.name: group for group in groups}
        for name, member in list(self.members.items()):
            if member.stopped is not None or not member.joined.is_set():
                continue
            group = listed.get(name)
            view = member.core.view
            if group is None:
                member.post(lambda core: core.check_membership())
            elif view is None or group.version > view.version:
                self._new_view(name, group)

    def _suspicion(self, watched: Watched) -> str | None:
        """Why `watched`'s node is suspected (the evidence), or None: silent for the failure
        timeout, not counting from before the watch began (a link idle or cut before a
        partition healed says nothing of a new neighbour), or, for a neighbour, its link
        broke and its port refuses a new one (its process is gone)."""
        silent_seconds = min(self.links.silent_for(watched.node), time.monotonic() - watched.since)
        if silent_seconds > self.settings.failure_timeout:
            return f"silent {silent_seconds:.1f} s"
        if watched.neighbour and self.links.refused(watched.node):
            return "its port refuses connections"
        return None

    def _report_down(self, member_id: str, suspect: str) -> None:
        """Report `suspect` down for `member_id` if the suspicion holds: a neighbour whose port refuses
        connections at once (its process is gone: waiting tells nothing more, and every millisecond here is
        part of a failover), any other suspect only if it still holds after the grace."""
        found = self._watched_by(member_id, suspect)
        if found is not None and found[1].neighbour and self.links.refused(found[1].node):
            self._report_if_suspect(member_id, suspect)
            return
        task = asyncio.ensure_future(self._report_after_grace(member_id, suspect))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _watched_by(self, member_id: str, suspect: str) -> tuple[MemberShell, Watched] | None:
        member = self.member_by_id(member_id)
        watched = next((w for w in member.watched() if w.member == suspect), None) if member else None
        return None if member is None or watched is None else (member, watched)

    async def _report_after_grace(self, member_id: str, suspect: str) -> None:
        await asyncio.sleep(self.settings.grace)
        self._report_if_suspect(member_id, suspect)

    def _report_if_suspect(self, member_id: str, suspect: str) -> None:
        found = self._watched_by(member_id, suspect)
        if found is None:
            return
        member, watched = found
        evidence = self._suspicion(watched)
        if evidence is not None:
            log.info("member %s: %s on %s is down (%s)", member_id, suspect, watched.node, evidence)
            member.report_down(suspect, evidence)


def _events_to_proto(event: Deliver | MembersChanged) -> list[group_pb2.JoinResponse]:
    if isinstance(event, MembersChanged):
        changed = group_pb2.MembersChanged(births=event.births, deaths=event.deaths, view_version=event.view_version)
        return [group_pb2.JoinResponse(members_changed=changed)]
    out: list[group_pb2.JoinResponse] = []
    bodies = event.bodies
    start = 0
    while start < len(bodies):
        end, size = start, 0
        while end < len(bodies) and (end == start or size + len(bodies[end]) <= MAX_DELIVERY_EVENT_BYTES):
            size += len(bodies[end])
            end += 1
        delivery = group_pb2.Delivery(
            publisher=event.publisher, first_seq=event.first_seq + start, payloads=bodies[start:end]
        )
        out.append(group_pb2.JoinResponse(delivery=delivery))
        start = end
    return out


class GroupServicer(group_pb2_grpc.GroupServiceServicer):
    """GroupService: applications join groups as members hosted by this node."""

    def __init__(self, node: Node, access: AccessGuard = OPEN) -> None:
        self.node = node
        # Groups live in the default vhost: joining needs read permission on the name, broadcasting write.
        self.access = access

    async def Join(
        self, request: group_pb2.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[group_pb2.JoinResponse]:
        problem = group_name_problem(request.group)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        await self.access.allow(context, DEFAULT_VHOST, Operation.READ, request.group)
        if request.group.startswith(QUEUE_GROUP_PREFIX):
            # A queue's ring carries its messages and its replicas' reports: only the queue's replicas join it.
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"groups named {QUEUE_GROUP_PREFIX}* belong to queues; applications cannot join them",
            )
        if request.group in self.node.members:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"node {self.node.id} already hosts a member of {request.group}"
            )
        events: asyncio.Queue[MemberEvent] = asyncio.Queue()
        member = await self._join(request.group, events, context)
        try:
            while True:
                event = await events.get()
                if isinstance(event, Stopped):
                    if event.reason != "left":
                        await context.abort(grpc.StatusCode.ABORTED, f"member {member.id} stopped: {event.reason}")
                    return
                if isinstance(event, Joined):
                    yield group_pb2.JoinResponse(
                        joined=group_pb2.Joined(
                            member=member.id,
                            members=event.members,
                            view_version=event.view_version,
                            start_after=dict(event.start_after),
                        )
                    )
                else:
                    for proto in _events_to_proto(event):
                        yield proto
        finally:
            if member.stopped is None:
                member.leave()
                await asyncio.wait([asyncio.ensure_future(member.wait_stopped())], timeout=3.0)
            self.node.forget(member)

    async def _join(
        self, group: str, events: asyncio.Queue[MemberEvent], context: grpc.aio.ServicerContext[Any, Any]
    ) -> MemberShell:
        for _ in range(JOIN_ATTEMPTS):
            member = self.node.new_member(group, events.put_nowait)
            joined = asyncio.ensure_future(member.joined.wait())
            stopped = asyncio.ensure_future(member.wait_stopped())
            await asyncio.wait({joined, stopped}, return_when=asyncio.FIRST_COMPLETED)
            joined.cancel()
            stopped.cancel()
            if member.joined.is_set():
                return member
            self.node.forget(member)
            while not events.empty():
                events.get_nowait()  # the stopped attempt's events
            if member.stopped is None or not member.stopped.rejoin:
                reason = member.stopped.reason if member.stopped else "unknown"
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"could not join {group}: {reason}")
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"could not join {group} in {JOIN_ATTEMPTS} attempts")
        raise AssertionError("unreachable")

    def _application_member(self, member_id: str) -> MemberShell | None:
        """The member an application joined (never a queue's: applications cannot speak for those)."""
        member = self.node.member_by_id(member_id)
        if member is None or member.core.group_name.startswith(QUEUE_GROUP_PREFIX):
            return None
        return member

    async def Broadcast(
        self, request: group_pb2.BroadcastRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> group_pb2.BroadcastResponse:
        member = self._application_member(request.member)
        if member is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no member {request.member!r} on node {self.node.id}")
        await self.access.allow(context, DEFAULT_VHOST, Operation.WRITE, member.core.group_name)
        if not request.payloads:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "payloads must not be empty")
        for index, payload in enumerate(request.payloads):
            if len(payload) > MAX_PAYLOAD_BYTES:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"payloads[{index}] has {len(payload)} bytes; at most {MAX_PAYLOAD_BYTES} are allowed",
                )
        try:
            first, last = await member.broadcast(list(request.payloads), request.confirmed)
        except NotJoined as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except ConnectionAbortedError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        return group_pb2.BroadcastResponse(first_seq=first, last_seq=last)

    async def Leave(
        self, request: group_pb2.LeaveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> group_pb2.LeaveResponse:
        member = self._application_member(request.member)
        if member is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no member {request.member!r} on node {self.node.id}")
        await self.access.allow(context, DEFAULT_VHOST, Operation.READ, member.core.group_name)
        member.leave()
        await member.wait_stopped()
        return group_pb2.LeaveResponse()


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    """PeerService: what other broker nodes call."""

    def __init__(self, node: Node) -> None:
        self.node = node

    # Driven by context.read()/write() rather than by iterators, unlike the generated base.
    async def Link(self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:  # type: ignore[override]
        await self.node.links.accept(context)

    async def AddOnRight(
        self, request: peer_pb2.AddOnRightRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> peer_pb2.AddOnRightResponse:
        member = self.node.members.get(request.group)
        if member is None or member.id != request.left:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.left!r} is not a member hosted on {self.node.id}")
        if not request.newcomer or not request.newcomer_node:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "newcomer and newcomer_node must not be empty")
        if member_node(request.newcomer) != request.newcomer_node:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"newcomer {request.newcomer!r} is not a member of node {request.newcomer_node!r}",
            )
        if (problem := acting_for_problem(context, request.newcomer_node)) is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
        group = await member.add_on_right(request.newcomer, request.newcomer_node)
        if group is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.left} is not ready to add members")
        return peer_pb2.AddOnRightResponse(group=group_to_proto(group))


# ---------------------------------------------------------------------- main


async def serve(
    node_id: str,
    listen: str,
    coordinator: str,
    settings: NodeSettings,
    ready_file: str | None,
    advertise: str | None = None,
    *,
    tls: ClusterTLS | None = None,
    cluster_listen: str | None = None,
    cluster_advertise: str | None = None,
    certificate_listen: str | None = None,
    health_listen: str | None = None,
) -> None:
    """Run a node until SIGTERM or SIGINT; clients are told `advertise` (default: the bound address).

    Plaintext: one port serves clients and cluster members alike. With `tls`, clients use `listen`
    (TLS) and cluster members `cluster_listen` (mutual TLS, port 0 by default: any), so the cluster's
    internal services answer only certificates of the cluster CA. With `certificate_listen` too,
    clients may also come there with a user certificate of the cluster CA instead of a password.
    Every port also serves the gRPC health service (services/health.py), and `health_listen` that alone,
    in plaintext, from the start: NOT_SERVING until the node is ready (NodeReadiness).
    """
    health = await Health.create(NODE_SERVICES)
    health_server: grpc.aio.Server | None = None
    if health_listen is not None:
        health_server, health_port = await health.listen(health_listen)
        log.info("node %s serving its health alone, in plaintext, on %s", node_id, _bound(health_listen, health_port))
    try:
        await _serve(
            node_id,
            listen,
            coordinator,
            settings,
            ready_file,
            advertise,
            health,
            tls=tls,
            cluster_listen=cluster_listen,
            cluster_advertise=cluster_advertise,
            certificate_listen=certificate_listen,
        )
    finally:
        if health_server is not None:
            await health_server.stop(None)


class NodeReadiness:
    """What a node's health service says: SERVING once it has registered with the coordinator, joined the
    groups of the queues placed on it (QueueManager.listed) and heard from the coordinator that it is not
    draining; NOT_SERVING while it drains (the answer to each heartbeat says) and, for good, once it stops.
    A node cut off from the coordinator keeps its last status: it still serves the queues it has."""

    def __init__(self, health: Health, node: Node) -> None:
        self.health = health
        self.node = node
        self.joined = False
        node.on_draining = self.draining_changed

    async def draining_changed(self, _draining: bool) -> None:
        await self.update()

    async def follow(self, queues: QueueManager) -> None:
        await queues.listed.wait()
        self.joined = True
        await self.update()

    async def update(self) -> None:
        await self.health.set_serving(self.joined and self.node.draining is False)


async def _serve(
    node_id: str,
    listen: str,
    coordinator: str,
    settings: NodeSettings,
    ready_file: str | None,
    advertise: str | None,
    health: Health,
    *,
    tls: ClusterTLS | None,
    cluster_listen: str | None,
    cluster_advertise: str | None,
    certificate_listen: str | None,
) -> None:
    client_server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RequestGuard()])
    health.add_to(client_server)
    port = _listen(client_server, listen, tls.client_server_credentials() if tls else None)
    address = advertise or f"{listen.rsplit(':', 1)[0]}:{port}"
    certificate_address = ""
    if certificate_listen is not None:
        if tls is None:
            raise OSError("--certificate-listen needs TLS (--tls-ca, --tls-cert, --tls-key)")
        certificate_port = _listen(client_server, certificate_listen, tls.certificate_server_credentials())
        certificate_address = f"{certificate_listen.rsplit(':', 1)[0]}:{certificate_port}"
    cluster_server, cluster_address = client_server, ""
    if tls is not None:
        cluster_server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RequestGuard(admit=member_problem)])
        health.add_to(cluster_server)
        cluster_listen = cluster_listen or f"{listen.rsplit(':', 1)[0]}:0"
        cluster_port = _listen(cluster_server, cluster_listen, tls.cluster_server_credentials())
        cluster_address = cluster_advertise or f"{cluster_listen.rsplit(':', 1)[0]}:{cluster_port}"
    dialer = Dialer(tls)
    # Membership changes wait for the coordinator as long as it takes: a ring
    # cannot change its view without it, and giving up would stop the member.
    client = CoordinatorClient(coordinator, retry_seconds=COORDINATOR_RETRY_SECONDS, dialer=dialer)
    node = Node(
        node_id,
        address,
        client,
        settings,
        dialer=dialer,
        cluster_address=cluster_address,
        certificate_address=certificate_address,
    )
    readiness = NodeReadiness(health, node)
    if tracing.metrics_enabled():
        node_gauges(node_id, ringq.__version__, lambda: health.serving)
    # With TLS every public call is authenticated and authorised (services/access_guard.py).
    access = AccessGuard(client, enforced=tls is not None)
    group_pb2_grpc.add_GroupServiceServicer_to_server(GroupServicer(node, access), client_server)
    peer_pb2_grpc.add_PeerServiceServicer_to_server(PeerServicer(node), cluster_server)
    queues = QueueManager(node, client, settings.data_dir, settings.recovery_wait)
    # Clients' calls that need the coordinator retry for seconds, not for as long as it takes.
    client_calls = CoordinatorClient(coordinator, retry_seconds=CLIENT_CALL_RETRY_SECONDS, dialer=dialer)
    queue_servicer = QueueServicer(
        node.id,
        queues,
        client_calls,
        node.address_of,
        node.peer_channel,
        node.memory.wait_clear,
        address,
        access,
        node_down=node.links.refused,
    )
    queue_pb2_grpc.add_QueueServiceServicer_to_server(queue_servicer, client_server)
    stream_shell = StreamShell(
        node.id, queues, client_calls, node.address_of, node.peer_channel, access, node.forget_address
    )
    stream_servicer = StreamServicer(stream_shell)
    stream_pb2_grpc.add_StreamServiceServicer_to_server(stream_servicer, client_server)
    # Administration for clients: answered from the coordinator.
    client_server.add_generic_rpc_handlers((admin_handler(client_calls, access),))
    if cluster_server is not client_server:
        # Relayed queue calls come from other nodes, on the cluster port.
        queue_pb2_grpc.add_QueueServiceServicer_to_server(queue_servicer, cluster_server)
        stream_pb2_grpc.add_StreamServiceServicer_to_server(stream_servicer, cluster_server)
        await cluster_server.start()
    if access.enforced:
        await access.load()  # before any client is served, so none is refused for want of the table
        background = asyncio.ensure_future(access.run())
    await client_server.start()
    try:
        await node.start()
    except OSError:  # e.g. another process runs as this node id: stop serving before saying so
        await client_server.stop(None)
        if cluster_server is not client_server:
            await cluster_server.stop(None)
        raise
    await queues.start()
    becoming_ready = asyncio.ensure_future(readiness.follow(queues))
    # What the node built to start (modules, servers, its tables: about 45,000 objects) lives as long as it
    # does: out of the collector's generations, a full collection walks only what came after (issue 13:
    # every full collection had walked them all, 20-30 ms on the 2-core benchmark machine).
    gc.freeze()
    if ready_file:
        tmp = f"{ready_file}.tmp"
        Path(tmp).write_text(address)
        os.replace(tmp, ready_file)
    log.info(
        "node %s serving clients on %s%s",
        node_id,
        address,
        f" (TLS) and cluster members on {cluster_address} (mutual TLS)" if tls else " (plaintext)",
    )
    if certificate_address:
        log.info("node %s serving clients with user certificates on %s", node_id, certificate_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    memory_report.install(loop)
    await stop.wait()
    becoming_ready.cancel()
    await health.shutting_down()  # first: probes and load balancers stop sending clients here
    if access.enforced:
        background.cancel()
    await queues.stop()
    await node.stop()
    await client_calls.close()
    await client_server.stop(grace=1.0)
    if cluster_server is not client_server:
        await cluster_server.stop(grace=1.0)


def _bound(listen: str, port: int) -> str:
    """`listen` with the port bound for it."""
    return f"{listen.rsplit(':', 1)[0]}:{port}"


def _listen(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind `listen` (plaintext without credentials); the port bound, or OSError."""
    try:
        port = server.add_insecure_port(listen) if credentials is None else server.add_secure_port(listen, credentials)
    except RuntimeError as error:  # grpc's way of saying the port is taken
        raise OSError(f"cannot listen on {listen}: {error}") from None
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    return port


def _millis(value: str) -> float:
    try:
        millis = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {value!r}") from None
    if not 0 < millis <= 600_000:
        raise argparse.ArgumentTypeError(f"expected 0 < milliseconds <= 600000, got {value}")
    return millis / 1000.0


def _mebibytes_flag(value: str) -> int:
    """--disk-free-limit-mb, --memory-high-watermark-mb: whole MiB from 0 (off) to MAX_DISK_FREE_LIMIT_MB, as bytes."""
    try:
        mebibytes = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB, got {value!r}") from None
    if not 0 <= mebibytes <= MAX_DISK_FREE_LIMIT_MB:
        raise argparse.ArgumentTypeError(f"expected 0 <= MiB <= {MAX_DISK_FREE_LIMIT_MB}, got {mebibytes}")
    return mebibytes * MEBIBYTE


def parser(prog: str = "ringq node") -> argparse.ArgumentParser:
    defaults = NodeSettings()
    out = OneLineParser(prog=prog, description="Run a ringq broker node.")
    config.add_config_argument(out)
    out.add_argument("--id", required=True, type=node_id_argument, help="this node's id, unique in the cluster")
    out.add_argument(
        "--listen", default="127.0.0.1:7100", type=address_argument, help="HOST:PORT to serve on (port 0: any)"
    )
    out.add_argument(
        "--coordinator",
        required=True,
        type=addresses_argument,
        help="the coordinator's HOST:PORT (several, comma-separated, with the ZooKeeper store)",
    )
    out.add_argument("--ready-file", help="write the bound HOST:PORT here once serving")
    out.add_argument(
        "--advertise",
        type=address_argument,
        help="HOST:PORT that peers and clients should dial (default: the --listen address; "
        "set it when listening on 0.0.0.0, e.g. in a container)",
    )
    out.add_argument(
        "--cluster-listen",
        type=address_argument,
        help="with TLS: HOST:PORT where other cluster members reach this node (default: the --listen host, any port)",
    )
    out.add_argument(
        "--cluster-advertise",
        type=address_argument,
        help="with TLS: HOST:PORT that other members should dial for the cluster port (default: the bound one)",
    )
    out.add_argument(
        "--certificate-listen",
        type=address_argument,
        help="with TLS: also serve clients at HOST:PORT that authenticate with a client certificate of the "
        "cluster CA naming their user, instead of a password (port 0: any)",
    )
    out.add_argument(
        "--health-listen",
        type=address_argument,
        help="also serve the gRPC health service (grpc.health.v1.Health), and nothing else, in plaintext at "
        "HOST:PORT, for probes that cannot do TLS: NOT_SERVING until registered and joined, and while draining",
    )
    out.add_argument(
        "--prometheus",
        type=address_argument,
        metavar="HOST:PORT",
        help="serve metrics for Prometheus to scrape at http://HOST:PORT/metrics (docs/observability.md; port 0: any)",
    )
    tls_flags.add_arguments(out)
    out.add_argument("--flush-interval-ms", type=_millis, default=str(defaults.flush_interval * 1000))
    out.add_argument("--heartbeat-interval-ms", type=_millis, default=str(defaults.heartbeat_interval * 1000))
    out.add_argument("--failure-timeout-ms", type=_millis, default=str(defaults.failure_timeout * 1000))
    out.add_argument("--grace-ms", type=_millis, default=str(defaults.grace * 1000))
    out.add_argument("--data-dir", help="where durable queues keep their messages (default data/NODE_ID)")
    out.add_argument(
        "--membership-check-ms",
        type=_millis,
        default=None,
        help="while the group watch is down, list this node's groups this often to find views its members "
        "missed (default: the failure timeout; 60 times less often while the watch is up)",
    )
    out.add_argument(
        "--recovery-wait-ms",
        type=_millis,
        default=str(defaults.recovery_wait * 1000),
        help="after a restart, how long a durable queue's replicas wait for its master's node before "
        "the replica whose log knows most recovers the queue",
    )
    out.add_argument(
        "--disk-free-limit-mb",
        type=_mebibytes_flag,
        default=str(defaults.disk_free_limit_bytes // MEBIBYTE),
        help="raise the disk alarm, which blocks persistent publishes, while the data directory's disk has "
        f"fewer MiB free than this (default {DEFAULT_DISK_FREE_LIMIT_MB}; 0: never)",
    )
    out.add_argument(
        "--memory-high-watermark-mb",
        type=_mebibytes_flag,
        default=str(defaults.memory_high_watermark_bytes // MEBIBYTE),
        help="raise the memory alarm, which blocks publishers (consumers go on), while the node's resident memory "
        f"is at or above this many MiB (default {DEFAULT_WATERMARK_SHARE * 100:.0f}%% of the machine's; 0: never)",
    )
    out.add_argument(
        "--trace-dir",
        help="also write finished spans as JSON lines to DIR/spans-NODE_ID.jsonl (docs/observability.md); "
        "OTEL_EXPORTER_OTLP_ENDPOINT exports over OTLP (OTEL_EXPORTER_OTLP_PROTOCOL grpc or http/protobuf, "
        "OTEL_TRACES_EXPORTER and OTEL_METRICS_EXPORTER otlp, console or none: services/telemetry.py)",
    )
    out.add_argument(
        "--event-loop",
        default=event_loop.DEFAULT_EVENT_LOOP,
        choices=event_loop.EVENT_LOOPS,
        help=f"the asyncio event loop the node runs on (default {event_loop.DEFAULT_EVENT_LOOP}: libuv's, the "
        "cheaper per message; asyncio: the standard library's)",
    )
    out.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="what the node logs (default INFO)",
    )
    return out


def main(argv: list[str] | None = None, prog: str = "ringq node") -> int:
    """Run a node with `argv` (flags over RINGQ_* variables over a --config file: services/config.py)."""
    arguments = parser(prog)
    args = config.parse(arguments, argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tls = tls_flags.from_arguments(arguments, args, args.listen)
    settings = NodeSettings(
        flush_interval=args.flush_interval_ms,
        heartbeat_interval=args.heartbeat_interval_ms,
        failure_timeout=args.failure_timeout_ms,
        grace=args.grace_ms,
        membership_check=args.membership_check_ms,
        data_dir=args.data_dir or os.path.join("data", args.id),
        recovery_wait=args.recovery_wait_ms,
        disk_free_limit_bytes=args.disk_free_limit_mb,
        memory_high_watermark_bytes=args.memory_high_watermark_mb,
    )
    scrape: Scrape | None = None
    try:
        if args.prometheus is not None:
            from services import prometheus  # the exporter is imported only by nodes that serve it

            scrape = prometheus.start(args.prometheus)
            log.info("node %s serving metrics for Prometheus on http://%s/metrics", args.id, scrape.address)
        readers = [scrape.reader] if scrape is not None else []
        telemetry.configure("ringq-node", args.id, args.trace_dir, metric_readers=readers)
        event_loop.run(
            serve(
                args.id,
                args.listen,
                args.coordinator,
                settings,
                args.ready_file,
                args.advertise,
                tls=tls,
                cluster_listen=args.cluster_listen,
                cluster_advertise=args.cluster_advertise,
                certificate_listen=args.certificate_listen,
                health_listen=args.health_listen,
            ),
            args.event_loop,
        )
    except (OSError, telemetry.TelemetryError) as error:
        print(f"ringq node: {error}", file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown()
        if scrape is not None:
            scrape.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
