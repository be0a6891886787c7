"""Links between nodes (services/gm/links.py), with two real LinkManagers over gRPC on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from ringq.internal.v1 import peer_pb2, peer_pb2_grpc
from services.gm import links
from services.gm.links import LinkManager


class _Peer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, links: LinkManager) -> None:
        self.links = links

    async def Link(self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:  # type: ignore[override]
        await self.links.accept(context)

    async def AddOnRight(
        self, request: peer_pb2.AddOnRightRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> peer_pb2.AddOnRightResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "links only")
        raise AssertionError("unreachable")


class _Node:
    def __init__(self, name: str, addresses: dict[str, str]) -> None:
        self.received: list[str] = []
        self.reconnects: list[str] = []

        async def address_of(node: str) -> str | None:
            return addresses.get(node)

        def on_message(peer: str, message: Any) -> None:
            self.received.append(message.group)

        self.links = LinkManager(name, f"{name}-incarnation", address_of, on_message, self.reconnects.append, 0.05)
        self.server = grpc.aio.server()
        peer_pb2_grpc.add_PeerServiceServicer_to_server(_Peer(self.links), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        addresses[name] = f"127.0.0.1:{port}"

    async def close(self) -> None:
        await self.links.close()
        await self.server.stop(None)


async def _until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


def _message(group: str) -> peer_pb2.RingMessage:
    return peer_pb2.RingMessage(group=group, sender="x", receiver="y", view_version=1)


def test_a_peer_that_dials_again_replaces_the_stream_we_thought_was_up() -> None:
    """Found by the partition test: after a heal, node2 had given its stream to node1 up while node1's
    end still looked alive; node1 refused node2's new dials (ALREADY_EXISTS) and its frames, a newcomer's
    joining Catchup among them, went into the dead stream for good."""

    async def scenario() -> None:
        addresses: dict[str, str] = {}
        one, two = _Node("node1", addresses), _Node("node2", addresses)
        for node in (one, two):
            await node.server.start()
        try:
            one.links.send("node2", _message("before"))
            await _until(lambda: two.received == ["before"])
            # node2 gives up its end without node1 noticing: it forgets the link and dials again.
            stale = two.links._links.pop("node1")
            assert stale.stop_stream is not None
            stale.outbox = asyncio.Queue()  # what node2 queued there is gone with it
            two.links.want({"node1"})
            await _until(lambda: one.reconnects == ["node2"])  # node1 took the new stream, and says so
            one.links.send("node2", _message("after"))
            await _until(lambda: two.received == ["before", "after"])
        finally:
            for node in (one, two):
                await node.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_dial_loop_waiting_out_its_backoff_does_not_refuse_the_peers_dial() -> None:
    """Found by the whole-cluster restart test: node1's channel to a restarted node2 failed fast for up
    to a second (gRPC's reconnect backoff) while node1's dial loop, between attempts, refused node2's own
    dials as the tie-break's loser; neither heard the other for 0.7 s and each recorded the other dead.
    Here node1 cannot dial node2 at all (it does not know its address), so only node2's dial can help."""

    async def scenario() -> None:
        addresses: dict[str, str] = {}
        one, two = _Node("node1", addresses), _Node("node2", addresses)
        for node in (one, two):
            await node.server.start()
        two_address = addresses.pop("node2")  # node1 looks node2 up in vain: its dial loop backs off
        try:
            one.links.want({"node2"})
            await _until(lambda: one.links._links["node2"].dialing)
            two.links.send("node1", _message("hello"))
            await _until(lambda: one.received == ["hello"], seconds=3.0)
            assert one.links.is_connected("node2") and two.links.is_connected("node1")
            addresses["node2"] = two_address
            one.links.send("node2", _message("back"))
            await _until(lambda: two.received == ["back"])
        finally:
            for node in (one, two):
                await node.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize("bound", ["hello-timeout", "tie-break-window"])
def test_a_dial_to_an_address_that_never_answers_does_not_keep_refusing_the_peers_dial(
    monkeypatch: pytest.MonkeyPatch, bound: str
) -> None:
    """node1 dials node2 at an address where something accepts TCP connections but never speaks
    (gRPC's connect waits up to 20 s there, as it does across a partition): while that dial waits for
    the Hello, node1's tie-break refused node2's own dials. Two bounds end it: the wait for the Hello
    as a whole (the write of ours included), and the tie-break's window (a dial older than a tie takes
    refuses nothing). Found by CI: after a partition healed, a mirror did not rejoin within 20 s."""
    if bound == "hello-timeout":
        monkeypatch.setattr(links, "HELLO_TIMEOUT_SECONDS", 0.5, raising=False)
        monkeypatch.setattr(links, "TIE_BREAK_SECONDS", 60.0, raising=False)

    async def scenario() -> None:
        silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
        silent_port = silent.sockets[0].getsockname()[1]
        addresses: dict[str, str] = {}
        one, two = _Node("node1", addresses), _Node("node2", addresses)
        for node in (one, two):
            await node.server.start()
        addresses["node2"], two_address = f"127.0.0.1:{silent_port}", addresses["node2"]
        try:
            one.links.want({"node2"})
            await _until(lambda: one.links._links["node2"].hello_pending_since is not None)
            two.links.send("node1", _message("through"))
            await _until(lambda: one.received == ["through"], seconds=3.0)
            assert one.links.is_connected("node2") and two.links.is_connected("node1")
            addresses["node2"] = two_address
        finally:
            for node in (one, two):
                await node.close()
            silent.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_channel_backs_off_for_at_most_a_quarter_of_the_failure_timeout() -> None:
    """Found by CI: with a 600 ms failure timeout, node2's channel to a restarted node1 was still in its
    up-to-1.2 s reconnect backoff when node2 joined through node1's new member; node1 stayed silent past
    the timeout and its live member was recorded dead."""
    assert dict(links.channel_options(0.6))["grpc.max_reconnect_backoff_ms"] == 150
    assert dict(links.channel_options(10.0))["grpc.max_reconnect_backoff_ms"] == links.MAX_RECONNECT_BACKOFF_MS
    assert dict(links.channel_options(0.01))["grpc.max_reconnect_backoff_ms"] == 50


def test_troubled_peers_are_the_silent_and_the_refusing_only() -> None:
    """The failure detector scans only members that watch a troubled peer (services/node.py), so this set
    must hold every peer a member could suspect: one silent past the timeout, or one whose port refuses."""

    async def scenario() -> None:
        addresses: dict[str, str] = {}
        one, two = _Node("node1", addresses), _Node("node2", addresses)
        for node in (one, two):
            await node.server.start()
        try:
            one.links.want({"node2"})
            await _until(lambda: one.links.is_connected("node2"))
            assert one.links.troubled_peers(silent_longer_than=1.0) == set()
            await asyncio.sleep(0.2)  # heartbeats every 50 ms keep it heard
            assert one.links.troubled_peers(silent_longer_than=1.0) == set()
            assert one.links.troubled_peers(silent_longer_than=-1.0) == {"node2"}  # silence past any bound
            await two.close()  # node2's process is gone: the redial is refused
            await _until(lambda: one.links.refused("node2"))
            assert one.links.troubled_peers(silent_longer_than=3600.0) == {"node2"}
        finally:
            await one.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_refusal_seen_before_a_link_is_wanted_again_does_not_count_against_the_peer() -> None:
    """Regression: node1 died, its member was recorded dead and node2 stopped wanting the link, its last dial
    refused. node1 came back at another port and its new member became node2's neighbour: node2's failure
    detector saw the old refusal and recorded the new member dead within 30 ms, before node2's new dial
    found the new address (tests/test_integration_promotion.py, the master's node restarted)."""

    async def scenario() -> None:
        addresses: dict[str, str] = {}
        one, two = _Node("node1", addresses), _Node("node2", addresses)
        for node in (one, two):
            await node.server.start()
        again = None
        try:
            one.links.want({"node2"})
            await _until(lambda: one.links.is_connected("node2"))
            await two.close()
            await _until(lambda: one.links.refused("node2"))
            one.links.want(set())  # node2's member was recorded dead: no neighbour there any more
            again = _Node("node2", addresses)  # back, at another port
            await again.server.start()
            one.links.want({"node2"})  # its new member is a neighbour
            assert not one.links.refused("node2")
            assert one.links.troubled_peers(silent_longer_than=3600.0) == set()
            await _until(lambda: one.links.is_connected("node2"))
        finally:
            await one.close()
            if again is not None:
                await again.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_an_idle_link_is_kept_heard_by_heartbeats_both_ways() -> None:
    """Heartbeats come from a timer per heartbeat interval (not one per frame): with nothing to send for
    ten intervals, each end still hears the other every interval or so, and ring frames sent meanwhile
    arrive in order."""

    async def scenario() -> None:
        addresses: dict[str, str] = {}
        one, two = _Node("node1", addresses), _Node("node2", addresses)
        for node in (one, two):
            await node.server.start()
        try:
            one.links.want({"node2"})
            two.links.want({"node1"})
            await _until(lambda: one.links.is_connected("node2") and two.links.is_connected("node1"))
            loudest_silence = 0.0
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 0.5  # ten heartbeat intervals of 50 ms
            while loop.time() < deadline:
                loudest_silence = max(loudest_silence, one.links.silent_for("node2"), two.links.silent_for("node1"))
                await asyncio.sleep(0.01)
            assert loudest_silence < 0.4, f"silent for {loudest_silence:.3f} s on an idle link"
            for group in ("g1", "g2", "g3"):
                one.links.send("node2", peer_pb2.RingMessage(group=group))
            await _until(lambda: two.received == ["g1", "g2", "g3"])
        finally:
            for node in (one, two):
                await node.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
