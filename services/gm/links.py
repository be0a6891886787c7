"""Links between broker nodes: one long-lived bidirectional gRPC stream per
pair of nodes, shared by every group in which they are neighbours.

Responsible for: dialling peers on demand, accepting their dials, carrying
PeerFrames both ways in order, heartbeats on idle links, fragmentation of
ring messages over 64 KiB, and telling the node how long each peer has been
silent (the failure detector's input).

Guarantees:
- At most one stream per pair is active. If both nodes dial at once (each
  waiting for the other's Hello), the dial of the node whose id sorts first
  wins; the other is refused. A dial loop between attempts, or a dial stuck
  for longer than a tie takes (TIE_BREAK_SECONDS), refuses nothing.
  A dial from a peer we hold a stream with replaces that stream: a node dials
  only when it has none, so ours is dead at its end (it restarted, or gave the
  stream up during a partition that has healed).
- Frames queued for a peer are sent in order on the active stream. Frames
  written to a stream that breaks may be lost: the node is told of every new
  stream after the first (`on_reconnect`) so that members re-send a Catchup,
  which recovers anything lost (services/gm/ring.py, `resend_catchup`).
- Frames of a newer protocol major version are dropped (rolling upgrade);
  malformed frames are dropped and logged, never passed on.
- With TLS (services/tls.py) a link is with the node its certificate names:
  a dial completes only if the far end proves it is the peer meant, and an
  incoming stream whose Hello names another node than its certificate is
  refused (PERMISSION_DENIED). The node then accepts ring messages on a link
  only from members the peer node hosts (services/node.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ringq.internal.v1 import peer_pb2, peer_pb2_grpc
from ringq.keepalive import CHANNEL_KEEPALIVE
from services.gm.fragments import MAX_FRAGMENT_BYTES, FragmentError, Reassembler, ReassemblyBudget, split
from services.tls import PLAINTEXT, Dialer, caller

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 0
# Large enough for any fragment plus framing; fragments keep frames far below it.
GRPC_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# How long a dial waits for the peer's Hello (the write of ours included).
HELLO_TIMEOUT_SECONDS = 5.0
# A dial of ours that has waited this long for the peer's Hello no longer refuses the peer's own dial:
# two dials crossing get their Hellos within it; an older one is stuck (in TCP's connect, say).
TIE_BREAK_SECONDS = 1.0
# How often a link that stays down while wanted is noted in the log.
SLOW_DIAL_NOTE_SECONDS = 5.0
# The longest a channel waits between attempts to reach a peer that went away; shorter for a node
# with a short failure timeout (channel_options), so a peer that comes back is reached well within it.
MAX_RECONNECT_BACKOFF_MS = 1000


def channel_options(failure_timeout: float | None = None) -> list[tuple[str, int]]:
    """Options of a channel to a peer node. Reconnect quickly after a peer restarts (gRPC's default
    backoff reaches minutes): at most MAX_RECONNECT_BACKOFF_MS between attempts, and at most a quarter
    of `failure_timeout`, or a channel still backing off when its peer came back would leave the peer
    silent past the failure timeout (gRPC adds up to 20 % of jitter)."""
    longest = MAX_RECONNECT_BACKOFF_MS
    if failure_timeout is not None:
        longest = max(50, min(longest, int(failure_timeout * 1000 / 4)))
    return [
        ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.initial_reconnect_backoff_ms", min(50, longest)),
        ("grpc.max_reconnect_backoff_ms", longest),
        *CHANNEL_KEEPALIVE,
    ]


CHANNEL_OPTIONS = channel_options()

log = logging.getLogger("ringq.links")
# The end-of-stream marker of grpc.aio's read(); the type stubs predate it.
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]

RingMessageHandler = Callable[[str, peer_pb2.RingMessage], None]


def frame(**kind: Any) -> peer_pb2.PeerFrame:
    """A PeerFrame of our protocol version carrying `kind`."""
    return peer_pb2.PeerFrame(protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR, **kind)


class _Link:
    """Our side of the link to one peer node."""

    def __init__(self, peer: str, now: float) -> None:
        self.peer = peer
        self.outbox: asyncio.Queue[peer_pb2.PeerFrame] = asyncio.Queue()
        self.last_heard = now
        self.active = False
        self.dialing = False
        # When one of our dials began waiting for the peer's Hello (None while none does, as while the
        # dial loop sleeps between attempts): only a fresh one makes the tie-break refuse the peer's dial.
        self.hello_pending_since: float | None = None
        self.wanted = False
        self.streams = 0
        self.peer_incarnation = ""
        self.next_message_id = 1
        self.stop_stream: Callable[[], None] | None = None
        # When the stream's writer last took a frame from the outbox (the event loop's clock): heartbeats
        # go out only after a heartbeat interval without one.
        self.last_taken = 0.0
        # Set when a dial after a lost link found nothing listening at the peer's
        # address (connection refused): its process is gone, no need to wait out
        # the failure timeout. A paused or partitioned peer is not refused.
        self.refused = False


class LinkManager:
    """All links of one node."""

    def __init__(
        self,
        node: str,
        incarnation: str,
        address_of: Callable[[str], Awaitable[str | None]],
        on_ring_message: RingMessageHandler,
        on_reconnect: Callable[[str], None],
        heartbeat_interval: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        forget_address: Callable[[str], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
        reassembly_budget: ReassemblyBudget | None = None,
        options: list[tuple[str, int]] | None = None,
        dialer: Dialer = PLAINTEXT,
    ) -> None:
        self.node = node
        self.options = options if options is not None else CHANNEL_OPTIONS
        # Opens the channel to a peer; with TLS it completes only if the far end proves it is that peer.
        self.dialer = dialer
        # Partial fragmented messages of all links together stay within this budget.
        self.reassembly_budget = reassembly_budget if reassembly_budget is not None else ReassemblyBudget()
        self.incarnation = incarnation
        self.address_of = address_of
        # Called when a peer refuses at the address we knew: it may have restarted on another port.
        self.forget_address = forget_address
        # Called when a broken link's redial finds nothing listening (see `refused`): the failure detector
        # looks at once instead of at its next pass.
        self.on_refused = on_refused
        self.on_ring_message = on_ring_message
        self.on_reconnect = on_reconnect
        self.heartbeat_interval = heartbeat_interval
        self.clock = clock
        self._links: dict[str, _Link] = {}
        # By (peer, address): with TLS a channel checks the name of the peer it was opened for.
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    # ----------------------------------------------------------------- sending

    def send(self, peer: str, message: peer_pb2.RingMessage) -> None:
        """Queue `message` for `peer`, dialling it if there is no stream yet."""
        link = self._link(peer)
        link.outbox.put_nowait(frame(ring_message=message))
        self._ensure_dial(link)

    def want(self, peers: set[str]) -> None:
        """Keep links to `peers` up (our members' neighbours); let others idle."""
        for peer in peers - {self.node}:
            link = self._link(peer)
            if not link.wanted:
                link.wanted = True
                link.last_heard = max(link.last_heard, self.clock()) if not link.active else link.last_heard
                # A refusal seen before the link was wanted again may be of a process gone since: the peer
                # node may have restarted at another address, hosting the new neighbour. The dial now begun
                # asks again (a first refusal looks the address up anew); until then nothing is refused.
                link.refused = False
            self._ensure_dial(link)
        for peer, link in self._links.items():
            if peer not in peers:
                link.wanted = False

    def silent_for(self, peer: str) -> float:
        """Seconds since anything was heard from `peer` (or since we first wanted it)."""
        link = self._links.get(peer)
        if link is None:
            return 0.0
        return self.clock() - link.last_heard

    def refused(self, peer: str) -> bool:
        """True if the link to `peer` broke and redialling it found nothing listening (its process died)."""
        link = self._links.get(peer)
        return link is not None and not link.active and link.refused

    def troubled_peers(self, silent_longer_than: float) -> set[str]:
        """The peers silent for more than `silent_longer_than` seconds or refusing connections: only a member
        that watches one of them can suspect anything (a node's few links, not its many members, are scanned)."""
        now = self.clock()
        return {
            peer
            for peer, link in self._links.items()
            if now - link.last_heard > silent_longer_than or (not link.active and link.refused)
        }

    def is_idle(self, peer: str) -> bool:
        """True if nothing is waiting to be sent to `peer` (so a flush now adds no queueing)."""
        link = self._links.get(peer)
        return link is None or link.outbox.empty()

    def is_connected(self, peer: str) -> bool:
        link = self._links.get(peer)
        return link is not None and link.active

    async def close(self) -> None:
        self._closed = True
        for link in self._links.values():
            if link.stop_stream is not None:
                link.stop_stream()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for channel in self._channels.values():
            await channel.close(grace=None)

    # ------------------------------------------------------------------ dials

    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = _Link(peer, self.clock())
        return link

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ensure_dial(self, link: _Link) -> None:
        if not link.active and not link.dialing and not self._closed:
            link.dialing = True
            self._spawn(self._dial_loop(link))

    async def _dial_loop(self, link: _Link) -> None:
        backoff = 0.02
        address_checked = False  # refused at an address just asked for: the process is gone
        started = self.clock()
        note_at, last = started + SLOW_DIAL_NOTE_SECONDS, "no address yet"
        try:
            while not self._closed and not link.active and (link.wanted or not link.outbox.empty()):
                if self.clock() >= note_at:  # an operator can tell a link that stays down, and why
                    log.info("link to %s: down for %.0f s (last: %s)", link.peer, self.clock() - started, last)
                    note_at += SLOW_DIAL_NOTE_SECONDS
                address = await self.address_of(link.peer)
                if address is not None:
                    try:
                        await self._dial(link, address)
                        backoff = 0.02
                    except grpc.aio.AioRpcError as error:
                        last = f"{error.code().name} {error.details()}"
                        log.debug("link to %s: %s", link.peer, error.code().name)
                        refused = _connection_refused(error)
                        if refused and not address_checked and self.forget_address is not None:
                            self.forget_address(link.peer)
                            address_checked = True
                            continue
                        was_refused, link.refused = link.refused, link.streams > 0 and refused
                        if link.refused and not was_refused and self.on_refused is not None:
                            self.on_refused(link.peer)
                    except (TimeoutError, ConnectionError, FragmentError) as error:
                        last = repr(error)
                        log.debug("link to %s: %s", link.peer, error)
                if link.active:
                    break
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
        finally:
            link.dialing = False

    async def running_elsewhere(self, address: str, timeout: float) -> bool:
        """Whether another process runs as this node at `address` (it refuses our Hello as its own with
        another incarnation); False if nothing answers there in `timeout` s, or another node does."""
        channel = self.dialer.to_node(self.node, address, self.options)
        try:
            open_link: Any = peer_pb2_grpc.PeerServiceStub(channel).Link
            call: Any = open_link()
            hello = frame(hello=peer_pb2.Hello(node=self.node, incarnation=self.incarnation))
            try:
                await asyncio.wait_for(_write_then_read(call, hello), timeout)
                return False  # another node answered with its Hello
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
                pass
            call.cancel()
            code = await call.code()
            details = await call.details() or ""
            return (
                code == grpc.StatusCode.INVALID_ARGUMENT
                and "cannot link to itself" in details
                and self.incarnation not in details
            )
        except (grpc.aio.AioRpcError, TimeoutError):
            return False
        finally:
            await channel.close(None)

    async def _dial(self, link: _Link, address: str) -> None:
        if link.active:  # the peer's dial was accepted while we looked its address up
            return
        channel = self._channels.get((link.peer, address))
        if channel is None:
            channel = self._channels[link.peer, address] = self.dialer.to_node(link.peer, address, self.options)
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        # Called without a request iterator: the stream is driven by write()/read().
        open_link: Any = stub.Link
        call = open_link()
        link.hello_pending_since = self.clock()
        try:
            hello = frame(hello=peer_pb2.Hello(node=self.node, incarnation=self.incarnation))
            # Bounded as a whole: while it lasts the peer's own dial is refused (the tie-break).
            answer: Any = await asyncio.wait_for(_write_then_read(call, hello), timeout=HELLO_TIMEOUT_SECONDS)
        except TimeoutError:
            call.cancel()
            raise
        finally:
            link.hello_pending_since = None
        if answer is _EOF or answer.WhichOneof("kind") != "hello" or answer.hello.node != link.peer:
            call.cancel()
            raise ConnectionError(f"{link.peer} did not accept the link")
        if link.active:  # an incoming stream won meanwhile
            call.cancel()
            return
        await self._carry(link, answer.hello, call.read, call.write, call.cancel)

    # -------------------------------------------------------------- accepting

    async def accept(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Serve one incoming Link stream (PeerService.Link) until it ends."""
        try:
            first = await asyncio.wait_for(context.read(), timeout=HELLO_TIMEOUT_SECONDS)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no Hello within {HELLO_TIMEOUT_SECONDS:g} s")
        if first is _EOF or first.WhichOneof("kind") != "hello" or not first.hello.node:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a link must open with a Hello naming the node")
        hello = first.hello
        proven = caller(context) if self.dialer.tls is not None else None
        if self.dialer.tls is not None and (proven is None or proven.role != "node" or proven.node != hello.node):
            # With TLS a link speaks only for the node its certificate names.
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"a link's Hello must name the node of its certificate ({proven or 'no member identity'}), "
                f"not {hello.node!r}",
            )
        if hello.node == self.node:
            # The incarnation tells a node probing for a twin (services/node.py) whether it reached itself.
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a node cannot link to itself (node {self.node}, incarnation {self.incarnation})",
            )
        link = self._link(hello.node)
        pending = link.hello_pending_since
        if (
            pending is not None
            and self.clock() - pending < TIE_BREAK_SECONDS
            and self.node < hello.node
            and not link.active
        ):
            # Both dials are in flight: ours wins. A dial loop merely waiting out its backoff (its
            # channel to a restarted peer may fail fast for up to a second) must not refuse the
            # peer's dial: the link would stay down meanwhile and each side find the other silent.
            # Nor may a dial that has waited longer than a tie takes (one begun during a partition
            # waits out TCP's connect while the peer, healed, dials us): the peer's dial is let in.
            log.debug("link to %s: its dial refused, ours is in flight", hello.node)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{self.node} is dialling {hello.node}")
        if link.active and link.stop_stream is not None:
            log.debug("link to %s: its dial replaces the stream we held", hello.node)
            # A peer dials only when it has no stream with us: the one we hold is dead at its end (it
            # restarted, or it gave that stream up during a partition that has healed since, while ours
            # still looked alive). Refusing the new one would leave frames going into the old one, lost.
            link.stop_stream()
        await context.write(frame(hello=peer_pb2.Hello(node=self.node, incarnation=self.incarnation)))
        await self._carry(link, hello, context.read, context.write, lambda: None)

    # --------------------------------------------------------------- carrying

    async def _carry(
        self,
        link: _Link,
        hello: peer_pb2.Hello,
        read: Callable[[], Awaitable[Any]],
        write: Callable[[peer_pb2.PeerFrame], Awaitable[None]],
        cancel: Callable[[], object],
    ) -> None:
        link.active = True
        link.refused = False
        link.streams += 1
        reconnected = link.streams > 1
        link.peer_incarnation = hello.incarnation
        link.last_heard = self.clock()
        reassembler = Reassembler(budget=self.reassembly_budget)
        writer = asyncio.ensure_future(self._write_loop(link, write))
        reader = asyncio.ensure_future(self._read_loop(link, read, reassembler))
        heartbeats = asyncio.ensure_future(self._heartbeats(link))

        def stop() -> None:
            writer.cancel()
            reader.cancel()
            heartbeats.cancel()
            cancel()

        link.stop_stream = stop
        log.debug("link to %s: stream %d up (peer incarnation %s)", link.peer, link.streams, hello.incarnation)
        if reconnected:
            self.on_reconnect(link.peer)
        try:
            await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop()
            for task in (writer, reader, heartbeats):
                with contextlib.suppress(BaseException):
                    await task
            reassembler.release()
            log.debug("link to %s: a stream ended (replaced: %s)", link.peer, link.stop_stream is not stop)
            if link.stop_stream is stop:  # else a newer stream replaced this one: the link is its now
                link.active = False
                link.stop_stream = None
                if not self._closed:
                    self._ensure_dial(link)

    async def _heartbeats(self, link: _Link) -> None:
        """Queue a heartbeat for the peer whenever the writer has taken nothing for a heartbeat interval:
        an idle stream still proves us alive. (A timer per interval, not one per frame written.)"""
        loop = asyncio.get_running_loop()
        interval = self.heartbeat_interval
        link.last_taken = loop.time()
        while True:
            idle = loop.time() - link.last_taken
            if idle >= interval:
                if link.outbox.empty():  # else the writer is busy (or stuck in a write): it needs no more
                    link.outbox.put_nowait(frame(heartbeat=peer_pb2.Heartbeat(sent_at_unix_ms=int(time.time() * 1000))))
                idle = 0.0
            await asyncio.sleep(interval - idle)

    async def _write_loop(self, link: _Link, write: Callable[[peer_pb2.PeerFrame], Awaitable[None]]) -> None:
        outbox = link.outbox
        clock = asyncio.get_running_loop().time
        carried: peer_pb2.PeerFrame | None = None
        while True:
            if carried is not None:
                item, carried = carried, None
            else:
                item = await outbox.get()
            link.last_taken = clock()
            carried = _coalesce(item, outbox)
            if item.ring_message.ByteSize() > MAX_FRAGMENT_BYTES:
                data = item.ring_message.SerializeToString()
                message_id = link.next_message_id
                link.next_message_id += 1
                for fragment in split(data, message_id):
                    await write(frame(fragment=fragment))
            else:
                await write(item)

    async def _read_loop(self, link: _Link, read: Callable[[], Awaitable[Any]], reassembler: Reassembler) -> None:
        while True:
            received = await read()
            if received is _EOF:
                return
            link.last_heard = self.clock()
            if received.protocol_major > PROTOCOL_MAJOR:
                log.warning("dropping a frame of protocol %d from %s", received.protocol_major, link.peer)
                continue
            kind = received.WhichOneof("kind")
            if kind == "ring_message":
                self.on_ring_message(link.peer, received.ring_message)
            elif kind == "fragment":
                try:
                    data = reassembler.add(received.fragment)
                except FragmentError as error:
                    # Closed, not skipped: frames after a lost one would reach the ring out of order; a
                    # new stream makes members re-send their Catchup, which recovers what was lost.
                    log.warning("closing the link from %s: %s", link.peer, error)
                    return
                if data is not None:
                    message = peer_pb2.RingMessage()
                    try:
                        message.ParseFromString(data)
                    except Exception as error:  # protobuf's DecodeError
                        log.warning("dropping an unreadable message from %s: %s", link.peer, error)
                        continue
                    self.on_ring_message(link.peer, message)


async def _write_then_read(call: Any, hello: peer_pb2.PeerFrame) -> Any:
    await call.write(hello)
    return await call.read()


def _connection_refused(error: grpc.aio.AioRpcError) -> bool:
    """gRPC's way of saying the peer's port is closed: UNAVAILABLE, "Connection refused" in the details."""
    text = f"{error.details()} {error.debug_error_string()}"
    return error.code() == grpc.StatusCode.UNAVAILABLE and "Connection refused" in text


def _coalesce(item: peer_pb2.PeerFrame, outbox: asyncio.Queue[peer_pb2.PeerFrame]) -> peer_pb2.PeerFrame | None:
    """Merge into `item` the Activity frames queued right behind it for the same ring.

    Consecutive activities from one sender to one receiver at one view version
    mean the same as one activity listing all their entries in order, so a
    busy link sends fewer, larger frames (batching under load, none when
    idle). Returns the first queued frame that could not be merged, if any.
    """
    if item.WhichOneof("kind") != "ring_message" or item.ring_message.WhichOneof("body") != "activity":
        return None
    head = item.ring_message
    size = head.ByteSize()
    while size < MAX_FRAGMENT_BYTES and not outbox.empty():
        queued = outbox.get_nowait()
        message = queued.ring_message
        if (
            queued.WhichOneof("kind") != "ring_message"
            or message.WhichOneof("body") != "activity"
            or (message.group, message.sender, message.receiver, message.view_version)
            != (head.group, head.sender, head.receiver, head.view_version)
            or message.trace_context
            or head.trace_context
        ):
            return queued
        head.activity.publishers.extend(message.activity.publishers)
        size += message.ByteSize()
    return None
